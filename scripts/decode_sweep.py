"""Device time of the decode path's two kernels (moe_route/kernels/triton/decode.py) per tile
configuration, against the sorted path (maps, GEMM1, GEMM2, finalize) on the same inputs, at
decode sizes. Each figure is a CUDA graph of 16 calls on 16 different routings (the touched
experts change from call to call, so their weights come from HBM, not L2), per call; errors
against the sorted path's output.

    python scripts/decode_sweep.py [--quick | --near | --layouts | --slots]

``--layouts``: the current tiles only, on the weights as they are (k-contiguous) and on
n-contiguous copies of them (``w.transpose(1, 2).contiguous().transpose(1, 2)``: the layout of
a transposed view, as Hugging Face's gpt-oss experts hold them), same values.

``--slots``: the current tiles only, at more slots than the path takes today (``T*K`` up to
256): where the decode kernels (each slot reads its expert's weights; slots of one expert
share them through L2) stop keeping up with the sorted path.
"""

import argparse
import dataclasses
import itertools

import torch

import moe_route
from moe_route import tuning
from moe_route.bench.shapes import model_shape
from moe_route.grouped_gemm import epilogue_for
from moe_route.kernels.triton.decode import moe_decode_triton

SHAPES = {
    "qwen3 T=1": model_shape("qwen3-30b-a3b", 1),
    "qwen3 T=2": model_shape("qwen3-30b-a3b", 2),
    "custom T=1": model_shape("olmoe-1b-7b", 1),  # H=2048, I=1024, E=64, K=8
    "deepseek T=1": model_shape("deepseek-v3", 1),
}
CALLS = 16


def graph_us(fns) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--near", action="store_true", help="the tiles near the best of a sweep")
    p.add_argument("--layouts", action="store_true", help="current tiles, both weight layouts")
    p.add_argument("--slots", action="store_true", help="current tiles, T*K up to 256")
    args = p.parse_args()
    base = tuning.decode_tiles(torch.bfloat16)
    grid = {
        "up_n": [16, 32, 64],
        "up_k": [128, 256],
        "down_n": [16, 32],
        "down_k": [128, 256],
        "num_warps": [4],
        "num_stages": [3, 4],
    }
    if args.near:
        grid = {"up_n": [32, 64], "up_k": [256], "down_n": [16, 32], "down_k": [256],
                "num_warps": [4], "num_stages": [3, 4]}  # fmt: skip
    if args.quick:
        grid = {"up_n": [16, 32], "up_k": [128], "down_n": [16, 32], "down_k": [128],
                "num_warps": [4], "num_stages": [4]}  # fmt: skip
    if args.layouts:
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, dims in SHAPES.items():
            for layout in ("k-contiguous", "n-contiguous"):
                sweep_shape(f"{name} {layout}", dims, [base], base, g, layout == "n-contiguous")
        return
    if args.slots:
        g = torch.Generator(device="cuda").manual_seed(0)
        for model in ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3", "mixtral-8x7b"):
            for T in (2, 4, 8, 16, 32):
                dims = model_shape(model, T)
                if T * dims.K <= 256:
                    sweep_shape(f"{model} T={T}", dims, [base], base, g)
        return
    configs = [base] + [
        dataclasses.replace(base, **dict(zip(grid, v, strict=True)))
        for v in itertools.product(*grid.values())
    ]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, dims in SHAPES.items():
        sweep_shape(name, dims, configs, base, g)


def sweep_shape(name, dims, configs, base, g, n_contiguous=False):
    T, H, inter, E, K = dims.T, dims.H, dims.I, dims.E, dims.K
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    if n_contiguous:
        w1, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    routings = []
    for _ in range(CALLS):
        logits = torch.randn(T, E, device="cuda", generator=g)
        tw, ids = torch.softmax(logits, -1).topk(K, -1)
        routings.append((tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)))
    epi = epilogue_for("swiglu", "concat")
    with torch.no_grad():
        want = moe_route.fused_moe(x, w1, w2, *routings[0])
        # (a captured call takes the sorted path)
        sorted_us = graph_us([lambda r=r: moe_route.fused_moe(x, w1, w2, *r) for r in routings])
    touched = K * T * (3 * H * inter) * 2
    print(f"== {name}: sorted path {sorted_us:.1f} us; touched weights {touched / 1e6:.0f} MB"
          f" (~{touched / 3.0e12 * 1e6:.0f} us at 3 TB/s)")  # fmt: skip
    rows = []
    for cfg in configs:

        def call(r, cfg=cfg):
            return moe_decode_triton(x, w1, w2, r[0], r[1], None, None, None, epi, cfg)

        try:
            got = call(routings[0])
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            us = graph_us([lambda r=r, c=call: c(r) for r in routings])
        except Exception as exc:  # a config that does not compile
            print(f"   {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        rows.append((us, err, cfg))
    rows.sort(key=lambda r: r[0])
    current = next((r[0] for r in rows if r[2] == base), float("nan"))
    print(f"   current {current:.1f} us")
    for us, err, c in rows[:6]:
        print(f"   {us:7.1f} us  err {err:.1e}  up {c.up_n}x{c.up_k} down {c.down_n}x{c.down_k}"
              f" w{c.num_warps} s{c.num_stages}")  # fmt: skip


if __name__ == "__main__":
    main()

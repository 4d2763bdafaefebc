"""The backward's two expert GEMMs at decode sizes (GPU): dX of GEMM1 (``dz @ W1[e]``, W1 read
through its transpose) and GEMM2's backward with the activation's (``dout @ W2[e].T``), per
tile configuration, against the same GEMM on a K-contiguous copy of the weights (what the
forward reads). Each figure is ``do_bench``'s median (L2 flushed); GB/s counts the touched
experts' weights once. Every variant's output is checked against the plan's (within 2e-2:
bf16 outputs of sums in other orders); a mismatch is flagged on its line.

    PYTHONPATH=. python scripts/bwd_decode_sweep.py [--tokens 1 8 64] [--models olmoe-1b-7b]
"""

import argparse
import dataclasses

import torch
import triton

from moe_route import build_routing_maps
from moe_route.bench.harness import Ceilings
from moe_route.bench.shapes import model_shape
from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
from moe_route.kernels.triton.gemm_mainloop import GemmConfig
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
from moe_route.plan import moe_plan
from moe_route.reference import topk_routing_reference

CONFIGS = [  # block_m, block_n, block_k, group_m, warps, stages, tma
    (16, 64, 128, 1, 4, 4, False),
    (16, 128, 64, 1, 4, 4, False),
    (16, 128, 128, 1, 4, 3, False),
    (16, 256, 64, 1, 4, 4, False),
    (16, 64, 128, 1, 4, 4, True),
    (16, 128, 64, 1, 4, 4, True),
    (16, 128, 128, 1, 4, 3, True),
    (16, 256, 64, 1, 4, 4, True),
    (64, 128, 64, 1, 4, 4, True),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3


def rows_for(model, T):
    """``(label, rows)``: each row ``(gemm, config name, output, run, weight bytes, expected)``."""
    dev, dt = "cuda", torch.bfloat16
    s = model_shape(model, T)
    H, inter, E, K = s.H, s.I, s.E, s.K
    M = T * K
    torch.manual_seed(0)
    tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
    tw = tw.to(dt)
    maps = build_routing_maps(ids, E)
    _, d2s, _, off = maps.tensors()
    touched = int((off[1:] > off[:-1]).sum())
    w1 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * H**-0.5
    w2t = (torch.randn(E, H, inter, device=dev, dtype=dt) * inter**-0.5).transpose(1, 2)
    x = torch.randn(T, H, device=dev, dtype=dt)
    plan = moe_plan(x, w1, w2t.transpose(1, 2), K, "swiglu", "concat", "standalone", True, True,
                     False, "auto").configs  # fmt: skip
    dz = torch.randn(M, 2 * inter, device=dev, dtype=dt)
    dout = torch.randn(T, H, device=dev, dtype=dt)
    z = torch.randn(M, 2 * inter, device=dev, dtype=dt)

    def dx(cfg, w):
        out = torch.empty(M, H, device=dev, dtype=dt)
        return out, lambda: grouped_gemm_triton(dz, w, off, out, cfg)

    def act(cfg):
        wh = torch.empty(M, inter, device=dev, dtype=dt)
        dzo = torch.empty_like(z)

        def run():
            grouped_gemm_act_backward_triton(
                dout, w2t, off, d2s, z, tw, wh, dzo, cfg, epilogue=plan.epilogue
            )

        return dzo, run

    w1_bytes = touched * w1[0].numel() * w1.element_size()
    w2_bytes = touched * w2t[0].numel() * w2t.element_size()
    want_dx, run = dx(plan.dx, w1.transpose(1, 2))
    run()
    want_dz, run_act = act(plan.act_bwd.fused)
    run_act()
    rows = [
        ("dX", "K-contiguous copy", *dx(plan.dx, w1.transpose(1, 2).contiguous()), w1_bytes,
         want_dx),
        ("dX", f"plan {dataclasses.astuple(plan.dx)}", want_dx, run, w1_bytes, want_dx),
    ]  # fmt: skip
    rows += [("dX", str(c), *dx(GemmConfig(*c), w1.transpose(1, 2)), w1_bytes, want_dx)
             for c in CONFIGS]  # fmt: skip
    rows.append(("act_bwd", f"plan {dataclasses.astuple(plan.act_bwd.fused)}", want_dz, run_act,
                 w2_bytes, want_dz))  # fmt: skip
    rows += [("act_bwd", str(c), *act(GemmConfig(*c)), w2_bytes, want_dz) for c in CONFIGS]
    return f"{model} T={T} ({touched} experts)", rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--models", nargs="+", default=["olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v3"])
    args = ap.parse_args()
    copy = Ceilings.measure("cuda").copy_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s")
    print(f"{'shape':30} {'gemm':8} {'config':36} {'us':>8} {'GB/s':>7} {'of copy':>8}")
    for model in args.models:
        for T in args.tokens:
            label, rows = rows_for(model, T)
            for gemm, name, out, fn, nbytes, want in rows:
                try:
                    fn()
                    torch.cuda.synchronize()
                    ok = torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)
                    t = bench(fn)
                except Exception as exc:  # a config that does not compile or fit
                    print(f"{label:30} {gemm:8} {name[:36]:36} failed: {type(exc).__name__}")
                    continue
                flag = "" if ok else "  MISMATCH"
                print(f"{label:30} {gemm:8} {name[:36]:36} {t * 1e6:8.1f} "
                      f"{nbytes / t / 1e9:7.0f} {nbytes / t / copy:8.0%}{flag}")  # fmt: skip
            del rows
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

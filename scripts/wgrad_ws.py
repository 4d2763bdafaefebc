"""The warp-specialised weight-gradient kernel (:mod:`moe_route.kernels.triton.weight_grad_ws`)
against the planned kernel and ``torch._grouped_mm`` (GPU, SM90): correctness (float64 oracle
at odd sizes with empty experts; bitwise against the single-stream TMA kernel with the same
tiles) and time, in alternating rounds, at the training shapes.

    PYTHONPATH=. python scripts/wgrad_ws.py [--shapes qwen3 deepseek mixtral] [--rounds 5]
        [--ws R,N,K,STAGES,WARPS[,K_FASTEST,DW_TMA] ...]
"""

import argparse
import sys
from pathlib import Path

import torch

from moe_route.bench.harness import time_interleaved
from moe_route.bench.stages import TRAINING_SHAPES, model_shape
from moe_route.kernels.triton import weight_grad as wg
from moe_route.kernels.triton import weight_grad_ws as ws
from moe_route.kernels.triton.grouped_gemm import num_sms
from moe_route.kernels.triton.weight_grad import WeightGradConfig

sys.path.insert(0, str(Path(__file__).parent))
from wgrad_occupancy import operands


def run_ws(a, b, off, dw, cfg):
    r, n, k, st, w, *rest = cfg
    kf, dt = (rest + [1, 1])[:2]
    E, N, KD = dw.shape
    tiles = E * -(-N // n) * -(-KD // k)
    ws.expert_weight_grad_ws(
        a,
        b,
        off,
        dw,
        r,
        n,
        k,
        st,
        w,
        min(tiles, num_sms(a.device)),
        k_fastest=bool(kf),
        dw_tma=bool(dt),
    )


def run_pp(a, b, off, dw, cfg):
    r, n, k, st = cfg
    E, N, KD = dw.shape
    tiles = E * -(-N // n) * -(-KD // k)
    ws.expert_weight_grad_pp(a, b, off, dw, r, n, k, st, min(tiles, num_sms(a.device)))


def run_any(a, b, off, dw, cfg):
    (run_pp if len(cfg) == 4 else run_ws)(a, b, off, dw, cfg)


def check(cfgs):
    torch.manual_seed(0)
    dev = "cuda"
    for E, N, KD, counts in [
        (5, 200, 136, [0, 37, 64, 1, 130]),
        (3, 256, 128, [512, 0, 77]),
        (4, 64, 64, [0, 0, 0, 0]),
    ]:
        M = sum(counts) + 5  # 5 dropped rows
        off = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), device=dev)
        a = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(M, KD, device=dev, dtype=torch.bfloat16)
        ref = torch.zeros(E, N, KD, dtype=torch.float64, device=dev)
        for e in range(E):
            lo, hi = off[e].item(), off[e + 1].item()
            ref[e] = a[lo:hi].double().T @ b[lo:hi].double()
        for cfg in cfgs:
            dw = torch.full((E, N, KD), float("nan"), device=dev, dtype=torch.bfloat16)
            run_any(a, b, off, dw, cfg)
            torch.cuda.synchronize()
            err = ((dw.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            ok = torch.isfinite(dw).all().item() and err < 1e-2
            same = ""
            if KD % 8 == 0 and N % 8 == 0:
                old = torch.empty_like(dw)
                r, n, k, st = cfg[:4]
                w = cfg[4] if len(cfg) > 4 else 4
                wg.expert_weight_grad_triton(
                    a, b, off, old, WeightGradConfig(r, n, k, w, st, True, 1, flat=True), num_rows=M
                )
                same = f" bitwise-equal-to-tma={torch.equal(old, dw)}"
            print(
                f"check E={E} N={N} KD={KD} counts={counts} cfg={cfg}: rel err {err:.2e} "
                f"{'OK' if ok else 'FAIL'}{same}"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek", "mixtral"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ws", nargs="+", default=["64,128,128,4,4"])
    ap.add_argument("--pp", nargs="*", default=[], help="ping-pong kernels R,N,K,STAGES")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--which", nargs="+", default=["dw1", "dw2"])
    ap.add_argument("--tokens", type=int, nargs="+", help="token counts (default: training's)")
    args = ap.parse_args()
    cfgs = [tuple(int(v) for v in s.split(",")) for s in args.ws + args.pp]
    if not args.no_check:
        check(cfgs)
    for name, shape in [
        (n, model_shape(TRAINING_SHAPES[n].model, t) if t else TRAINING_SHAPES[n])
        for n in args.shapes
        for t in (args.tokens or [None])
    ]:
        for which in args.which:
            a, b, dw, off, d2s, planned = operands(shape, which)
            M = a.shape[0]
            E = dw.shape[0]
            offs32 = off[1:].to(torch.int32)
            fns = {
                "plan": lambda: wg.expert_weight_grad_triton(
                    a, b, off, dw, planned, dest_to_src=d2s, num_rows=M
                ),
                "grouped_mm": lambda: torch._grouped_mm(a.T, b, offs=offs32),
            }
            fns["plan"]()
            want = dw.clone()
            for cfg in cfgs:
                fns[f"ws{cfg}"] = lambda cfg=cfg: run_any(a, b, off, dw, cfg)
            res = {}
            for k, f in fns.items():
                if k.startswith("ws"):
                    dw.fill_(float("nan"))
                    f()
                    res[k] = torch.equal(dw, want)
            timed = time_interleaved(fns, "cuda", use_graph=False, rounds=args.rounds)
            flops = 2 * M * dw.shape[1] * dw.shape[2]
            print(f"{name} T={shape.T} {which} dW {list(dw.shape)} plan {planned}")
            for k in fns:
                us = timed[k][0].median_s * 1e6
                print(
                    f"  {k:28s} {us:9.1f} us {flops / us / 1e6:7.1f} TF/s"
                    f"{'' if k not in res else ' equal-to-plan=' + str(res[k])}"
                )


if __name__ == "__main__":
    main()

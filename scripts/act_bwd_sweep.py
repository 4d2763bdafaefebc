"""GEMM2's backward with the activation's backward (GPU): tile configurations of
``grouped_gemm_act_backward_triton`` at the training shapes, ``dout`` gathered through the maps
and permuted (TMA-fed), against a dense ``mm`` of the same FLOPs in this process; the result of
every variant checked equal (dz, w·h, partials) to the plan's; then the same GEMM with a plain
store (no activation epilogue) and the epilogue's bytes at the copy rate, to split the kernel's
time.

    PYTHONPATH=. python scripts/act_bwd_sweep.py [--shapes mixtral qwen3 deepseek]
"""

import argparse

import torch
import triton

from moe_route import build_routing_maps
from moe_route.bench.harness import Ceilings
from moe_route.bench.shapes import TRAINING_SHAPES as SHAPES
from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
from moe_route.kernels.triton.gemm_mainloop import GemmConfig
from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
from moe_route.plan import moe_plan
from moe_route.reference import topk_routing_reference

CONFIGS = [  # block_m, block_n, block_k, group_m, warps, stages
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 64, 64, 8, 4, 4),
    (128, 256, 64, 8, 8, 3),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    dense = Ceilings.measure(dev).mm_flops_per_s
    print(f"{torch.cuda.get_device_name()}: dense bf16 mm {dense / 1e12:.0f} TFLOP/s")
    for name in args.shapes:
        s = SHAPES[name]
        T, H, inter, E, K = s.T, s.H, s.I, s.E, s.K
        M = T * K
        tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
        tw = tw.to(dt)
        maps = build_routing_maps(ids, E)
        _, d2s, _, off = maps.tensors()
        x = torch.randn(T, H, device=dev, dtype=dt)
        w1 = torch.empty(E, 2 * inter, H, device=dev, dtype=dt)
        w2t = (torch.randn(E, H, inter, device=dev, dtype=dt) * H**-0.5).transpose(1, 2)
        plan = moe_plan(x, w1, w2t.transpose(1, 2), K, "swiglu", "concat", "standalone", True, True,
                         False, "auto").configs  # fmt: skip
        dout = torch.randn(T, H, device=dev, dtype=dt)
        dout_perm = dout[d2s % T]
        z = torch.randn(M, 2 * inter, device=dev, dtype=dt)
        wh, dz = torch.empty(M, inter, device=dev, dtype=dt), torch.empty_like(z)
        flops = 2 * M * H * inter

        def run(cfg, permuted, wh=wh, dz=dz, dout=dout, dout_perm=dout_perm, w2t=w2t, off=off,
                d2s=d2s, z=z, tw=tw, plan=plan):  # fmt: skip
            return grouped_gemm_act_backward_triton(
                dout_perm if permuted else dout,
                w2t,
                off,
                d2s,
                z,
                tw,
                wh,
                dz,
                cfg,
                epilogue=plan.epilogue,
                permuted=permuted,
            )

        ref = [t.clone() for t in (run(plan.act_bwd.fused, False), wh, dz)]
        print(f"{name} T={T}: dz [{M}x{2 * inter}] from [{M}x{H}] @ [{H}x{inter}] per expert")
        fused = plan.act_bwd.fused
        variants = [("plan, gathered", fused, False), ("plan, permuted", fused, True)]
        variants += [
            (f"permuted {c}", GemmConfig(*c, use_tma=True), True) for c in CONFIGS
        ]  # fmt: skip
        for label, cfg, permuted in variants:
            try:
                part = run(cfg, permuted)
                same = part.shape != ref[0].shape or torch.equal(part, ref[0])
                same = same and torch.equal(wh, ref[1]) and torch.equal(dz, ref[2])
                t = bench(lambda cfg=cfg, permuted=permuted: run(cfg, permuted))
                verdict = "equal" if same else "DIFFERS"
                print(f"  {label:40s} {t * 1e6:8.1f} us {flops / t / 1e12:5.0f} TFLOP/s "
                      f"{flops / t / dense:4.0%} of dense  {verdict}")  # fmt: skip
            except Exception as exc:
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}")
        split_costs(dout_perm, w2t, off, plan.act_bwd.fused, (z, dz, wh), flops, dense)
        del z, dz, wh


def split_costs(dout_perm, w2t, off, act_bwd, epilogue_tensors, flops, dense):
    """Where the time goes: the same GEMM with a plain store (``g = dout @ W2[e]`` in 16 bits,
    no activation epilogue), on the plan's tiles and persistent, and the epilogue's bytes
    (``z`` read, ``dz`` and ``w*h`` written) copied at the copy rate."""
    M, inter = dout_perm.shape[0], w2t.shape[1]
    g = dout_perm.new_empty(M, inter)
    plain = [("plain GEMM, plan's tiles", act_bwd)]
    plain += [(f"plain GEMM, persistent {c}", GemmConfig(*c, use_tma=True, persistent=1))
              for c in ((128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3))]  # fmt: skip
    for label, cfg in plain:
        try:
            t = bench(lambda cfg=cfg: grouped_gemm_triton(dout_perm, w2t, off, g, cfg))
            print(f"  {label:40s} {t * 1e6:8.1f} us {flops / t / 1e12:5.0f} TFLOP/s "
                  f"{flops / t / dense:4.0%} of dense")  # fmt: skip
        except Exception as exc:
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}")
    epi_bytes = sum(t.numel() * t.element_size() for t in epilogue_tensors)
    src = torch.empty(epi_bytes // 4, device=dout_perm.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    print(f"  {'epilogue bytes, copied':40s} {t * 1e6:8.1f} us ({epi_bytes / 1e6:.0f} MB "
          "read and written)")  # fmt: skip


if __name__ == "__main__":
    main()

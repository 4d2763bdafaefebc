"""Step 1 of the backward both ways (GPU): the fused kernel (GEMM2's input gradient with the
activation's backward in its epilogue) against the split (the plain grouped GEMM storing ``g``,
then the row pass of ``moe_route.kernels.triton.act_backward``), at the training shapes, on
the plan's tiles (whichever way the plan picks), ``dout`` permuted as the backward reads it on
Hopper. One table: median times (``triton.testing.do_bench``), the row pass's bytes over its
time as a fraction of the copy rate, and the split's largest differences from the fused kernel
(``dz``, ``w·h``, the router partials summed per row; absolute / relative to the largest value).

    PYTHONPATH=. python scripts/act_bwd_split.py [--shapes qwen3 mixtral deepseek]
        [--rows 32x128x4 64x128x8]   # row-pass tiles to try besides the plan's: BMxBNxWARPS
"""

import argparse

import torch
import triton

from moe_route import build_routing_maps
from moe_route.bench.harness import Ceilings
from moe_route.bench.stages import TRAINING_SHAPES as SHAPES
from moe_route.kernels.triton.act_backward import RowPassConfig, act_backward_rows_triton
from moe_route.kernels.triton.expand import expand_rows_triton
from moe_route.kernels.triton.grouped_gemm import (
    grouped_gemm_act_backward_triton,
    grouped_gemm_triton,
)
from moe_route.moe import _plan_for
from moe_route.reference import topk_routing_reference

DEVICE, DTYPE = "cuda", torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def diff(got, want):
    err = (got.float() - want.float()).abs().max().item()
    return f"{err:.2g}/{err / max(want.float().abs().max().item(), 1e-30):.1g}"


def run_shape(name, row_configs, copy_rate):
    s = SHAPES[name]
    T, H, inter, E, K = s.T, s.H, s.I, s.E, s.K
    dev, dt = DEVICE, DTYPE
    M = T * K
    tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K)
    tw = tw.to(dt)
    s2d, d2s, efs, off = build_routing_maps(ids, E).tensors()
    x = torch.randn(T, H, device=dev, dtype=dt)
    w1 = torch.empty(E, 2 * inter, H, device=dev, dtype=dt)
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt) * H**-0.5
    w2t = w2.transpose(1, 2)
    plan = _plan_for(x, w1, w2, K, "swiglu", "concat", "standalone", True, False, "auto").configs
    ab, epi = plan.act_bwd, plan.epilogue
    print(f"{name} T={T}: plan split={ab.split}; fused {ab.fused}; gemm {ab.gemm}; rows {ab.rows}")
    dout = torch.randn(T, H, device=dev, dtype=dt)
    dout_perm = dout.new_empty(M, H)
    expand_rows_triton(dout, s2d, efs, dout_perm)
    z = torch.randn(M, 2 * inter, device=dev, dtype=dt)
    wh_f, dz_f = z.new_empty(M, inter), torch.empty_like(z)
    g, wh_s, dz_s = z.new_empty(M, inter), z.new_empty(M, inter), torch.empty_like(z)

    def fused():
        return grouped_gemm_act_backward_triton(dout_perm, w2t, off, d2s, z, tw, wh_f, dz_f,
                                                ab.fused, epilogue=epi, permuted=True)  # fmt: skip

    def gemm(out=g):
        grouped_gemm_triton(dout_perm, w2t, off, out, ab.gemm)

    def split(rows):  # as the backward runs it: g in w·h's buffer
        gemm(wh_s)
        return act_backward_rows_triton(wh_s, z, tw, off, d2s, wh_s, dz_s, rows, epilogue=epi)

    routed = int(off[-1])
    part_f = fused()[:routed].double().sum(1)
    t_fused, t_gemm = bench(fused), bench(gemm)
    out = []
    for rows in [ab.rows, *(c for c in row_configs if c != ab.rows)]:
        part_s = split(rows)[:routed].double().sum(1)
        diffs = (diff(dz_s, dz_f), diff(wh_s, wh_f), diff(part_s, part_f))
        t_rows = bench(lambda rows=rows: act_backward_rows_triton(g, z, tw, off, d2s, wh_s, dz_s,
                                                                  rows, epilogue=epi))  # fmt: skip
        t_split = bench(lambda rows=rows: split(rows))
        es = z.element_size()
        nt = triton.cdiv(inter, rows.block_n)
        # g, z read; w·h, dz, the partials written; the maps and router weights read
        row_bytes = M * (6 * inter * es + nt * 4 + 8 + es)
        label = f"{name} {rows.block_m}x{rows.block_n}x{rows.num_warps}"
        out.append((label, t_fused, t_gemm, t_rows, t_split, row_bytes / t_rows / copy_rate,
                    *diffs))  # fmt: skip
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="*", default=[], help="row-pass tiles BMxBNxWARPS")
    args = ap.parse_args()
    row_configs = [RowPassConfig(*map(int, r.split("x"))) for r in args.rows]
    copy_rate = Ceilings.measure("cuda").copy_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {copy_rate / 1e12:.2f} TB/s (read + written)")
    table = []
    for name in args.shapes:
        table += run_shape(name, row_configs, copy_rate)
        torch.cuda.empty_cache()
    head = ("shape, row tiles", "fused us", "gemm us", "rows us", "split us", "split/fused",
            "rows/copy", "dz diff", "w·h diff", "Σ partial diff")  # fmt: skip
    print("\n" + " | ".join(head))
    for label, tf, tg, tr, ts, frac, *diffs in table:
        print(f"{label} | {tf * 1e6:.0f} | {tg * 1e6:.0f} | {tr * 1e6:.0f} | {ts * 1e6:.0f} | "
              f"{ts / tf:.2f} | {frac:.0%} | " + " | ".join(diffs))  # fmt: skip


if __name__ == "__main__":
    main()

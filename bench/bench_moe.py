"""The whole MoE forward and its GEMMs (the suite's forward and gemm stages), and a GEMM sweep.

Without ``--sweep`` this is ``python -m moe_route bench --stages forward gemm --name moe``:
:func:`moe_route.fused_moe` (standalone finalize, and the epilogue-fused one) next to the
``torch._grouped_mm`` pipeline and the per-expert loop (``moe_route/bench/baselines.py``),
GEMM1 and GEMM2 + finalize on their own, at the standard shapes, with every option of the
suite (``--no-loop``, ``--quick``, ``--shapes``, ...). ``--sweep`` also times GEMM1 and GEMM2
under each tile configuration of :data:`SWEEP_CONFIGS`, with and without TMA, and writes
``gemm_sweep.{json,csv}``; ``--sweep-fused`` (alone) times GEMM2 + the standalone finalize
against GEMM2 with the ordered fused finalize under :data:`FUSED_CONFIGS` and writes
``fused_sweep.{json,csv}``.

Usage: ``python bench/bench_moe.py [--quick] [--no-loop] [--sweep | --sweep-fused] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from harness import Ceilings, environment, make_row, print_table, time_cuda, write_results

import moe_route
from moe_route.bench.suite import stage_main

# name, T, H, I, E, K: the shapes of the GEMM sweep (DESIGN.md's standard shapes)
SWEEP_SHAPES = [
    ("mixtral-8x7b", 4096, 4096, 14336, 8, 2),
    ("mixtral-8x7b", 32768, 4096, 14336, 8, 2),
    ("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    ("deepseek-v3", 4096, 7168, 2048, 256, 8),
]


FUSED_EXTRA_SHAPES = [
    ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8),
    ("deepseek-v3", 16384, 7168, 2048, 256, 8),
]

SWEEP_CONFIGS = [  # GemmConfig's tiles: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 8, 3),
    (256, 64, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
]


def sweep_gemms(name, T, H, I, E, K, ceil, rows, tmas=(False, True)):  # noqa: E741
    """Time GEMM1 (swiglu, gathered) and GEMM2 under each tile configuration."""
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
    from moe_route.plan import epilogue_for

    dev, dt = "cuda", torch.bfloat16
    shape = f"{name} T={T}"
    x = torch.randn(T, H, device=dev, dtype=dt)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    maps = moe_route.build_routing_maps(ids, E)
    M = T * K
    offs, d2s = maps.expert_first_token_offset, maps.expanded_dest_row_to_expanded_source_row
    h = torch.empty(M, I, device=dev, dtype=dt)
    y = torch.empty(M, H, device=dev, dtype=dt)
    x_perm = moe_route.expand_rows(x, maps)
    swiglu = epilogue_for("swiglu", "concat")
    for tiles, tma in [(c, tma) for c in SWEEP_CONFIGS for tma in tmas]:
        cfg = GemmConfig(*tiles, use_tma=tma)
        for stage, flops, fn in (
            ("gemm1", 4 * M * H * I, lambda c=cfg: grouped_gemm_triton(
                x, w1, offs, h, c, epilogue=swiglu, dest_to_src=d2s, num_rows=M)),
            ("gemm1 x_perm", 4 * M * H * I, lambda c=cfg: grouped_gemm_triton(
                x_perm, w1, offs, h, c, epilogue=swiglu)),
            ("gemm2", 2 * M * H * I, lambda c=cfg: grouped_gemm_triton(h, w2, offs, y, c)),
        ):  # fmt: skip
            try:
                t = time_cuda(fn, inner=3, outer=10)
            except Exception as exc:  # a config may not fit the shared memory
                print(f"{stage} {tiles}: {type(exc).__name__}")
                continue
            rows.append(
                make_row(stage, shape, "/".join(map(str, tiles)) + " tma" * tma, t, ceil, 0,
                         flops, of_dense=flops / t.median_s / ceil.mm_flops_per_s)
            )  # fmt: skip


# GEMM2 tile configurations for the ordered fused finalize (None: GEMM2's own choice, whose
# rows are then bit for bit the standalone path's); TMA as the library decides.
FUSED_CONFIGS = [None, (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3)]


def sweep_fused(name, T, H, I, E, K, ceil, rows):  # noqa: E741
    """GEMM2 + finalize: the standalone pair against the ordered fused epilogue per config."""
    from moe_route import arch, tuning
    from moe_route.kernels.triton.finalize import finalize_triton
    from moe_route.kernels.triton.gemm_finalize import grouped_gemm_finalize_triton
    from moe_route.kernels.triton.gemm_mainloop import GemmConfig
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton

    dev, dt = "cuda", torch.bfloat16
    shape = f"{name} T={T}"
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.rand(T, K, device=dev).softmax(dim=1)
    maps = moe_route.build_routing_maps(ids, E)
    M = T * K
    s2d, d2s, efs, offs = maps.tensors()
    h = torch.randn(M, I, device=dev, dtype=dt)
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    y = torch.empty(M, H, device=dev, dtype=dt)
    out = torch.empty(T, H, device=dev, dtype=dt)
    flops = 2 * M * H * I
    # GEMM2's tiles as fused_moe's plan picks them (by the token bucket).
    gemm2 = tuning.gemm_config(
        tuning.token_bucket(T) * K / E, False, dt, arch.compute_capability(h.device)
    )

    def standalone():
        grouped_gemm_triton(h, w2, offs, y, gemm2)
        finalize_triton(y, tw, s2d, efs, None, out)

    impls = [
        ("standalone", standalone),
        ("gemm2 alone", lambda: grouped_gemm_triton(h, w2, offs, y, gemm2)),
    ]
    for tiles in FUSED_CONFIGS:
        label = "fused " + ("auto" if tiles is None else "/".join(map(str, tiles)))
        cfg = gemm2 if tiles is None else GemmConfig(*tiles, use_tma=gemm2.use_tma)
        impls.append((label, lambda c=cfg: grouped_gemm_finalize_triton(
            h, w2, offs, s2d, d2s, efs, tw, out, c, ordered=True)))  # fmt: skip
    for label, fn in impls:
        try:
            t = time_cuda(fn, inner=3, outer=10)
        except Exception as exc:  # a config may not fit the shared memory
            print(f"gemm2+fin {label}: {type(exc).__name__}: {exc}")
            continue
        rows.append(make_row("gemm2+fin", shape, label, t, ceil, 0, flops,
                             of_dense=flops / t.median_s / ceil.mm_flops_per_s))  # fmt: skip


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sweep", action="store_true", help="also sweep GEMM tile configurations")
    pre.add_argument(
        "--sweep-fused", action="store_true",
        help="only sweep GEMM2 + finalize: standalone against the ordered fused epilogue",
    )  # fmt: skip
    pre.add_argument("--out")
    args, rest = pre.parse_known_args(argv)
    if args.out:
        rest += ["--out", args.out]
    rc = 0
    if not args.sweep_fused:
        rc = stage_main(["forward", "gemm"], "moe", rest, doc=__doc__)
    if not (args.sweep or args.sweep_fused) or "-h" in rest or "--help" in rest:
        return rc
    if not torch.cuda.is_available():
        print("bench_moe --sweep: no CUDA device here; the sweep needs one")
        return rc
    ceil = Ceilings.measure()
    env = environment(ceil)
    rows = []
    sweep, shapes = sweep_gemms, SWEEP_SHAPES
    if args.sweep_fused:
        sweep, shapes = sweep_fused, SWEEP_SHAPES + FUSED_EXTRA_SHAPES
    for shape in shapes:
        sweep(*shape, ceil, rows)
        torch.cuda.empty_cache()
    name = "fused_sweep" if args.sweep_fused else "gemm_sweep"
    write_results(rows, env, args.out or os.environ.get("OUT", "bench/results"), name)
    print_table(rows, env)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the whole MoE forward (routing maps → output) and its GEMMs.

Timed in one process, after measuring the copy bandwidth and bf16 matmul rate:

* ``moe_route`` — :func:`moe_route.fused_moe` (standalone finalize, and the fused one);
* ``grouped_mm`` — ``argsort`` maps + gather + ``torch._grouped_mm`` ×2 + ``index_add_``;
* ``loop`` — the per-expert loop of usual model code (syncs per expert; eager, fewer runs).

Also GEMM1 alone against the dense matmul rate, GEMM2 + standalone finalize against the
epilogue-fused finalize, and decode latency against the time to read the touched experts'
weights. Usage: ``python bench/bench_moe.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Ceilings, environment, make_row, print_table, time_cuda, write_results

import moe_route

# name, T, H, I, E, K (DESIGN.md's standard shapes)
SHAPES = [
    ("mixtral-8x7b", 4096, 4096, 14336, 8, 2),
    ("mixtral-8x7b", 32768, 4096, 14336, 8, 2),
    ("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8),
    ("deepseek-v3", 4096, 7168, 2048, 256, 8),
    ("deepseek-v3", 16384, 7168, 2048, 256, 8),
    ("decode", 1, 2048, 1024, 64, 8),
    ("decode", 8, 2048, 1024, 64, 8),
    ("decode", 64, 2048, 1024, 64, 8),
    ("decode", 64, 7168, 2048, 256, 8),
]
QUICK = [0, 2, 4, 8]


def grouped_mm_forward(x, w1t, w2t, topk_weights, topk_ids):
    """The ``torch._grouped_mm`` pipeline a user would write (no host sync, index_add_ reduce)."""
    K = topk_ids.shape[1]
    E = w1t.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // K
    h = torch._grouped_mm(x[token], w1t, offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2t, offs=offs)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def loop_forward(x, w1, w2, topk_weights, topk_ids):
    """Per-expert loop, as in many model files (one boolean mask and sync per expert)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_shape(name, T, H, I, E, K, ceil, rows, with_loop=True):  # noqa: E741
    dev, dt = "cuda", torch.bfloat16
    shape = f"{name} T={T}"
    x = torch.randn(T, H, device=dev, dtype=dt)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    logits = torch.randn(T, E, device=dev)
    topk_weights, topk_ids = moe_route.reference.topk_routing_reference(logits, K, renormalize=True)
    M = T * K
    touched = int(torch.unique(topk_ids).numel())
    flops = 6 * M * H * I
    weight_bytes = touched * 3 * I * H * 2
    nbytes = 2 * T * H * 2 + weight_bytes + T * K * 8
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    base = time_cuda(lambda: grouped_mm_forward(x, w1t, w2t, topk_weights, topk_ids))
    ref = grouped_mm_forward(x, w1t, w2t, topk_weights, topk_ids)
    rows.append(make_row("forward", shape, "grouped_mm", base, ceil, nbytes, flops))
    loop = None
    if with_loop:
        loop = time_cuda(
            lambda: loop_forward(x, w1, w2, topk_weights, topk_ids),
            use_graph=False,
            inner=2,
            outer=5,
        )
        rows.append(make_row("forward", shape, "loop", loop, ceil, nbytes, flops))

    def ours(**kw):
        return moe_route.fused_moe(x, w1, w2, topk_weights, topk_ids, **kw)

    for label, kw in (
        ("moe_route", {}),
        ("moe_route fused", {"finalize": "fused", "deterministic": False}),
    ):
        err = rel_err(ours(**kw), ref)
        assert err < 2e-2, (shape, label, err)
        t = time_cuda(lambda kw=kw: ours(**kw))
        extra = {"x_grouped_mm": base.median_s / t.median_s, "rel_err": err}
        if loop is not None:
            extra["x_loop"] = loop.median_s / t.median_s
        if name == "decode":
            extra["x_weight_read"] = t.median_s / (weight_bytes / ceil.copy_bytes_per_s)
        rows.append(make_row("forward", shape, label, t, ceil, nbytes, flops, **extra))

    # The stages: GEMM1 against the dense rate, GEMM2 + finalize standalone against fused.
    maps = moe_route.build_routing_maps(topk_ids, E)
    g1 = time_cuda(lambda: moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True))
    g1_flops = 4 * M * H * I
    g1_bytes = T * H * 2 + weight_bytes * 2 // 3 + M * I * 2
    rows.append(
        make_row("gemm1", shape, "moe_route", g1, ceil, g1_bytes, g1_flops,
                 tflops=g1_flops / g1.median_s / 1e12,
                 of_dense=g1_flops / g1.median_s / ceil.mm_flops_per_s)
    )  # fmt: skip
    h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True)

    def standalone():
        y = moe_route.grouped_gemm(h, w2, maps)
        return moe_route.finalize_moe_routing(y, topk_weights, maps)

    def fused():
        return moe_route.moe._gemm2_fused_finalize_op(
            h, w2, maps.expert_first_token_offset, maps.expanded_source_row_to_expanded_dest_row,
            maps.expanded_dest_row_to_expanded_source_row, maps.expert_for_source_row,
            topk_weights, None, None, False, "auto",
        )  # fmt: skip

    g2_flops = 2 * M * H * I
    g2_bytes = M * I * 2 + weight_bytes // 3 + T * H * 2
    t_sa = time_cuda(standalone)
    t_fu = time_cuda(fused)
    rows.append(make_row("gemm2+fin", shape, "standalone", t_sa, ceil, g2_bytes, g2_flops))
    rows.append(
        make_row("gemm2+fin", shape, "fused (atomic)", t_fu, ceil, g2_bytes, g2_flops,
                 x_standalone=t_sa.median_s / t_fu.median_s)
    )  # fmt: skip


SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 8, 3),
    (256, 64, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
]


def sweep_gemms(name, T, H, I, E, K, ceil, rows, tmas=(False, True)):  # noqa: E741
    """Time GEMM1 (swiglu, gathered) and GEMM2 under each tile configuration."""
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton

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
    for cfg, tma in [(c, tma) for c in SWEEP_CONFIGS for tma in tmas]:
        for stage, flops, fn in (
            ("gemm1", 4 * M * H * I, lambda c=cfg, u=tma: grouped_gemm_triton(
                x, w1, offs, h, activation="swiglu", dest_to_src=d2s, gather=True,
                num_rows=M, config=c, use_tma=u)),
            ("gemm1 x_perm", 4 * M * H * I, lambda c=cfg, u=tma: grouped_gemm_triton(
                x_perm, w1, offs, h, activation="swiglu", config=c, use_tma=u)),
            ("gemm2", 2 * M * H * I, lambda c=cfg, u=tma: grouped_gemm_triton(
                h, w2, offs, y, config=c, use_tma=u)),
        ):  # fmt: skip
            try:
                t = time_cuda(fn, inner=3, outer=10)
            except Exception as exc:  # a config may not fit the shared memory
                print(f"{stage} {cfg}: {type(exc).__name__}")
                continue
            rows.append(
                make_row(stage, shape, "/".join(map(str, cfg)) + " tma" * tma, t, ceil, 0, flops,
                         of_dense=flops / t.median_s / ceil.mm_flops_per_s)
            )  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    p.add_argument("--sweep", action="store_true", help="also sweep GEMM tile configurations")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe: no CUDA device here; it needs one (see scripts/gpu_check.sh)")
        return 0
    shapes = [SHAPES[i] for i in QUICK] if args.quick else SHAPES
    ceil = Ceilings.measure()
    env = environment(ceil)
    rows = []
    for s in shapes:
        bench_shape(*s, ceil, rows, with_loop=not args.no_loop and s[1] <= 8192)
        torch.cuda.empty_cache()
    if args.sweep:
        for i in (0, 1, 2, 4):
            sweep_gemms(*SHAPES[i], ceil, rows)
    write_results(rows, env, args.out, "moe")
    print_table(rows, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())

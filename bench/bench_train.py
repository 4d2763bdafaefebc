"""Benchmark MoE training: forward + backward time, peak memory and saved activations.

Timed in one process, after measuring the copy bandwidth and bf16 matmul rate, each as
``torch.autograd.grad(out, [x, w1, w2, topk_weights], dout)`` after the forward:

* ``moe_route`` — :func:`moe_route.fused_moe` (saves ``x``, GEMM1's pre-activation, routing);
* ``grouped_mm`` — ``argsort`` maps + gather + ``torch._grouped_mm`` ×2 + ``index_add_``,
  differentiated by ``torch.autograd``;
* ``loop`` — the per-expert loop of usual model code under ``torch.autograd`` (eager).

Roofline floor of forward + backward: ``18·M·H·I`` FLOPs (the forward's ``6·M·H·I``, twice
that for ``dX`` and ``dW``) against the dense rate, or the bytes of reading the weights twice and
writing their gradients, whichever is larger. Memory: peak allocated during forward + backward
above what the inputs hold, and the bytes the forward saves for the backward (measured with
``saved_tensors_hooks``, parameters and inputs excluded), per token.

Usage: ``python bench/bench_train.py [--quick] [--no-loop] [--out DIR]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import moe_route
from moe_route.bench.harness import (
    Ceilings,
    environment,
    make_row,
    print_table,
    time_cuda,
    write_results,
)

# name, T, H, I, E, K (DESIGN.md's standard shapes)
SHAPES = [
    ("mixtral-8x7b", 4096, 4096, 14336, 8, 2),
    ("mixtral-8x7b", 32768, 4096, 14336, 8, 2),
    ("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8),
    ("deepseek-v3", 4096, 7168, 2048, 256, 8),
    ("deepseek-v3", 16384, 7168, 2048, 256, 8),
]
QUICK = [0, 2, 4]


def grouped_mm_moe(x, w1, w2, topk_weights, topk_ids):
    """The ``torch._grouped_mm`` pipeline a user would write, differentiable end to end."""
    K = topk_ids.shape[1]
    E = w1.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // K
    h = torch._grouped_mm(x[token], w1.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add(0, token, y)


def loop_moe(x, w1, w2, topk_weights, topk_ids):
    """Per-expert loop, as in many model files (one boolean mask and sync per expert); ``w1``
    and ``w2`` are lists of per-expert weights, as an ``nn.ModuleList`` of experts holds them."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(len(w1)):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out = out.index_add(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def moe_route_moe(x, w1, w2, topk_weights, topk_ids):
    return moe_route.fused_moe(x, w1, w2, topk_weights, topk_ids)


IMPLS = {"moe_route": moe_route_moe, "grouped_mm": grouped_mm_moe, "loop": loop_moe}


def step(fn, args, leaves, ids, dout):
    out = fn(*args, ids)
    return torch.autograd.grad(out, leaves, dout)


def saved_bytes(fn, args, leaves, ids):
    """Bytes the forward saves for backward, excluding the leaves' own storage."""
    own = {t.untyped_storage().data_ptr() for t in leaves}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, ids)
    del out
    return total


def peak_bytes(fn, args, leaves, ids, dout):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = step(fn, args, leaves, ids, dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    return peak


def rel_err(a, b):
    """Relative error on at most the first two experts (no float32 copies of whole grads)."""
    if a.dim() == 3:
        a, b = a[:2], b[:2]
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_shape(name, T, H, I, E, K, ceil, rows, with_loop=True):  # noqa: E741
    dev, dt = "cuda", torch.bfloat16
    shape = f"{name} T={T}"
    x = torch.randn(T, H, device=dev, dtype=dt).requires_grad_(True)
    w1 = (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5).requires_grad_(True)
    w2 = (torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5).requires_grad_(True)
    logits = torch.randn(T, E, device=dev)
    tw, ids = moe_route.reference.topk_routing_reference(logits, K, renormalize=True)
    tw = tw.requires_grad_(True)
    dout = torch.randn(T, H, device=dev, dtype=dt)
    leaves = [x, w1, w2, tw]
    M = T * K
    flops = 18 * M * H * I
    nbytes = 3 * (3 * I * H * 2) * E + 4 * T * H * 2
    results = {}
    grad_bytes = (w1.numel() + w2.numel()) * 2
    base_grads = step(grouped_mm_moe, leaves, leaves, ids, dout)
    for impl, fn in IMPLS.items():
        if impl == "loop" and not with_loop:
            continue
        args, params = leaves, leaves
        if impl == "loop":
            w1s = [w.detach().clone().requires_grad_(True) for w in w1]
            w2s = [w.detach().clone().requires_grad_(True) for w in w2]
            args, params = [x, w1s, w2s, tw], [x, tw, *w1s, *w2s]
            t = time_cuda(lambda fn=fn, a=args, p=params: step(fn, a, p, ids, dout),
                          use_graph=False, inner=1, outer=5, warmup=1)  # fmt: skip
        else:
            t = time_cuda(lambda fn=fn, a=args, p=params: step(fn, a, p, ids, dout), inner=3,
                          outer=15)  # fmt: skip
        results[impl] = t
        peak = peak_bytes(fn, args, params, ids, dout)
        extra = {
            "peak_gb": peak / 1e9,
            # the same for every implementation: the weight gradients themselves
            "peak_minus_weight_grads_gb": (peak - grad_bytes) / 1e9,
            "saved_bytes_per_token": saved_bytes(fn, args, params, ids) / T,
        }
        if impl == "loop":
            del args, params, w1s, w2s
        if impl == "moe_route":
            grads = step(fn, args, params, ids, dout)
            extra["max_rel_err_vs_grouped_mm"] = max(
                rel_err(a, b) for a, b in zip(grads, base_grads, strict=True)
            )
            del grads
        rows.append(make_row("train", shape, impl, t, ceil, nbytes, flops, **extra))
    ours = rows[-len(results)]
    base = next(r for r in rows[-len(results) :] if r.impl == "grouped_mm")
    ours.extra["x_grouped_mm"] = results["grouped_mm"].median_s / results["moe_route"].median_s
    ours.extra["mem_vs_grouped_mm"] = ours.extra["peak_gb"] / base.extra["peak_gb"]
    ours.extra["act_mem_vs_grouped_mm"] = (
        ours.extra["peak_minus_weight_grads_gb"] / base.extra["peak_minus_weight_grads_gb"]
    )
    ours.extra["saved_vs_grouped_mm"] = (
        ours.extra["saved_bytes_per_token"] / base.extra["saved_bytes_per_token"]
    )
    if "loop" in results:
        ours.extra["x_loop"] = results["loop"].median_s / results["moe_route"].median_s
    ours.extra["tflops"] = flops / results["moe_route"].median_s / 1e12
    return ours


def stage_breakdown(name, T, H, I, E, K, ceil, rows):  # noqa: E741
    """Time each kernel of the training step alone (TFLOP/s against the dense rate), under the
    launch configurations fused_moe's plan picks for this shape."""
    from moe_route.kernels.triton import router_grad, weight_grad
    from moe_route.kernels.triton.finalize import finalize_triton
    from moe_route.kernels.triton.gemm_act_backward import grouped_gemm_act_backward_triton
    from moe_route.kernels.triton.grouped_gemm import grouped_gemm_triton
    from moe_route.plan import plan_for as _plan_for

    dev, dt = "cuda", torch.bfloat16
    shape = f"{name} T={T}"
    x = torch.randn(T, H, device=dev, dtype=dt)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    tw, ids = moe_route.reference.topk_routing_reference(torch.randn(T, E, device=dev), K)
    maps = moe_route.build_routing_maps(ids, E)
    s2d, d2s, efs, off = maps.tensors()
    cfg = _plan_for(x, w1, w2, K, "swiglu", "concat", "standalone", True, False, "auto").configs
    M = T * K
    dout = torch.randn(T, H, device=dev, dtype=dt)
    dout_perm = torch.randn(M, H, device=dev, dtype=dt)  # what the backward permutes for dW
    x_perm = torch.randn(M, H, device=dev, dtype=dt)
    dout_perm = torch.randn(M, H, device=dev, dtype=dt)  # what the backward permutes for dW
    x_perm = torch.randn(M, H, device=dev, dtype=dt)
    z = torch.randn(M, 2 * I, device=dev, dtype=dt)
    h = torch.empty(M, I, device=dev, dtype=dt)
    dz = torch.empty_like(z)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    dx_perm = torch.empty(M, H, device=dev, dtype=dt)
    dx = torch.empty(T, H, device=dev, dtype=dt)
    dtw = torch.empty_like(tw)
    unit = torch.ones((), device=dev).expand(T, K)

    def act_backward():
        return grouped_gemm_act_backward_triton(
            dout, w2.transpose(1, 2), off, d2s, z, tw, h, dz, cfg.act_bwd.fused,
            epilogue=cfg.epilogue,
        )  # fmt: skip

    partial = act_backward()
    g = 2 * M * H * I
    stages = {
        "fwd_gemm1_store_z": (lambda: grouped_gemm_triton(
            x, w1, off, h, cfg.gemm1, epilogue=cfg.epilogue, dest_to_src=d2s, num_rows=M,
            pre_activation=z), 2 * g),
        "bwd_gemm2_act": (act_backward, g),
        "bwd_router_w": (lambda: router_grad.router_weight_grad_triton(
            partial, dout, None, s2d, efs, dtw), 0),
        "bwd_dw2": (lambda: weight_grad.expert_weight_grad_triton(
            dout_perm, h, off, dw2, cfg.wgrad2, dest_to_src=d2s, num_rows=M), g),
        "bwd_dw1": (lambda: weight_grad.expert_weight_grad_triton(
            dz, x_perm, off, dw1, cfg.wgrad1, dest_to_src=d2s, num_rows=M), 2 * g),
        "bwd_dx_gemm": (lambda: grouped_gemm_triton(dz, w1.transpose(1, 2), off, dx_perm, cfg.dx),
                        2 * g),
        "bwd_dx_sum": (lambda: finalize_triton(dx_perm, unit, s2d, efs, None, dx), 0),
    }  # fmt: skip
    for stage, (fn, flops) in stages.items():
        t = time_cuda(fn)
        nbytes = 2 * M * (2 * I + H) * 2
        rows.append(make_row(stage, shape, "moe_route", t, ceil, nbytes, flops,
                             of_dense=flops / t.median_s / ceil.mm_flops_per_s))  # fmt: skip
        print(f"  {shape} {stage}: {t.median_s * 1e6:.0f} us, "
              f"{flops / t.median_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    dense = time_cuda(lambda: torch.mm(dz[:, : 2 * I].t(), dx_perm[:, :H]))
    print(f"  dense dz^T @ rows [{2 * I}x{M}]x[{M}x{H}]: "
          f"{2 * M * 2 * I * H / dense.median_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape per model")
    ap.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    ap.add_argument("--out", default="bench/results", help="directory for CSV / JSON")
    ap.add_argument("--stages", action="store_true", help="time each kernel of the step")
    args = ap.parse_args(argv)
    ceil = Ceilings.measure("cuda")
    env = environment(ceil, "cuda")
    rows = []
    shapes = [SHAPES[i] for i in QUICK] if args.quick else SHAPES
    if args.stages:
        for s in shapes:
            stage_breakdown(*s, ceil, rows)
            torch.cuda.empty_cache()
        write_results(rows, env, args.out, "train_stages")
        return
    for s in shapes:
        r = bench_shape(*s, ceil, rows, with_loop=not args.no_loop)
        torch.cuda.empty_cache()
        print(f"{r.shape}: {r.median_us:.0f} us, x_grouped_mm {r.extra['x_grouped_mm']:.2f}, "
              f"x_loop {r.extra.get('x_loop', float('nan')):.1f}, "
              f"peak {r.extra['mem_vs_grouped_mm']:.2f} (without weight grads "
              f"{r.extra['act_mem_vs_grouped_mm']:.2f}), saved "
              f"{r.extra['saved_vs_grouped_mm']:.2f}", flush=True)  # fmt: skip
    write_results(rows, env, args.out, "train")
    print_table(rows, env)


if __name__ == "__main__":
    main()

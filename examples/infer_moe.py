"""Inference example: an MoE layer's experts with moe_route.fused_moe vs the per-expert loop.

Times, on the machine it runs on, the expert computation of one MoE layer (router top-k given)
done two ways, prints a table and checks that both agree with the float64 reference:

* ``loop``: the per-expert PyTorch loop most model code uses (transformers' "eager" experts):
  for each expert, gather its tokens, two matmuls, scale, ``index_add_`` back;
* ``fused_moe``: :func:`moe_route.fused_moe`, one call (routing maps, grouped GEMM1 with SwiGLU,
  grouped GEMM2, finalize). On a GPU these are the Triton kernels; on a CPU moe_route runs its
  PyTorch reference (a loop too: expect no speed-up there), or the Triton interpreter under
  ``TRITON_INTERPRET=1`` (slow; for testing).

    python examples/infer_moe.py                      # GPU: qwen3- and mixtral-sized layers
    python examples/infer_moe.py --preset small       # CPU-sized shapes
    python examples/infer_moe.py --tokens 1 64 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import moe_route
from moe_route import reference

# name: (H, I, E, K) of one MoE layer.
PRESETS = {
    "gpu": {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)},
    "small": {"small-qwen-like": (512, 192, 32, 4), "small-mixtral-like": (512, 1024, 8, 2)},
    "tiny": {"tiny": (64, 32, 8, 2)},
}
DEFAULT_TOKENS = {"gpu": (1, 64, 4096), "small": (1, 16, 256), "tiny": (1, 9)}


def loop_moe(x, w1, w2, topk_weights, topk_ids):
    """The per-expert loop (as transformers' eager Mixtral / Qwen3-MoE experts)."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token_idx, slot = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], w1[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(x.dtype))
    return out


def timed(fn, device, warmup, iters):
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def layer(H, inter, E, K, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x = randn(T, H)
    w1 = randn(E, 2 * inter, H, scale=H**-0.5)  # gate rows, then up rows
    w2 = randn(E, H, inter, scale=inter**-0.5)
    logits = torch.randn(T, E, generator=g).to(device)
    topk_weights, topk_ids = reference.topk_routing_reference(logits, K, renormalize=True)
    return x, w1, w2, topk_weights, topk_ids


def row(cells, widths):
    """One table line: the first column left-aligned, numbers right-aligned."""
    first = str(cells[0]).ljust(widths[0])
    rest = (str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
    return "  ".join([first, *rest])


def run_case(H, inter, E, K, T, dtype, device, warmup, iters):
    """Time both implementations on one layer; returns (t_loop, t_fused, err_loop, err_fused)."""
    x, w1, w2, tw, ids = layer(H, inter, E, K, T, dtype, device)
    exact = reference.moe_forward_reference(x.double(), w1.double(), w2.double(), tw.double(), ids)
    scale = exact.abs().max().item() or 1.0

    def run_loop():
        return loop_moe(x, w1, w2, tw, ids)

    def run_fused():
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation="swiglu")

    err_loop = (run_loop().double() - exact).abs().max().item() / scale
    err_fused = (run_fused().double() - exact).abs().max().item() / scale
    t_loop = timed(run_loop, device, warmup, iters)
    t_fused = timed(run_fused, device, warmup, iters)
    return t_loop, t_fused, err_loop, err_fused


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="layer shapes: 'gpu' (default on CUDA), 'small' (default on CPU), 'tiny'",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T values")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default), float16, float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    preset = args.preset or ("gpu" if device.type == "cuda" else "small")
    tokens = args.tokens or DEFAULT_TOKENS[preset]
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backend = moe_route.arch.backend_for(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"moe_route {moe_route.__version__} on {device} ({name}), {dtype}")
    print(f"backend {backend.value} ({backend.why})")
    print(f"median of {args.iters} calls after {args.warmup} warm-up calls; err = ", end="")
    print("max |out - float64 reference| / max |reference|\n")

    cols = ["layer", "H", "I", "E", "K", "T", "loop ms", "fused_moe ms", "speed-up"]
    cols += ["err loop", "err moe_route"]
    widths = [20, 5, 6, 4, 2, 6, 9, 12, 8, 8, 13]
    print(row(cols, widths))
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    ok = True
    with torch.inference_mode():
        for label, (H, inter, E, K) in PRESETS[preset].items():
            for T in tokens:
                t_loop, t_fused, err_loop, err_fused = run_case(
                    H, inter, E, K, T, dtype, device, args.warmup, args.iters
                )
                # moe_route rounds once at the end: allow twice the loop's error, or 2 ulps.
                good = err_fused <= 2 * err_loop + 2 * torch.finfo(dtype).eps
                ok &= good
                cells = [label, H, inter, E, K, T, f"{t_loop * 1e3:.3f}", f"{t_fused * 1e3:.3f}"]
                cells += [f"{t_loop / t_fused:.2f}x", f"{err_loop:.1e}", f"{err_fused:.1e}"]
                print(row(cells, widths) + ("" if good else "  MISMATCH"))
    print("\nOK: fused_moe agrees with the reference" if ok else "\nMISMATCH (see table)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

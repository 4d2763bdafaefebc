"""The softmax top-k router: host and device time of the torch path against the Triton kernel,
and the exactness checks, in one table.

Run on a GPU: ``python scripts/router_host.py [--no-renormalize]``. Host µs per call is
:func:`moe_route.bench.harness.time_host` (median of 3 loops of 300 unsynchronised calls after
warm-up), as ``scripts/host_probe.py``; ``index_select`` (``T`` rows of the logits) is the
yardstick of one thin launch. Where one call's device time exceeds its host time (large T),
the host loop waits for the device and its number is the device time. Device µs is
``triton.testing.do_bench``'s median (L2 flushed).

Columns:

* ``old``: the router before the kernel (softmax, stable sort of the probabilities, slices,
  sum, division, int32 conversion); ``torch``: the torch path now
  (:func:`moe_route.routing.softmax_topk_torch`: stable sort of the logits, gather);
  ``kernel``: ``moe_route.softmax_topk`` (validation, backend choice, one launch);
  ``+bwd``: forward and backward through autograd.
* ``ids``: the kernel's ids equal to the torch path's on the GPU and on a CPU copy (``ok``),
  and to the old path's (``old ok``: may differ only where distinct logits round to one
  probability); ``w ulp``: the largest distance of the kernel's weights from the torch
  path's (GPU) in float32 ulps of the weight, ``w bits``: the share of bitwise equal weights.
"""

from __future__ import annotations

import argparse

import torch
import triton

import moe_route
from moe_route.bench.harness import time_host
from moe_route.routing import _SOFTMAX_TOPK_BACKWARD, softmax_topk_torch

TOKENS = (1, 64, 4096, 32768)
SHAPES = ((128, 8), (256, 8))  # (E, K): Qwen3-30B-A3B, DeepSeek-V3 sizes


def old_torch_path(logits, k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = values[..., :k], ids[..., :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def host_us(fn) -> float:
    return time_host(fn, "cuda", calls=300, warmup=20).median_s * 1e6


def device_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def fwd_bwd(router, logits, g):
    x = logits.detach().requires_grad_(True)

    def run():
        w, _ = router(x)
        torch.autograd.grad(w, x, g)

    return run


def checks(logits, k, renormalize) -> tuple[str, float, float]:
    w, ids = moe_route.softmax_topk(logits, k, renormalize)
    w_t, ids_t = softmax_topk_torch(logits, k, renormalize)
    ids_cpu = softmax_topk_torch(logits.cpu(), k, renormalize)[1]
    ids_old = old_torch_path(logits, k, renormalize)[1]
    same = torch.equal(ids, ids_t) and torch.equal(ids.cpu(), ids_cpu)
    verdict = ("ok" if same else "DIFF") + (" old ok" if torch.equal(ids, ids_old) else " old diff")
    ulp = torch.finfo(torch.float32).eps * w_t.abs().clamp_min(torch.finfo(torch.float32).tiny)
    worst = ((w - w_t).abs() / ulp).max().item() if w.numel() else 0.0
    bits = (w == w_t).float().mean().item() * 100 if w.numel() else 100.0
    return verdict, worst, bits


def row(E: int, K: int, T: int, r: bool) -> str:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T + E)
    logits = torch.randn(T, E, device=dev, generator=g)
    grad = torch.randn(T, K, device=dev, generator=g)
    idx = torch.randint(0, T, (T,), device=dev, generator=g)

    def kernel():
        return moe_route.softmax_topk(logits, K, r)

    def torch_now():
        return softmax_topk_torch(logits, K, r)

    def old():
        return old_torch_path(logits, K, r)

    w, ids = kernel()

    def bwd():
        return _SOFTMAX_TOPK_BACKWARD.impl(grad, w, ids, logits, r)

    h_old, h_torch, h_kernel = host_us(old), host_us(torch_now), host_us(kernel)
    h_idx = host_us(lambda: torch.index_select(logits, 0, idx))
    h_torch_b = host_us(fwd_bwd(lambda x: softmax_topk_torch(x, K, r), logits, grad))
    h_kernel_b = host_us(fwd_bwd(lambda x: moe_route.softmax_topk(x, K, r), logits, grad))
    d_old, d_torch, d_kernel, d_bwd = map(device_us, (old, torch_now, kernel, bwd))
    verdict, worst, bits = checks(logits, K, r)
    return (
        f"{E:>4} {K:>2} {T:>6} |          {h_old:6.1f} {h_torch:6.1f} {h_kernel:6.1f} "
        f"{h_idx:7.1f} {h_kernel / h_idx:5.2f} {h_torch_b:9.1f} {h_kernel_b:8.1f} | "
        f"           {d_old:6.1f} {d_torch:6.1f} {d_kernel:6.1f} {d_bwd:6.1f} | "
        f"{verdict:<14} {worst:5.1f} {bits:5.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-renormalize", dest="renormalize", action="store_false")
    args = parser.parse_args()
    r = args.renormalize
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}, renormalize={r}")  # fmt: skip
    head = (
        f"{'E':>4} {'K':>2} {'T':>6} | host µs: {'old':>6} {'torch':>6} {'kernel':>6} "
        f"{'idx_sel':>7} {'k/idx':>5} {'torch+bwd':>9} {'kern+bwd':>8} | device µs: "
        f"{'old':>6} {'torch':>6} {'kernel':>6} {'k bwd':>6} | {'ids':<14} {'w ulp':>5} "
        f"{'w bits':>6}"
    )
    print(head)
    print("-" * len(head))
    for E, K in SHAPES:
        for T in TOKENS:
            print(row(E, K, T, r))


if __name__ == "__main__":
    main()

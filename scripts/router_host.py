"""The routers (softmax top-k; DeepSeek-V3's grouped sigmoid): host and device time of the torch
path against the Triton kernel, and the exactness checks, one table per router.

Run on a GPU: ``python scripts/router_host.py [--no-renormalize] [--router softmax|grouped]``
(both routers by default). Host µs per call is
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

The grouped sigmoid table (``moe_route.sigmoid_grouped_topk`` with a random expert bias and
``routed_scaling_factor=2.5``, as MoELayer calls it) has no ``old`` column: its ``torch`` is
:func:`moe_route.routing.sigmoid_grouped_topk_torch`, the router before the kernel. ``ids``:
the kernel's ids equal to the torch path's on the GPU (``ok``), and to the CPU torch path's
(``cpu ok``; torch's CPU sigmoid may differ from its CUDA one by an ulp, so a near-tie may
order differently there: ``cpu diff`` alone is not a kernel error).
"""

from __future__ import annotations

import argparse

import torch
import triton

import moe_route
from moe_route.bench.harness import time_host
from moe_route.routing import (
    _SIGMOID_GROUPED_BACKWARD,
    _SOFTMAX_TOPK_BACKWARD,
    sigmoid_grouped_topk_torch,
    softmax_topk_torch,
)

TOKENS = (1, 64, 4096, 32768)
SHAPES = ((128, 8), (256, 8))  # (E, K): Qwen3-30B-A3B, DeepSeek-V3 sizes
#: (E, K, n_group, topk_group): DeepSeek-V3, and without a group limit
GROUPED_SHAPES = ((256, 8, 8, 4), (64, 6, 1, 1))
SCALE = 2.5  # routed_scaling_factor (DeepSeek-V3)


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
    return (verdict, *ulp_distance(w, w_t))


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


def ulp_distance(w: torch.Tensor, w_ref: torch.Tensor) -> tuple[float, float]:
    """``(worst distance in float32 ulps of the reference, % bitwise equal)``."""
    if not w.numel():
        return 0.0, 100.0
    ulp = torch.finfo(torch.float32).eps * w_ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return ((w - w_ref).abs() / ulp).max().item(), (w == w_ref).float().mean().item() * 100


def grouped_checks(logits, k, groups, bias, r) -> tuple[str, float, float]:
    w, ids = moe_route.sigmoid_grouped_topk(logits, k, n_group=groups[0], topk_group=groups[1],
                                            expert_bias=bias, routed_scaling_factor=SCALE,
                                            renormalize=r)  # fmt: skip
    w_t, ids_t = sigmoid_grouped_topk_torch(logits, k, *groups, bias, SCALE, r)
    ids_cpu = sigmoid_grouped_topk_torch(logits.cpu(), k, *groups, bias.cpu(), SCALE, r)[1]
    verdict = ("ok" if torch.equal(ids, ids_t) else "DIFF") + (
        " cpu ok" if torch.equal(ids.cpu(), ids_cpu) else " cpu diff"
    )
    return (verdict, *ulp_distance(w, w_t))


def grouped_row(E: int, K: int, n_group: int, topk_group: int, T: int, r: bool) -> str:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T + E)
    logits = torch.randn(T, E, device=dev, generator=g)
    grad = torch.randn(T, K, device=dev, generator=g)
    bias = torch.randn(E, device=dev, generator=g) * 0.1
    idx = torch.randint(0, T, (T,), device=dev, generator=g)
    kw = dict(n_group=n_group, topk_group=topk_group, expert_bias=bias,
              routed_scaling_factor=SCALE, renormalize=r)  # fmt: skip

    def kernel():
        return moe_route.sigmoid_grouped_topk(logits, K, **kw)

    def torch_path(x):
        return sigmoid_grouped_topk_torch(x, K, n_group, topk_group, bias, SCALE, r)

    def torch_now():
        return torch_path(logits)

    _, ids = kernel()

    def bwd():
        return _SIGMOID_GROUPED_BACKWARD.impl(grad, ids, logits, r, SCALE)

    h_torch, h_kernel = host_us(torch_now), host_us(kernel)
    h_idx = host_us(lambda: torch.index_select(logits, 0, idx))
    h_torch_b = host_us(fwd_bwd(torch_path, logits, grad))
    h_kernel_b = host_us(fwd_bwd(lambda x: moe_route.sigmoid_grouped_topk(x, K, **kw), logits,
                                 grad))  # fmt: skip
    d_torch, d_kernel, d_bwd = map(device_us, (torch_now, kernel, bwd))
    verdict, worst, bits = grouped_checks(logits, K, (n_group, topk_group), bias, r)
    return (
        f"{E:>4} {K:>2} {n_group:>2} {topk_group:>2} {T:>6} | {h_torch:6.1f} {h_kernel:6.1f} "
        f"{h_idx:7.1f} {h_kernel / h_idx:5.2f} {h_torch_b:9.1f} {h_kernel_b:8.1f} | "
        f"{d_torch:6.1f} {d_kernel:6.1f} {d_bwd:6.1f} | {verdict:<14} {worst:5.1f} {bits:5.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-renormalize", dest="renormalize", action="store_false")
    parser.add_argument("--router", choices=("softmax", "grouped", "both"), default="both")
    args = parser.parse_args()
    r = args.renormalize
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}, renormalize={r}")  # fmt: skip
    if args.router in ("softmax", "both"):
        head = (
            f"{'E':>4} {'K':>2} {'T':>6} | host µs: {'old':>6} {'torch':>6} {'kernel':>6} "
            f"{'idx_sel':>7} {'k/idx':>5} {'torch+bwd':>9} {'kern+bwd':>8} | device µs: "
            f"{'old':>6} {'torch':>6} {'kernel':>6} {'k bwd':>6} | {'ids':<14} {'w ulp':>5} "
            f"{'w bits':>6}"
        )
        print("\nsoftmax_topk")
        print(head)
        print("-" * len(head))
        for E, K in SHAPES:
            for T in TOKENS:
                print(row(E, K, T, r))
    if args.router in ("grouped", "both"):
        head = (
            f"{'E':>4} {'K':>2} {'ng':>2} {'tg':>2} {'T':>6} | {'torch':>6} {'kernel':>6} "
            f"{'idx_sel':>7} {'k/idx':>5} {'torch+bwd':>9} {'kern+bwd':>8} | {'torch':>6} "
            f"{'kernel':>6} {'k bwd':>6} | {'ids':<14} {'w ulp':>5} {'w bits':>6}"
        )
        print(f"\nsigmoid_grouped_topk (routed_scaling_factor={SCALE}, random expert bias): "
              "host µs | device µs | checks")  # fmt: skip
        print(head)
        print("-" * len(head))
        for E, K, n_group, topk_group in GROUPED_SHAPES:
            for T in TOKENS:
                print(grouped_row(E, K, n_group, topk_group, T, r))


if __name__ == "__main__":
    main()

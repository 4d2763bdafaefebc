"""cProfile of eager calls at decode sizes (where the host time goes), qwen3-30b-a3b's MoE
sizes: fused_moe at T=1 (decode path), T=8 (decode path) and T=16 (sorted path), its forward
alone with grad-requiring inputs at T=1, fused_moe forward + backward at T=1 (``.backward()`` into
``.grad``, or ``autograd.grad`` as the bench's host stage; also at T=8 and 4096, the sorted path
with TMA), an inference MoELayer at T=1 and 8,
and (on request) the single-launch ops at T=64: maps, expand, finalize, the two grouped GEMMs,
and one torch.empty for scale. Prints each call's host µs (no profiler; median of 3 loops of
200 calls without synchronising, and in bursts of 8 calls, which never fill the launch queue),
the kernels and CUDA API calls of one call, and the top functions by own time.

    python scripts/host_profile.py [fwd1 fwd8 fwd16 fwdgrad1 train1 grad1 grad8 grad4096
                                    layer1 layer8 maps64 expand64 finalize64 empty64 gemm1_64
                                    gemm2_64]
                                   [--top N] [--trace]
"""

import argparse
import cProfile
import io
import pstats

import torch

import moe_route
from moe_route import reference as R
from moe_route.bench.harness import time_host

H, inter, E, K = 2048, 768, 128, 8
w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02


def inputs(T, grad=False):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
    return x, tw.requires_grad_(grad), ids


def fwd(T):
    x, tw, ids = inputs(T)
    return lambda: moe_route.fused_moe(x, w1, w2, tw, ids)


def train(T):
    x, tw, ids = inputs(T, grad=True)
    w1g, w2g = w1.clone().requires_grad_(), w2.clone().requires_grad_()

    def step():
        out = moe_route.fused_moe(x, w1g, w2g, tw, ids)
        out.sum().backward()

    return step


def grad(T):
    """Forward + backward as the bench's host stage times it: ``torch.autograd.grad`` of the
    four inputs (no ``.grad`` accumulation)."""
    x, tw, ids = inputs(T, grad=True)
    w1g, w2g = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    leaves = [x, w1g, w2g, tw]
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        out = moe_route.fused_moe(x, w1g, w2g, tw, ids)
        return torch.autograd.grad(out, leaves, dout)

    return step


def fwd_grad(T):
    """The forward alone, with grad-requiring inputs (the training forward: the sorted path,
    z saved, the autograd Function built), its output dropped."""
    x, tw, ids = inputs(T, grad=True)
    w1g, w2g = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    return lambda: moe_route.fused_moe(x, w1g, w2g, tw, ids)


def layer(T):
    m = moe_route.MoELayer(H, inter, E, K, device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def call():
        with torch.no_grad():
            return m(x)

    return call


def small_op(name, T=64):
    """One of the single-launch public ops at ``T`` tokens."""
    x, tw, ids = inputs(T)
    maps = moe_route.build_routing_maps(ids, E)
    y = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(T * K, inter, device="cuda", dtype=torch.bfloat16)
    return {
        "gemm1": lambda: moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True),
        "gemm2": lambda: moe_route.grouped_gemm(h, w2, maps),
        "maps": lambda: moe_route.build_routing_maps(ids, E),
        "expand": lambda: moe_route.expand_rows(x, maps),
        "finalize": lambda: moe_route.finalize_moe_routing(y, tw, maps),
        "empty": lambda: torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
    }[name]


CASES = {"fwd1": lambda: fwd(1), "fwd8": lambda: fwd(8), "fwd16": lambda: fwd(16),
         "fwdgrad1": lambda: fwd_grad(1), "train1": lambda: train(1), "grad1": lambda: grad(1),
         "grad8": lambda: grad(8), "grad4096": lambda: grad(4096),
         "layer1": lambda: layer(1), "layer8": lambda: layer(8), "maps64": lambda: small_op("maps"),
         "expand64": lambda: small_op("expand"), "finalize64": lambda: small_op("finalize"),
         "empty64": lambda: small_op("empty"), "gemm1_64": lambda: small_op("gemm1"),
         "gemm2_64": lambda: small_op("gemm2")}  # fmt: skip
DEFAULT = ("fwd1", "fwd8", "train1", "layer1")


def per_call(fn, n=200):
    """Host µs per call (the bench suite's host loop: median of 3 loops of ``n`` calls)."""
    return time_host(fn, "cuda", calls=n, warmup=30).median_s * 1e6


def burst(fn, n=8, loops=50):
    """Host µs per call over short bursts (``n`` calls, synchronised between bursts outside the
    timing): the host's own cost even where the device is the slower side, since a burst never
    fills the launch queue."""
    return time_host(fn, "cuda", calls=n, repeats=loops, warmup=0).median_s * 1e6


def launches(fn):
    """Kernels launched and CUDA API calls made by one call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    api = [e.name for e in prof.events() if e.name.startswith(("cuda", "cu"))]
    return kernels, api


def timeline(fn, min_us=2.0):
    """The CPU events of one call (after two profiled warm-up calls): start offset, duration,
    depth-indented name, for every event of at least ``min_us``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            with torch.profiler.record_function("## call"):
                fn()
    calls = [e for e in prof.events() if e.name == "## call"]
    last = calls[-1]
    lo, hi = last.time_range.start, last.time_range.end
    inside = [
        e
        for e in prof.events()
        if lo <= e.time_range.start and e.time_range.end <= hi and e is not last
    ]
    inside.sort(key=lambda e: e.time_range.start)
    print(f"  one call: {(hi - lo):.0f} us (profiled)")
    stack: list = []
    for e in inside:
        while stack and e.time_range.start >= stack[-1]:
            stack.pop()
        dur = e.time_range.end - e.time_range.start
        if dur >= min_us:
            print(f"  {e.time_range.start - lo:7.1f} {dur:7.1f}  {'  ' * len(stack)}{e.name[:70]}")
        stack.append(e.time_range.end)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cases", nargs="*", default=list(DEFAULT), choices=list(CASES))
    p.add_argument("--top", type=int, default=22)
    p.add_argument(
        "--trace",
        action="store_true",
        help="also print the CPU timeline of one call (torch.profiler, >= 2 us)",
    )
    args = p.parse_args()
    idx = torch.arange(8, device="cuda")
    xs = torch.randn(8, H, device="cuda")
    print(f"index_select: {per_call(lambda: xs.index_select(0, idx)):.1f} us")
    for name in args.cases:
        fn = CASES[name]()
        for _ in range(20):
            fn()
        print(f"{name}: {per_call(fn):.1f} us host per call, {burst(fn):.1f} us in bursts of 8")
        kernels, api = launches(fn)
        print(f"  {len(kernels)} kernels: " + ", ".join(k[:40] for k in kernels))
        counts = {a: api.count(a) for a in sorted(set(api))}
        print(f"  CUDA API calls: {counts}")
        if args.trace:
            timeline(fn)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("\n".join(s.getvalue().splitlines()[6:]))


if __name__ == "__main__":
    main()

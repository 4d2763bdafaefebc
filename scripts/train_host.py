"""Where the host time of an eager ``fused_moe`` forward + backward goes at decode size (H100
host): host µs of the forward with grad-requiring inputs, of forward + ``autograd.grad``, of the
backward's launch sequence called directly, and the profiler's CPU-side table (self time per
op, CUDA runtime calls included) of one step. olmoe-1b-7b sizes, T=1 (``--tokens``).

    python scripts/train_host.py [--tokens T]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import moe_route
from moe_route import reference as R
from moe_route.bench.harness import time_host
from moe_route.kernels.triton.moe import moe_backward_triton
from moe_route.moe import _plan_for

H, INTER, E, K = 2048, 1024, 64, 8


def host_us(fn) -> float:
    return time_host(fn, "cuda", calls=200, warmup=20).median_s * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1)
    T = p.parse_args().tokens
    dev, dt = "cuda", torch.bfloat16
    w1 = (torch.randn(E, 2 * INTER, H, device=dev, dtype=dt) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, INTER, device=dev, dtype=dt) * 0.02).requires_grad_()
    x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
    tw, ids = R.topk_routing_reference(torch.randn(T, E, device=dev), K, renormalize=True)
    tw.requires_grad_()
    dout = torch.randn(T, H, device=dev, dtype=dt)
    leaves = [x, w1, w2, tw]
    maps = moe_route.build_routing_maps(ids, E)
    plan = _plan_for(x, w1, w2, K, "swiglu", "concat", "standalone", True, False, "auto")
    z = torch.randn(T * K, 2 * INTER, device=dev, dtype=dt)
    xd, w1d, w2d, twd = (t.detach() for t in leaves)

    def fwd():
        return moe_route.fused_moe(x, w1, w2, tw, ids)

    def step():
        return torch.autograd.grad(fwd(), leaves, dout)

    def bwd_direct():
        return moe_backward_triton(dout, xd, w1d, w2d, twd, None, None, z, maps.tensors(),
                                   plan.configs, True, True, True, True)  # fmt: skip

    def empties():
        return torch.empty_like(w1d), torch.empty_like(w2d)

    def doubling(extra_backward_work):
        """A one-launch-each-way autograd.Function (the engine's own cost around a backward)
        whose backward also runs ``extra_backward_work``."""

        class Doubling(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                return a * 2

            @staticmethod
            def backward(ctx, g):
                extra_backward_work()
                return g * 2

        return Doubling

    inside = []  # host seconds of each bwd_direct run on autograd's device thread

    def timed_bwd_direct():
        t0 = time.perf_counter()
        bwd_direct()
        inside.append(time.perf_counter() - t0)

    Trivial, Heavy = doubling(lambda: None), doubling(timed_bwd_direct)

    small = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
    idx = torch.arange(T * K, device=dev) % T
    rows = {
        "index_select": lambda: xd.index_select(0, idx),
        "forward (grad inputs)": fwd,
        "forward + autograd.grad": step,
        "backward launches direct": bwd_direct,
        "empty_like(w1), (w2)": empties,
        "trivial Function forward": lambda: Trivial.apply(small),
        "trivial Function + grad": lambda: torch.autograd.grad(Trivial.apply(small), small, dout),
        "MoE backward in a Function": lambda: torch.autograd.grad(Heavy.apply(small), small, dout),
    }
    for fn in rows.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    for name, fn in rows.items():
        inside.clear()
        print(f"{name:28} {host_us(fn):8.1f} us")
    # the same launch sequence timed inside the Function's backward (the device thread): is
    # the thread slower, or is the difference the engine's?
    print(f"{'  of which inside backward':28} {statistics.median(inside) * 1e6:8.1f} us")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()

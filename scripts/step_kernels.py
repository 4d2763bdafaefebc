"""Per-kernel device time of one ``fused_moe`` call at the training shapes (GPU): the forward
without grad (inference), the forward that saves for the backward, and forward + backward, each
kernel's µs (median over a few profiled calls) in launch order with its share of the call; then
the step's time by ``do_bench`` against the kernels' sum, and the device's idle gaps between
the step's kernels (where the GPU waited for the host).

    PYTHONPATH=. python scripts/step_kernels.py [--shapes qwen3 mixtral deepseek]
                                                [--gather auto|yes|no]   # fused_moe's gather
                                                [--tokens T]   # another T than the shape's
                                                [--forward]    # the inference forward only
                                                [--quant fp8|mxfp4|...]   # quantised experts
                                                                          # (inference only)
"""

import argparse
import itertools
import statistics

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import moe_route
from moe_route.bench.harness import Ceilings, time_cuda
from moe_route.bench.profiling import profile_kernels
from moe_route.bench.shapes import TRAINING_SHAPES as SHAPES
from moe_route.reference import topk_routing_reference


def kernels_of(fn, runs=5):
    """``[(name, median µs)]`` in launch order over ``runs`` profiled calls."""
    for _ in range(2):
        fn()
    lists = [profile_kernels(fn, "cuda")[1] for _ in range(runs)]
    n = min(len(k) for k in lists)
    return [(lists[0][i][0], statistics.median(k[i][1] for k in lists)) for i in range(n)]


def gaps(fn):
    """``[(µs idle, kernel after)]`` between consecutive device activities of one call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start)  # fmt: skip
    return [(b.time_range.start - a.time_range.end, b.name) for a, b in itertools.pairwise(ev)]


def why_gap(step, n=20):
    """Whether the step waits for the device: host µs per step issued back to back, the same
    loop's device µs per step (events around it), the allocator's cudaMalloc / cudaFree calls
    during it, and the synchronising calls torch reports."""
    import time

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        step()
    end.record()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    allocs = {k: after.get(k, 0) - before.get(k, 0)
              for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}  # fmt: skip
    print(f"  {n} steps back to back: host {host:.0f} us/step, device "
          f"{start.elapsed_time(end) * 1e3 / n:.0f} us/step, allocator {allocs}")  # fmt: skip
    replay = time_cuda(step, use_graph=True, inner=1, outer=n, warmup=0)
    print(f"  the step as a CUDA graph, {n} replays: median {replay.median_s * 1e6:.0f} us")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        print(f"  synchronising calls in one step: {len(caught)}"
              + "".join(f"\n    {w.message}"[:200] for w in caught[:3]))  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)


def show(title, kernels):
    total = sum(us for _, us in kernels)
    print(f"  {title}: {total:.0f} us over {len(kernels)} kernels")
    for name, us in kernels:
        print(f"    {us:9.1f} us {us / total:5.1%}  {name[:90]}")


def training_case(name, tokens=None):
    """``((T, H, I, E, K), x, w1, w2, topk_weights, topk_ids)``: the training shape ``name``
    (``tokens`` tokens instead of its own), bf16 on CUDA, routing from random logits."""
    dev, dt = "cuda", torch.bfloat16
    s = SHAPES[name]
    T, H, inter, E, K = tokens or s.T, s.H, s.I, s.E, s.K
    x = torch.randn(T, H, device=dev, dtype=dt)
    w1 = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * H**-0.5
    w2 = torch.randn(E, H, inter, device=dev, dtype=dt) * inter**-0.5
    tw, ids = topk_routing_reference(torch.randn(T, E, device=dev), K, renormalize=True)
    return (T, H, inter, E, K), x, w1, w2, tw.to(dt), ids


def run_shape(name, dense, gather, tokens=None, forward_only=False, quant=None):
    dev, dt = "cuda", torch.bfloat16
    (T, H, inter, E, K), x, w1, w2, tw, ids = training_case(name, tokens)
    flops = 2 * T * K * 3 * H * inter
    print(f"{name} T={T} H={H} I={inter} E={E} K={K}{f' {quant}' if quant else ''}: forward "
          f"{flops / 1e9:.0f} GFLOP ({flops / dense * 1e6:.0f} us at the dense rate)")  # fmt: skip
    weights = {}
    if quant:
        (w1, s1), (w2, s2) = (moe_route.quantize_experts(w, quant) for w in (w1, w2))
        weights = {"quant": quant, "w1_scale": s1, "w2_scale": s2}

    def inference():
        with torch.no_grad():
            return moe_route.fused_moe(x, w1, w2, tw, ids, gather=gather, **weights)

    kernels = kernels_of(inference)
    show("forward, inference", kernels)
    if forward_only:
        total = sum(us for _, us in kernels)
        t = triton.testing.do_bench(inference, warmup=5, rep=200, return_mode="median") * 1e3
        graph = time_cuda(inference, use_graph=True, inner=10, outer=20).median_s * 1e6
        print(f"  forward by do_bench {t:.0f} us ({flops / t * 1e-6:.0f} TFLOP/s), in a CUDA "
              f"graph {graph:.0f} us, kernels' sum {total:.0f} us "
              f"({flops / total * 1e-6:.0f} TFLOP/s)")  # fmt: skip
        return
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]
    dout = torch.randn(T, H, device=dev, dtype=dt)

    def fwd():
        return moe_route.fused_moe(*leaves, ids, gather=gather)

    def step():
        return torch.autograd.grad(fwd(), leaves, dout)

    show("forward, saving for the backward", kernels_of(fwd))
    kernels = kernels_of(step)
    show("forward + backward", kernels)
    total = sum(us for _, us in kernels)
    t = triton.testing.do_bench(step, warmup=5, rep=200, return_mode="median") * 1e3
    print(f"  step by do_bench {t:.0f} us, kernels' sum {total:.0f} us")
    why_gap(step)
    idle = gaps(step)
    print(f"  idle between kernels {sum(g for g, _ in idle):.0f} us; the largest:")
    for g, name in sorted(idle, reverse=True)[:6]:
        print(f"  {g:9.1f} us idle before {name[:80]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--gather", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--tokens", type=int, help="T instead of the shape's prefill size")
    ap.add_argument("--forward", action="store_true", help="the inference forward only")
    ap.add_argument("--quant", help="quantised experts (fp8, mxfp4, ...): the inference forward")
    args = ap.parse_args()
    gather = {"auto": None, "yes": True, "no": False}[args.gather]
    dense = Ceilings.measure("cuda").mm_flops_per_s
    print(f"{torch.cuda.get_device_name()}: dense bf16 mm {dense / 1e12:.0f} TFLOP/s")
    for name in args.shapes:
        run_shape(name, dense, gather, args.tokens, args.forward or bool(args.quant), args.quant)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

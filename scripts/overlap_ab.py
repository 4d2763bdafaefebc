"""The training step with the backward's memory passes on a side stream (``MoEConfigs.overlap``:
dW1's expand beside dX, dx's sum beside dW1) against the same step without, at the training
shapes (GPU): do_bench medians in alternating rounds, the gradients compared bit for bit, the
peak memory of one step, and the overlapped step captured and replayed as a CUDA graph.

    PYTHONPATH=. python scripts/overlap_ab.py [--shapes qwen3 deepseek mixtral] [--rounds 6]
"""

import argparse
import dataclasses
import statistics

import torch
import triton
from step_kernels import training_case

from moe_route import moe as moe_mod
from moe_route.bench.harness import time_cuda

_backward = moe_mod.moe_backward_triton
MODE = {"overlap": 0}
PRIORITY = {"stream": None}
TIMELINE = {"on": True}
POWER = {"on": False}
LEVELS = (0, 3, 7)  # bits: 1 x's expand beside dX, 2 dx's sum beside dW1, 4 dout's beside step 1


def _patched(*args, **kwargs):
    args = list(args)
    cfg_at = 9  # (dout, x, w1, w2, topk_weights, b1, b2, z, maps, cfg, ...)
    args[cfg_at] = dataclasses.replace(args[cfg_at], overlap=MODE["overlap"])
    return _backward(*args, **kwargs)


moe_mod.moe_backward_triton = _patched


def run_shape(name, rounds):
    import moe_route

    (T, H, _, _, _), x, w1, w2, tw, ids = training_case(name)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]
    del x, w1, w2
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def plain():
        return torch.autograd.grad(moe_route.fused_moe(*leaves, ids), leaves, dout)

    if PRIORITY["stream"] is None:
        step = plain
    else:
        hp = PRIORITY["stream"]

        def step():
            hp.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(hp):
                out = plain()
            torch.cuda.current_stream().wait_stream(hp)
            return out

    def sample(grads):  # the weight gradients of the first experts only (memory)
        return [grads[0], grads[1][:8].clone(), grads[2][:8].clone(), grads[3]]

    grads, times, peaks = {}, {m: [] for m in LEVELS}, {}
    for mode in LEVELS:
        MODE["overlap"] = mode
        grads[mode] = sample(step())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peaks[mode] = (torch.cuda.max_memory_allocated() - base) / 2**20
    same = {m: all(torch.equal(a, b) for a, b in zip(grads[0], grads[m], strict=True))
            for m in LEVELS}  # fmt: skip
    del grads
    loops = {m: [] for m in LEVELS}
    for _ in range(rounds):
        for mode in LEVELS:
            MODE["overlap"] = mode
            times[mode].append(triton.testing.do_bench(step, warmup=5, rep=100) * 1e3)
            loops[mode].append(back_to_back(step))
    for mode in LEVELS:
        med = statistics.median(loops[mode])
        print(
            f"  overlap {mode}: 20 steps back to back, eager: {med:.0f} us per step "
            f"({statistics.median(loops[0]) / med:.3f}x; "
            f"rounds {[round(t) for t in loops[mode]]})"
        )
    if POWER["on"]:
        for mode in LEVELS:
            MODE["overlap"] = mode
            print(f"  overlap {mode}, 200 eager steps: {power_of(step)}")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            print(f"  overlap {mode}, 200 graph replays: {power_of(graph.replay)}")
            del graph
    print(f"{name} T={T}:", flush=True)
    for mode in LEVELS:
        MODE["overlap"] = mode
        graph = time_cuda(step, use_graph=True, inner=1, outer=10, warmup=2).median_s * 1e6
        med = statistics.median(times[mode])
        print(f"  overlap {mode}: step {med:.0f} us ({statistics.median(times[0]) / med:.3f}x; "
              f"rounds {[round(t) for t in times[mode]]}); graph {graph:.0f} us; "
              f"bitwise equal {same[mode]}; peak {peaks[mode]:.0f} MiB", flush=True)  # fmt: skip
    for mode in LEVELS if TIMELINE["on"] else ():
        MODE["overlap"] = mode
        print(f"  timeline, overlap {mode}:")
        timeline(step)


def power_of(step, n=200):
    """Device µs per step over ``n`` steps back to back, with the board power and SM clock
    nvidia-smi sampled meanwhile (medians)."""
    import subprocess

    step()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    us = back_to_back(step, n)
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    watts = statistics.median(float(a) for a, _ in samples) if samples else float("nan")
    mhz = statistics.median(float(b) for _, b in samples) if samples else float("nan")
    return f"{us:.0f} us per step, {watts:.0f} W, {mhz:.0f} MHz ({len(samples)} samples)"


def back_to_back(step, n=20):
    """Device µs per step of ``n`` eager steps issued without synchronising (events around)."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def timeline(step):
    """Each kernel of one step: start and end (us from the step's first kernel) and stream."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start)  # fmt: skip
    t0 = ev[0].time_range.start
    for e in ev:
        print(f"    {e.time_range.start - t0:8.0f} {e.time_range.end - t0:8.0f} "
              f"{e.time_range.end - e.time_range.start:7.0f}  {e.name[:70]}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek", "mixtral"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--priority", action="store_true", help="the step on a high-priority stream")
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--power", action="store_true", help="power and clock over 200 steps")
    args = ap.parse_args()
    if args.priority:
        PRIORITY["stream"] = torch.cuda.Stream(priority=-5)  # mapped to the highest allowed
        print("high-priority stream:", PRIORITY["stream"].priority)
    TIMELINE["on"] = not args.no_timeline
    POWER["on"] = args.power
    for name in args.shapes:
        run_shape(name, args.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

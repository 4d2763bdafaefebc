"""Why a training step launched eagerly back to back runs slower than the same step replayed
from a CUDA graph (GPU). For each shape, in alternating rounds in one process:

* ``eager``: ``n`` steps back to back (``torch.autograd.grad`` of ``fused_moe``), CUDA events
  around the loop, per step — how the bench's train stage times it;
* ``graph``: the step captured once, ``n`` replays back to back, per step;
* ``do_bench``: Triton's ``do_bench`` median (L2 flushed between steps, short gaps).

Then one profiled run of ``n`` eager steps: per kernel (by launch position within a step), the
median duration and the median idle time before it over the middle steps (the first steps
may wait for the host), against the same for ``n`` graph replays. The sum of the idle column
says how much of a step the device spends waiting; the duration columns say whether the kernels
themselves run slower.

    PYTHONPATH=. python scripts/eager_steady.py [--shapes qwen3] [--steps 20] [--rounds 3]
"""

import argparse
import statistics
import time

import torch
import triton
from step_kernels import training_case  # scripts/ is on sys.path when this runs
from torch.profiler import ProfilerActivity, profile

import moe_route
from moe_route.bench.harness import capture_graph


def step_of(name):
    _, x, w1, w2, tw, ids = training_case(name)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, tw)]
    dout = torch.randn_like(x)

    def step():
        return torch.autograd.grad(moe_route.fused_moe(*leaves, ids), leaves, dout)

    return step


def eager_us(step, n):
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def graph_us(g, n):
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def kernel_table(fn, n):
    """``[(name, median µs, median idle µs before)]`` by position within a step, over the
    middle steps of ``n`` back-to-back calls of ``fn``."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name),
        key=lambda e: e.time_range.start,
    )
    per = len(ev) // n
    if per * n != len(ev):
        print(f"  ({len(ev)} device events for {n} steps: not a whole number per step)")
        return []
    rows = []
    for i in range(per):
        durs, idles = [], []
        for s in range(n // 4, n - n // 4):
            j = s * per + i
            durs.append(ev[j].time_range.end - ev[j].time_range.start)
            idles.append(ev[j].time_range.start - ev[j - 1].time_range.end)
        rows.append((ev[i].name, statistics.median(durs), statistics.median(idles)))
    return rows


def run(name, n, rounds):
    step = step_of(name)
    g = capture_graph(step)
    print(f"\n{name}: {n} steps per sample")
    for r in range(rounds):
        t0 = time.strftime("%H:%M:%S")
        e = eager_us(step, n)
        gr = graph_us(g, n)
        db = triton.testing.do_bench(step, warmup=3, rep=150, return_mode="median") * 1e3
        print(f"  round {r} ({t0}): eager {e:.0f} us/step, graph {gr:.0f}, do_bench {db:.0f}"
              f"  (eager / graph {e / gr:.3f})")  # fmt: skip
    eager = kernel_table(step, n)
    graph = kernel_table(g.replay, n)
    if len(eager) != len(graph):
        print(f"  eager {len(eager)} kernels per step, graph {len(graph)}")
        return
    print(f"  {'kernel':<34}{'eager us':>10}{'idle':>8}{'graph us':>10}{'idle':>8}")
    for (k, d, i), (_, gd, gi) in zip(eager, graph, strict=True):
        print(f"  {k[:33]:<34}{d:10.1f}{i:8.1f}{gd:10.1f}{gi:8.1f}")
    print(f"  {'sum':<34}{sum(r[1] for r in eager):10.0f}{sum(r[2] for r in eager):8.0f}"
          f"{sum(r[1] for r in graph):10.0f}{sum(r[2] for r in graph):8.0f}")  # fmt: skip
    del g


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["qwen3"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    for name in a.shapes:
        run(name, a.steps, a.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

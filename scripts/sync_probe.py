"""Host time of one eager call right after the device drained, against the same call in a
loop of unsynchronised calls (GPU): is the first call after a synchronise slow for any op
(the host or the driver after the wait), or for moe_route's only? qwen3-30b-a3b sizes, T=1.

    PYTHONPATH=. python scripts/sync_probe.py [--tokens 1] [--reps 50]

NOTE: H100 host, 2026-11-27, T=1 / 8: right after a synchronise every call costs what it costs
in a loop (fused_moe 51 / 63 us against 47); after the host slept 2 ms every call pays 3-5x,
torch's own as much as ours: torch.empty 28 / 18 us (3), index_select 36 / 54 (9-12),
build_routing_maps 141 / 159 (34), fused_moe 135 / 166 (47). A cold host after an idle gap,
not the library; it is what the host stage's single calls of its new-T row saw.
"""

import argparse
import statistics
import time

import torch

import moe_route
from moe_route import reference as R


def after_sync(fn, reps):
    """Median host µs of ``fn`` called right after a synchronise (until it returns)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def after_sleep(fn, reps, seconds=0.002):
    """The same after the device drained and the host slept ``seconds`` (a decode step's gap)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(seconds)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def in_loop(fn, calls=200):
    """Host µs per call in a loop of unsynchronised calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    T, H, inter, E, K = args.tokens, 2048, 768, 128, 8
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    tw, ids = R.topk_routing_reference(torch.randn(T, E, device="cuda"), K, renormalize=True)
    rows = torch.zeros(T * K, dtype=torch.long, device="cuda")
    y = torch.empty(1, device="cuda")
    calls = {
        "python no-op": lambda: None,
        "torch.empty": lambda: torch.empty(T, H, device="cuda"),
        "y.add_(1)": lambda: y.add_(1),
        "index_select": lambda: torch.index_select(x, 0, rows),
        "build_routing_maps": lambda: moe_route.build_routing_maps(ids, E),
        "fused_moe": lambda: moe_route.fused_moe(x, w1, w2, tw, ids),
    }
    for fn in calls.values():  # warm-up: compiles, memos
        for _ in range(5):
            fn()
    print(f"{'call':<20}{'in loop us':>12}{'after sync':>12}{'after 2 ms':>12}")
    for name, fn in calls.items():
        loop = in_loop(fn)
        print(f"{name:<20}{loop:>12.1f}{after_sync(fn, args.reps):>12.1f}"
              f"{after_sleep(fn, args.reps):>12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

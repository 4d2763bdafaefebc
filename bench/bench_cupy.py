"""The CuPy/NVRTC kernels side by side with the Triton ones: routing maps, expand, finalize.

For each shape both implementations are timed ``--repeats`` times, alternating, each time as
the median of 30 CUDA-graph replays of 10 calls (``harness.time_cuda``). Reported per kernel:
GB/s and its fraction of the device-to-device copy bandwidth measured in the same run, the
CuPy/Triton speed ratio of the medians, and the run-to-run spread (max - min of the repeats'
medians over their median). A winner is declared only where the ratio differs from 1 by more
than the spread of both.

Usage: ``python bench/bench_cupy.py [--repeats 3] [--sweep] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Ceilings, environment, make_row, time_cuda, write_results

import moe_route
from moe_route.kernels.cupy.expand import expand_rows_cupy
from moe_route.kernels.cupy.finalize import finalize_cupy
from moe_route.kernels.cupy.routing_maps import routing_maps_cupy
from moe_route.kernels.triton.expand import expand_rows_triton
from moe_route.kernels.triton.finalize import finalize_triton
from moe_route.kernels.triton.routing_maps import routing_maps_triton

K, E = 8, 256  # deepseek-v3 routing
ROW_SHAPES = [(4096, 4096), (4096, 7168), (16384, 4096), (16384, 7168)]  # (T, H)
MAPS_TOKENS = [64, 256, 4096, 16384, 32768]


def random_ids(T, device="cuda"):
    return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)


def compare(stage, shape, nbytes, impls, ceil, repeats, rows, summary):
    """Time each ``impls[name]()`` ``repeats`` times, alternating; add rows and a summary."""
    medians = {name: [] for name in impls}
    timings = {}
    for _ in range(repeats):
        for name, fn in impls.items():
            t = time_cuda(fn)
            medians[name].append(t.median_s)
            timings.setdefault(name, t)
    stats = {}
    for name, ms in medians.items():
        med = statistics.median(ms)
        spread = (max(ms) - min(ms)) / med
        t = timings[name]
        t.median_s = med
        rows.append(make_row(stage, shape, name, t, ceil, nbytes, spread=spread, repeats=ms))
        stats[name] = (med, spread)
    (t_tr, s_tr), (t_cp, s_cp) = stats["triton"], stats["cupy"]
    ratio = t_tr / t_cp  # > 1: CuPy faster
    margin = max(s_tr, s_cp)
    verdict = "cupy" if ratio - 1 > margin else "triton" if 1 - ratio > margin else "tie"
    summary.append((stage, shape, nbytes, t_tr, s_tr, t_cp, s_cp, ratio, verdict))


def bench_maps(ceil, repeats, rows, summary):
    for T in MAPS_TOKENS:
        _bench_maps_shape(T, ceil, repeats, rows, summary)


def _bench_maps_shape(T, ceil, repeats, rows, summary):
    ids = random_ids(T)
    n = T * K
    nbytes = n * 4 + 3 * n * 4 + (E + 1) * 8
    outs = {
        name: [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(3)]
        + [torch.empty(E + 1, dtype=torch.int64, device="cuda")]
        for name in ("triton", "cupy")
    }
    routing_maps_triton(ids, E, *outs["triton"])
    routing_maps_cupy(ids, E, *outs["cupy"])
    assert all(map(torch.equal, outs["triton"], outs["cupy"])), T
    impls = {
        "triton": lambda: routing_maps_triton(ids, E, *outs["triton"]),
        "cupy": lambda: routing_maps_cupy(ids, E, *outs["cupy"]),
    }
    compare("maps", f"T={T} K={K} E={E}", nbytes, impls, ceil, repeats, rows, summary)


def bench_rows(ceil, repeats, rows, summary, dtype=torch.bfloat16, expand=True, **launch):
    """Expand (unless ``expand=False``) and finalize at ROW_SHAPES; ``launch`` (threads=,
    rows_in_flight=, units_per_thread=) goes to the CuPy launchers, for sweeps."""
    for T, H in ROW_SHAPES:
        maps = moe_route.build_routing_maps(random_ids(T), E, backend="triton")
        shape = " ".join([f"T={T} K={K} H={H}", *(f"{k}={v}" for k, v in launch.items())])
        if expand:
            y = _bench_expand(shape, maps, H, dtype, launch, ceil, repeats, rows, summary)
        else:
            y = torch.randn(T * K, H, device="cuda", dtype=dtype)
        _bench_finalize(shape, maps, y, launch, ceil, repeats, rows, summary)


def _bench_expand(shape, maps, H, dtype, launch, ceil, repeats, rows, summary):
    """Times expand; returns its output, the permuted rows finalize then reads."""
    T, n, es = maps.num_tokens, maps.num_expanded_rows, dtype.itemsize
    s2d = maps.expanded_source_row_to_expanded_dest_row
    e4s = maps.expert_for_source_row
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    xp = {name: torch.empty(n, H, device="cuda", dtype=dtype) for name in ("triton", "cupy")}
    expand_rows_triton(x, s2d, e4s, xp["triton"])
    expand_rows_cupy(x, s2d, e4s, xp["cupy"], **launch)
    assert torch.equal(xp["triton"], xp["cupy"]), shape
    nbytes = T * H * es + n * H * es + n * 4  # as bench_routing.py counts it
    impls = {
        "triton": lambda: expand_rows_triton(x, s2d, e4s, xp["triton"]),
        "cupy": lambda: expand_rows_cupy(x, s2d, e4s, xp["cupy"], **launch),
    }
    compare("expand", shape, nbytes, impls, ceil, repeats, rows, summary)
    return xp["cupy"]


def _bench_finalize(shape, maps, y, launch, ceil, repeats, rows, summary):
    T, K, n = maps.num_tokens, maps.top_k, maps.num_expanded_rows
    H, dtype, es = y.shape[1], y.dtype, y.element_size()
    s2d = maps.expanded_source_row_to_expanded_dest_row
    e4s = maps.expert_for_source_row
    w = torch.rand(T, K, device="cuda", dtype=torch.float32)
    bias = torch.randn(H, device="cuda", dtype=dtype)
    out = {name: torch.empty(T, H, device="cuda", dtype=dtype) for name in ("triton", "cupy")}
    finalize_triton(y, w, s2d, e4s, bias, out["triton"])
    finalize_cupy(y, w, s2d, e4s, bias, out["cupy"], **launch)
    assert torch.equal(out["triton"], out["cupy"]), shape
    nbytes = n * H * es + T * H * es + n * 12 + H * es  # as bench_routing.py counts it
    impls = {
        "triton": lambda: finalize_triton(y, w, s2d, e4s, bias, out["triton"]),
        "cupy": lambda: finalize_cupy(y, w, s2d, e4s, bias, out["cupy"], **launch),
    }
    compare("finalize", shape, nbytes, impls, ceil, repeats, rows, summary)


def print_summary(summary, ceil):
    copy = ceil.copy_bytes_per_s
    print(f"\ncopy bandwidth {copy / 1e12:.3f} TB/s; spread = (max - min) / median of repeats")
    head = (
        f"{'stage':<9}{'shape':<48}{'triton us':>10}{'GB/s':>7}{'copy%':>7}{'spread':>8}"
        f"{'cupy us':>10}{'GB/s':>7}{'copy%':>7}{'spread':>8}{'cupy/triton':>12}  winner"
    )
    print(head)
    print("-" * len(head))
    for stage, shape, nbytes, t_tr, s_tr, t_cp, s_cp, ratio, verdict in summary:
        cols = []
        for t, s in ((t_tr, s_tr), (t_cp, s_cp)):
            gbs = nbytes / t / 1e9
            cols.append(
                f"{t * 1e6:>10.1f}{gbs:>7.0f}{100 * nbytes / t / copy:>6.1f}%{100 * s:>7.1f}%"
            )
        print(f"{stage:<9}{shape:<48}{cols[0]}{cols[1]}{ratio:>11.3f}x  {verdict}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also sweep the CuPy launch settings")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cupy: no CUDA device here")
        return 0
    ceil = Ceilings.measure()
    env = environment(ceil)
    rows, summary = [], []
    bench_maps(ceil, args.repeats, rows, summary)
    bench_rows(ceil, args.repeats, rows, summary)
    if args.sweep:  # finalize only: expand's sweep is in the note of kernels/cupy/expand.py
        for rows_in_flight in (8, 4):
            for threads in (64, 128, 256):
                for units in (1, 2, 4):
                    bench_rows(
                        ceil, 1, rows, summary, expand=False, threads=threads,
                        rows_in_flight=rows_in_flight, units_per_thread=units,
                    )  # fmt: skip
    write_results(rows, env, args.out, "cupy_vs_triton")
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    print_summary(summary, ceil)
    return 0


if __name__ == "__main__":
    sys.exit(main())

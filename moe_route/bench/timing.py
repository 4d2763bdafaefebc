"""Robust timing for the benchmarks: medians and 20/80 percentiles of many samples.

* :func:`time_cuda` — CUDA events around ``inner`` calls, captured in a CUDA graph or launched
  eagerly; :func:`time_cpu` — the wall clock;
* :func:`time_auto` — either, the run sized to a time budget (a graph that fails to capture
  falls back to eager launches, said in :attr:`Timing.note`);
* :func:`time_interleaved` — several implementations of one computation timed in turns, so
  that the GPU's clock drift falls on each alike;
* :func:`time_host` — the host time of one call, launches not waited for; :func:`time_eager`
  — one eager call's latency; :func:`time_once` — one first call, compilation included.

:mod:`.harness` re-exports these for the stage scripts.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    samples: int
    note: str = ""  # how it was timed when that differs from what was asked (graph -> eager)


def _summarise(samples: list[float], note: str = "") -> Timing:
    if len(samples) == 1:
        return Timing(samples[0], samples[0], samples[0], 1, note)
    q = statistics.quantiles(samples, n=10, method="inclusive")
    median = statistics.median(samples)
    # The interpolated percentiles can land an ulp past the median (equal samples): the report's
    # error bars are median - p20 and p80 - median, which must not be negative.
    return Timing(median, min(q[1], median), max(q[7], median), len(samples), note)


def time_cuda(
    fn, *, use_graph: bool = True, inner: int = 10, outer: int = 30, warmup: int = 3
) -> Timing:
    """Median and 20/80 percentiles of one call of ``fn``, timed with CUDA events.

    With ``use_graph`` the ``inner`` calls are captured in a CUDA graph and each sample is one
    replay divided by ``inner``: launch gaps vanish, which is what a CUDA-graph-captured model
    sees (small routing kernels are launch-bound). Without it, calls are launched eagerly.
    """
    return _summarise(_CudaSampler(fn, use_graph, inner, warmup).samples(outer))


def capture_graph(fn, inner: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``inner`` calls of ``fn``, captured after two calls on a side stream
    (what capture needs: the allocator's and libraries' first-call work done outside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    previous = torch.cuda.current_stream()
    previous.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    finally:  # a capture that fails leaves torch.cuda.graph's stream current
        torch.cuda.set_stream(previous)
    return graph


class _CudaSampler:
    """Samples of one call of ``fn`` (seconds), ``inner`` calls per sample, on demand: the
    graph (``use_graph``) is captured once, at construction, after ``warmup`` calls."""

    def __init__(self, fn, use_graph: bool, inner: int, warmup: int):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        self.inner = inner
        if use_graph:
            self.graph = capture_graph(fn, inner)
            self.run = self.graph.replay
        else:

            def run():
                for _ in range(inner):
                    fn()

            self.run = run
        self.run()
        torch.cuda.synchronize()

    def samples(self, outer: int) -> list[float]:
        out = []
        for _ in range(outer):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.run()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e-3 / self.inner)
        return out


def time_cpu(fn, *, inner: int = 1, outer: int = 10, warmup: int = 1) -> Timing:
    """:func:`time_cuda` for the CPU: wall-clock samples of ``inner`` calls each."""
    for _ in range(warmup):
        fn()
    return _summarise(_CpuSampler(fn, inner).samples(outer))


#: :func:`time_auto`'s and :func:`time_interleaved`'s bounds: calls per sample, samples
MAX_INNER, MAX_OUTER, MIN_OUTER = 10, 30, 5


def time_auto(
    fn,
    device: torch.device | str = "cuda",
    *,
    use_graph: bool = True,
    budget_s: float = 1.0,
    max_inner: int = MAX_INNER,
    max_outer: int = MAX_OUTER,
    min_outer: int = MIN_OUTER,
) -> Timing:
    """Time ``fn`` on ``device`` in about ``budget_s`` seconds of measurement.

    One warm-up call (compiles the Triton kernels) and one timed call size the run: up to
    ``max_inner`` calls per sample (fewer when one call is long) and between ``min_outer`` and
    ``max_outer`` samples. On CUDA a graph that fails to capture falls back to eager launches,
    noted in ``Timing.note``.
    """
    device = torch.device(device)
    inner, outer = _sized(fn, device, budget_s, max_inner, max_outer, min_outer)
    sampler, note = _sampler(fn, device, use_graph, inner)
    return _summarise(sampler.samples(outer), note)


def time_interleaved(
    fns: dict[str, object],
    device: torch.device | str = "cuda",
    *,
    use_graph: bool = True,
    budget_s: float = 1.0,
    rounds: int = 3,
) -> dict[str, tuple[Timing, list[float]]]:
    """Time several implementations of one computation in turns: ``rounds`` rounds, each
    timing every implementation once (the order rotated by one each round), about
    ``budget_s`` seconds per implementation in all, sized as :func:`time_auto` sizes one.

    A GPU's clocks drift over seconds (power and temperature limits: an H100 fell from 1980
    to 1515 MHz at its 700 W limit during a Mixtral training step), so implementations timed
    one after the other see different clocks, and their ratio carries that drift; in turns,
    each sees every state for about as long. Returns ``{name: (timing over every round's
    samples, [median of each round])}``; every graph is captured before the first round.
    """
    device = torch.device(device)
    samplers, outers, notes = {}, {}, {}
    for name, fn in fns.items():
        inner, outer = _sized(fn, device, budget_s, MAX_INNER, MAX_OUTER, MIN_OUTER)
        samplers[name], notes[name] = _sampler(fn, device, use_graph, inner)
        outers[name] = max(2, math.ceil(outer / rounds))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    medians: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            got = samplers[name].samples(outers[name])
            samples[name] += got
            medians[name].append(statistics.median(got))
    return {n: (_summarise(samples[n], notes[n]), medians[n]) for n in names}


def _sized(fn, device: torch.device, budget_s: float, max_inner: int, max_outer: int,
           min_outer: int) -> tuple[int, int]:  # fmt: skip
    """``(inner, outer)`` for about ``budget_s`` of samples, from one warm-up call (compiles
    the Triton kernels) and one timed call."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        one = max(time.perf_counter() - start, 1e-7)
        inner = max(1, min(max_inner, math.ceil(1e-3 / one)))
    else:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        one = max(start.elapsed_time(end) * 1e-3, 1e-7)
        # ~ a fifth of the budget per sample at most, so that there are enough samples.
        inner = max(1, min(max_inner, int(budget_s / 5 / one)))
    return inner, max(min_outer, min(max_outer, int(budget_s / (inner * one))))


def _sampler(fn, device: torch.device, use_graph: bool, inner: int):
    """``(sampler, note)``: CUDA events (a graph of ``inner`` calls where asked and capturable,
    else eager launches, said in ``note``) or the wall clock off CUDA."""
    if device.type != "cuda":
        return _CpuSampler(fn, inner), ""
    note = ""
    if use_graph:
        try:
            return _CudaSampler(fn, True, inner, warmup=1), note
        except Exception as exc:  # e.g. a host sync inside fn: not capturable
            torch.cuda.synchronize()
            note = f"eager (graph capture failed: {type(exc).__name__})"
    return _CudaSampler(fn, False, inner, warmup=1), note


class _CpuSampler:
    """:class:`_CudaSampler` for the CPU: wall-clock samples of ``inner`` calls each."""

    def __init__(self, fn, inner: int):
        self.fn, self.inner = fn, inner

    def samples(self, outer: int) -> list[float]:
        out = []
        for _ in range(outer):
            start = time.perf_counter()
            for _ in range(self.inner):
                self.fn()
            out.append((time.perf_counter() - start) / self.inner)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_host(fn, device, *, calls: int = 300, repeats: int = 3, warmup: int = 3) -> Timing:
    """Host time of one call of ``fn``: ``time.perf_counter`` around ``calls`` calls issued back
    to back with no synchronisation inside the loop, divided by ``calls``; one sample per loop.

    After ``warmup`` calls. Each loop is followed by one synchronisation, outside the timed
    region, so that the next loop starts with an empty queue. As long as the device keeps up
    with the launches this is the time the host spends per call (Python, validation, dispatch,
    launches); when one call's device time exceeds it, the launch queue fills and the loop
    waits for the device (the ``host`` stage flags those rows, see ``device_bound``).
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
        _sync(device)
    return _summarise(samples)


def time_eager(fn, device, *, rep_ms: int = 100) -> Timing:
    """Latency of one eager call: ``triton.testing.do_bench``'s median (and 20/80 percentiles)
    on CUDA — CUDA events around each call, L2 flushed between calls —, wall clock on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return time_cpu(fn, inner=1, outer=3, warmup=1)
    try:
        from triton.testing import do_bench
    except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels
        return time_cuda(fn, use_graph=False, inner=1, outer=30)
    median, p20, p80 = do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(median * 1e-3, p20 * 1e-3, p80 * 1e-3, 0)


def time_once(fn, device) -> tuple[float, float]:
    """``(latency, host)`` seconds of one call of ``fn``, the device drained before: until the
    device has drained again, and until ``fn`` returned (what a compile, or a decision taken
    again, adds to; the device's own time is not in it). A first call's cost, compilation
    included."""
    device = torch.device(device)
    _sync(device)
    start = time.perf_counter()
    fn()
    returned = time.perf_counter()
    _sync(device)
    return time.perf_counter() - start, returned - start

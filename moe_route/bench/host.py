"""The ``host`` stage: what one call costs the host, eager against CUDA-graph latency, and the
cost of the first call at a token count not seen before.

For every public op, ``fused_moe`` (forward, and forward + backward) and ``MoELayer`` forward,
one row (``impl`` = the op) with:

* ``median_us`` (p20, p80): host µs per call, :func:`~.timing.time_host` (``time.perf_counter``
  around ``ctx.host_calls`` calls with no synchronisation inside the loop, after warm-up; one
  synchronisation after each loop, outside the timed region);
* ``extra["per_index_select"]``: that over the host time of one ``torch.index_select`` of the
  expand's size (``T*K`` rows of ``x``) timed the same way in the same process right before
  the row's own loops (``extra["index_select_us"]``): a yardstick that makes host times
  comparable across machines, and across a run on a shared host whose speed drifts (its own
  row is ``index_select``, the first measurement);
* ``extra["eager_us"]``: the latency of one eager call (``triton.testing.do_bench`` median);
  ``extra["graph_us"]``: one call replayed from a CUDA graph of 10 calls;
  ``extra["eager_over_graph"]``;
* ``extra["device_bound"]``: the graph latency is at least 80 % of the host time, so the host
  loop may have waited for a full launch queue: the host figure is then an upper bound.

And one row ``fused_moe new T``: after calls at ``T`` (the last one synchronised on its own),
the first call at each of up to three
token counts of ``T``'s power-of-two bucket (``(2^(b-1), 2^b]``, below ``T``) not used before in
this process, device drained before and after (``median_us`` = the median first call); the
same calls repeated give ``extra["repeat_us"]``, and ``extra["first_over_repeat"]`` is the worst
first call over it (near 1 when a new token count compiles nothing); ``first_host_us``,
``repeat_host_us`` and ``host_first_over_repeat`` the same for the host time of those calls
(until each returns: a compile or a decision taken again shows there, the device's jitter
does not).

Only public functions are called (``moe_route.*``), so the stage measures whatever the package's
internals are.
"""

from __future__ import annotations

import statistics

import torch

import moe_route

from .context import Context, Inputs
from .harness import make_row
from .shapes import Shape
from .timing import _summarise, time_cuda, time_eager, time_host, time_once

STAGE = "host"
YARDSTICK = "index_select"
NEW_T = "fused_moe new T"
# Token counts of the standard shapes: never picked as "not seen before".
_STANDARD_T = {1, 8, 64, 128, 4096, 8192, 16384, 32768}
# Token counts the new-T measurement used, per weights' configuration: a second run in the same
# process (a test, a notebook) picks others, since those are compiled already.
_SEEN_T: dict[tuple, set[int]] = {}


def new_token_counts(shape: Shape, key: tuple, count: int = 3) -> list[int]:
    """Up to ``count`` token counts below ``shape.T`` in its power-of-two bucket, spread over
    it, not standard and not used before under ``key``; remembered as used."""
    bucket_low = 1 << ((shape.T - 1).bit_length() - 1) if shape.T > 2 else shape.T
    seen = _SEEN_T.setdefault(key, set())
    taken = seen | _STANDARD_T
    free = [t for t in range(shape.T - 1, bucket_low, -1) if t not in taken]
    if len(free) > count:
        free = [free[i * (len(free) - 1) // max(count - 1, 1)] for i in range(count)]
    seen.update(free)
    return free


def _layer(inp: Inputs, shape: Shape, ctx: Context) -> moe_route.MoELayer:
    """An inference ``MoELayer`` (softmax router) whose expert weights are ``inp``'s (no copy:
    at deepseek-v3's sizes a second set would take 22 GB)."""
    layer = moe_route.MoELayer(
        shape.H, shape.I, shape.E, shape.K, device="meta", dtype=ctx.dtype, backend=ctx.backend
    )
    layer.gate = torch.nn.Linear(shape.H, shape.E, bias=False, device=ctx.device, dtype=ctx.dtype)
    layer.w1 = torch.nn.Parameter(inp.w1, requires_grad=False)
    layer.w2 = torch.nn.Parameter(inp.w2, requires_grad=False)
    return layer.requires_grad_(False)


def _calls(shape: Shape, ctx: Context) -> dict:
    """The calls to time, by row name; the yardstick first."""
    inp = ctx.inputs(shape)
    x, w1, w2, tw, ids, maps = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, inp.maps
    E, be = shape.E, ctx.backend
    rows = maps.expanded_dest_row_to_expanded_source_row.long() % shape.T
    h = moe_route.grouped_gemm(x, w1, maps, activation="swiglu", gather=True, backend=be)
    y = moe_route.grouped_gemm(h, w2, maps, backend=be)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, tw)]
    dout = inp.randn(shape.T, shape.H)
    layer = _layer(inp, shape, ctx)

    def fwd_bwd():
        out = moe_route.fused_moe(*leaves[:4], ids, backend=be)
        return torch.autograd.grad(out, leaves, dout)

    return {
        YARDSTICK: lambda: torch.index_select(x, 0, rows),
        "build_routing_maps": lambda: moe_route.build_routing_maps(ids, E, backend=be),
        "expand_rows": lambda: moe_route.expand_rows(x, maps, backend=be),
        "finalize_moe_routing": lambda: moe_route.finalize_moe_routing(y, tw, maps, backend=be),
        "grouped_gemm GEMM1": lambda: moe_route.grouped_gemm(
            x, w1, maps, activation="swiglu", gather=True, backend=be
        ),
        "grouped_gemm GEMM2": lambda: moe_route.grouped_gemm(h, w2, maps, backend=be),
        "fused_moe": lambda: moe_route.fused_moe(x, w1, w2, tw, ids, backend=be),
        "fused_moe fwd+bwd": fwd_bwd,
        "MoELayer": lambda: layer(x),
    }


def _yardstick_us(fn, ctx: Context) -> float:
    """Host µs per call of the yardstick, timed as the rows are."""
    warmup = 3 if ctx.cuda else 1
    return time_host(fn, ctx.device, calls=ctx.host_calls, warmup=warmup).median_s * 1e6


def _graph_us(fn, ctx: Context) -> float | None:
    if not ctx.cuda:
        return None
    return time_cuda(fn, use_graph=True, inner=10, outer=10, warmup=1).median_s * 1e6


def stage_host(shape: Shape, ctx: Context) -> None:
    calls = _calls(shape, ctx)
    for name, fn in calls.items():
        try:
            eager_us = time_eager(fn, ctx.device).median_s * 1e6
            # One loop when a loop takes seconds (device-bound calls at deepseek-v3's sizes).
            repeats = 3 if ctx.cuda and eager_us * ctx.host_calls < 2e6 else 1
            host = time_host(
                fn, ctx.device, calls=ctx.host_calls, repeats=repeats, warmup=3 if ctx.cuda else 1
            )
        except Exception as exc:
            ctx.fail(STAGE, shape, name, exc)
            continue
        host_us = host.median_s * 1e6
        extra = {"calls": ctx.host_calls, "eager_us": eager_us}
        # A shared host's speed drifts: timed next to each row, the ratio stays within one
        # window (docs/decisions.md, "Host-stage method").
        yardstick_us = host_us if name == YARDSTICK else _yardstick_us(calls[YARDSTICK], ctx)
        extra["index_select_us"] = yardstick_us
        extra["per_index_select"] = host_us / yardstick_us
        try:
            graph_us = _graph_us(fn, ctx)
        except Exception as exc:  # e.g. a host sync inside: not capturable
            torch.cuda.synchronize()
            extra["graph"] = f"capture failed: {type(exc).__name__}: {exc}"[:200]
            graph_us = None
        if graph_us is not None:
            extra.update(graph_us=graph_us, eager_over_graph=eager_us / graph_us)
            extra["device_bound"] = graph_us >= 0.8 * host_us
        ctx.rows.append(make_row(STAGE, shape.label, name, host, ctx.ceilings, 0, **extra))
        if name == "fused_moe":
            ctx.attempt(STAGE, shape, NEW_T, lambda: _first_calls(shape, ctx))


def _first_calls(shape: Shape, ctx: Context) -> None:
    """The ``fused_moe new T`` row (see the module's docstring)."""
    inp = ctx.inputs(shape)
    key = (ctx.device.type, ctx.dtype, ctx.backend, shape.H, shape.I, shape.E, shape.K)
    counts = new_token_counts(shape, key)
    if not counts:  # T = 1, 2: no other token count in the bucket
        return
    x, w1, w2, tw, ids = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids

    def call(t):
        return lambda: moe_route.fused_moe(x[:t], w1, w2, tw[:t], ids[:t], backend=ctx.backend)

    # The first synchronised call after a loop of unsynchronised ones is slow at any T: one call
    # at the seen T settles that first (docs/decisions.md, "Host-stage method").
    # Single calls' latency is noisy; their host time (until they return) is where a compile or
    # a decision taken again would show, a cold host after the wait aside (docs/decisions.md,
    # "Host-stage method").
    time_once(call(shape.T), ctx.device)
    first = [time_once(call(t), ctx.device) for t in counts]
    repeat = [time_once(call(t), ctx.device) for t in counts for _ in range(3 if ctx.cuda else 1)]
    repeat_us = statistics.median(s for s, _ in repeat) * 1e6
    repeat_host_us = statistics.median(h for _, h in repeat) * 1e6
    row = make_row(
        STAGE, shape.label, NEW_T, _summarise([s for s, _ in first]), ctx.ceilings, 0,
        new_T=counts, first_us=[s * 1e6 for s, _ in first], repeat_us=repeat_us,
        first_over_repeat=max(s for s, _ in first) * 1e6 / repeat_us,
        first_host_us=[h * 1e6 for _, h in first], repeat_host_us=repeat_host_us,
        host_first_over_repeat=max(h for _, h in first) * 1e6 / repeat_host_us,
    )  # fmt: skip
    ctx.rows.append(row)

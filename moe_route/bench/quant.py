"""The ``quant`` stage: moe_route's quantised experts against its own bf16 forward and the FP8
pipelines a user could run instead. Forward only, under ``torch.no_grad``.

At a prefill shape (``T > 128``), rows of stage ``quant``, one per implementation:

* ``moe_route bf16`` — ``fused_moe`` on the bf16 weights (``fp32`` on the CPU): the reference
  every other row is compared with;
* ``moe_route fp8`` / ``moe_route fp8_channel`` / ``moe_route mxfp4`` — ``fused_moe(...,
  quant=...)`` on the same weights quantised by :func:`moe_route.quantize_experts`;
* ``torch._scaled_grouped_mm fp8 rowwise`` — :func:`.baselines.scaled_grouped_mm_forward` on
  the ``fp8_channel`` weights (optional: where this torch or device lacks the operator or
  refuses the layout, it is recorded in ``ctx.skipped`` with the reason);
* ``transformers fp8 grouped_mm`` — transformers' FP8 ``grouped_mm`` experts function on the
  ``fp8`` weights (:func:`.baselines.transformers_fp8_experts`; optional likewise, CUDA only);
* ``triton_kernels matmul_ogs mxfp4`` — OpenAI's ``triton_kernels`` on the bf16 weights
  quantised to MXFP4 by its own quantiser, bf16 activations
  (:func:`.baselines.triton_kernels_experts`; CUDA only, where that package can be imported,
  else skipped with the reason), with the gated activation it fuses, gpt-oss's clamped SwiGLU;
  timed in turns with ``moe_route mxfp4 gpt-oss swiglu`` (``fused_moe`` on moe_route's
  ``mxfp4`` weights with that activation), both checked against the bf16 ``fused_moe`` with
  it; ``x_triton_kernels`` on moe_route's row.

The four moe_route rows are timed in turns (:meth:`.context.Context.measure_together`), then the
``triton_kernels`` pair, then the bf16 and MXFP4 weights are freed and each other baseline is
timed on its own. Each row's ``extra``:
``quant`` (its format), ``rel_err`` (relative Frobenius error of its output against the bf16
output), ``tflops`` (``6·T·K·H·I`` FLOPs, GEMM1 and GEMM2, over its time), ``of_dense`` (that
over the dense rate of its products: FP8 for the FP8 rows, measured with ``torch._scaled_mm``
in the same run, bf16 for the others; ``rate`` says which), ``x_bf16`` (the bf16 row's time over
its own), ``peak_mib``; ``moe_route fp8_channel`` also ``x_scaled_grouped_mm``, ``moe_route fp8``
``x_transformers`` (the baseline of the same format over it). Bytes: tokens in and out, the
touched experts' weights and scales in the row's format, the routing; the roofline floor takes
the row's dense rate.

At a decode shape (``T <= 128``), rows of stage ``quant-dec``: ``moe_route bf16``, ``moe_route
fp8``, ``moe_route mxfp4``, timed in turns, each against its format's weight-read floor: the
bytes of the experts the routing touches (the distinct ids of the ``T·K`` slots, ``touched``)
in that format, scales included (``weight_bytes``), over the measured copy bandwidth
(``floor_us``); ``over_floor`` = time / floor. And rows of stage ``quant-host``: the host time of
one eager call (``time.perf_counter`` around calls issued with no synchronisation, as the
``host`` stage times them, the implementations in turns over five loops of 32 calls) of
``fused_moe fp8`` and ``fused_moe mxfp4`` against ``fused_moe bf16`` (``over_ref``), with
``eager_us`` and ``graph_us`` as in the ``host`` stage and the path the eager call takes
(``path``: ``"decode"``, two launches and no maps, or ``"sorted"``). A loop of 32 calls
never fills CUDA's launch queue, so unlike the ``host`` stage's it does not wait for the
device, and no row is flagged device-bound: where ``graph_us`` exceeds the host time, an eager
call's latency is the device's.

Weights are quantised by ``moe_route.quantize_experts``, a few experts at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

import moe_route
from moe_route.decode import decode_planned
from moe_route.plan import moe_plan, quant_plan_for
from moe_route.quant import as_quant

from . import baselines as B
from .context import Context, Entry, Inputs, rel_err
from .harness import Ceilings, Row, make_row
from .host import _graph_us
from .shapes import Shape
from .timing import _summarise, time_eager, time_host

STAGE, DECODE, HOST = "quant", "quant-dec", "quant-host"
ROWS = (STAGE, DECODE, HOST)
PREFILL_FORMATS = ("fp8", "fp8_channel", "mxfp4")
DECODE_FORMATS = ("fp8", "mxfp4")
FP8_FORMATS = ("fp8", "fp8_channel")
FORMATS_ALL = ("fp8", "fp8_ue8m0", "fp8_channel", "fp8_channel_ue8m0", "mxfp4")
# Relative error against the bf16 output above which a row is a mismatch: e4m3 codes are off by
# up to 1/16, e2m1 ones by up to 1/4 (random data: about 0.065 and 0.20 on the CPU shapes).
TOL = {"fp8": 0.15, "fp8_channel": 0.15, "mxfp4": 0.4}
SCALED_GROUPED_MM = "torch._scaled_grouped_mm fp8 rowwise"
TRANSFORMERS = "transformers fp8 grouped_mm"
TRITON_KERNELS = "triton_kernels matmul_ogs mxfp4"
GPT_OSS_MXFP4 = "moe_route mxfp4 gpt-oss swiglu"
#: calls per host-time loop: at under ten launches a call, a loop stays well inside CUDA's launch
#: queue (about a thousand launches), so that a call slower on the device than on the host
#: (deepseek-v3's weights) still times its host side instead of waiting for the queue
HOST_QUEUE_CALLS = 32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def _touched_bytes(tensors, E: int, touched: int) -> int:
    """Bytes of ``touched`` experts of ``[E, ...]`` weights and scales."""
    return sum(t.numel() * t.element_size() for t in tensors) * touched // E


class _Weights:
    """The experts by format (``None``: unquantised) as ``(w1, w2, w1_scale, w2_scale)``;
    a format is freed by dropping it."""

    def __init__(self, inp: Inputs):
        self.inp = inp
        self.by = {None: (inp.w1, inp.w2, None, None)}

    def quantize(self, fmt: str) -> None:
        w1, w2 = self.by[None][:2]
        q1, s1 = moe_route.quantize_experts(w1, fmt)
        q2, s2 = moe_route.quantize_experts(w2, fmt)
        self.by[fmt] = (q1, q2, s1, s2)

    def drop(self, fmt) -> None:
        self.by.pop(fmt, None)
        if fmt is None:  # the shape's bf16 weights: no later stage of this shape needs them
            self.inp.__dict__.pop("w1", None)
            self.inp.__dict__.pop("w2", None)
        if self.inp.device.type == "cuda":
            torch.cuda.empty_cache()

    def nbytes(self, fmt) -> int:
        return _touched_bytes([t for t in self.by[fmt] if t is not None], self.inp.shape.E,
                              self.inp.touched)  # fmt: skip

    def eager_path(self, fmt, backend: str) -> str:
        """``"decode"`` or ``"sorted"``: the path an eager ``fused_moe`` call on the experts of
        ``fmt`` takes (the plan's decision, as :meth:`fused`'s calls are planned)."""
        inp = self.inp
        x, K = inp.x, inp.shape.K
        w1, w2 = self.by[fmt][:2]
        if fmt is None:
            plan = moe_plan(x, w1, w2, K, "swiglu", "concat", "auto", True, None, False, backend)
        else:
            plan = quant_plan_for(x, w1, w2, K, "swiglu", "concat", as_quant(fmt), backend)
        return "decode" if decode_planned(plan, False) else "sorted"

    def fused(self, fmt, backend: str):
        """``fused_moe`` on the experts of ``fmt`` (looked up per call: a dropped format's
        tensors are not held by the callable)."""
        inp = self.inp
        x, tw, ids = inp.x, inp.topk_weights, inp.topk_ids

        def call():
            w1, w2, s1, s2 = self.by[fmt]
            if fmt is None:
                return moe_route.fused_moe(x, w1, w2, tw, ids, backend=backend)
            return moe_route.fused_moe(x, w1, w2, tw, ids, quant=fmt, w1_scale=s1, w2_scale=s2,
                                       backend=backend)  # fmt: skip

        return call


def _impl(fmt, ctx: Context) -> str:
    return f"moe_route {fmt or dtype_name(ctx.dtype)}"


def _refloor(row: Row, ceilings: Ceilings) -> None:
    """The row's floor and roofline fraction with ``ceilings`` (another dense rate)."""
    floor = ceilings.floor_s(row.bytes, row.flops)
    row.floor_us = floor * 1e6
    row.roofline_fraction = floor / (row.median_us * 1e-6)


def _rates(row: Row, ctx: Context, fp8: bool) -> None:
    """``tflops``, ``of_dense`` and ``rate`` of a prefill row; FP8 rows' floor at the FP8 rate."""
    measured = fp8 and ctx.ceilings.fp8_mm_flops_per_s > 0
    rate = ctx.ceilings.mm_rate(fp8)
    achieved = row.flops / (row.median_us * 1e-6)
    row.extra["tflops"] = achieved / 1e12
    row.extra["of_dense"] = achieved / rate
    row.extra["rate"] = "fp8" if measured else "mm" + (" (fp8 rate not measured)" if fp8 else "")
    if measured:
        _refloor(row, replace(ctx.ceilings, mm_flops_per_s=rate))


def _ratio(rows: dict, key: str, base: str, impl: str) -> None:
    """``rows[impl].extra[key] = rows[base] time / rows[impl] time`` where both exist."""
    if base in rows and impl in rows and rows[impl].median_us > 0:
        rows[impl].extra[key] = rows[base].median_us / rows[impl].median_us


def stage_quant(shape: Shape, ctx: Context) -> None:
    with torch.no_grad():
        if shape.decode:
            _decode(shape, ctx)
        else:
            _prefill(shape, ctx)


def _prepared(stage: str, shape: Shape, ctx: Context, formats) -> tuple[_Weights, object]:
    """The weights (bf16 and ``formats``, those that quantise) and the bf16 output (None
    where that fails)."""
    weights = _Weights(ctx.inputs(shape))
    ref = ctx.attempt(stage, shape, _impl(None, ctx), weights.fused(None, ctx.backend))
    for fmt in formats:
        ctx.attempt(stage, shape, _impl(fmt, ctx), lambda fmt=fmt: weights.quantize(fmt))
    if ctx.cuda:  # the quantisers' float32 temporaries
        torch.cuda.empty_cache()
    return weights, ref


def _entries(stage: str, shape: Shape, ctx: Context, weights: _Weights, ref, formats, flops,
             extra_bytes: int, memory: bool) -> list:  # fmt: skip
    entries = []
    for fmt in (None, *formats):
        if fmt not in weights.by:
            continue
        wb = weights.nbytes(fmt)
        check = None if fmt is None or ref is None else (lambda out: rel_err(out, ref))
        extra = {"quant": fmt or dtype_name(ctx.dtype), "touched": weights.inp.touched,
                 "weight_bytes": wb}  # fmt: skip
        entries.append(Entry(_impl(fmt, ctx), weights.fused(fmt, ctx.backend), wb + extra_bytes,
                             flops, memory=memory, check=check, tol=TOL.get(fmt, 0.0),
                             extra=extra))  # fmt: skip
    return entries


def _prefill(shape: Shape, ctx: Context) -> None:
    weights, ref = _prepared(STAGE, shape, ctx, PREFILL_FORMATS)
    inp = weights.inp
    T, H, K = shape.T, shape.H, shape.K
    es = inp.x.element_size()
    io_bytes = 2 * T * H * es + T * K * 8  # tokens in and out, the routing
    flops = 6 * T * K * H * shape.I
    entries = _entries(STAGE, shape, ctx, weights, ref, PREFILL_FORMATS, flops, io_bytes, True)
    rows = ctx.measure_together(STAGE, shape, entries)
    del entries
    for row in rows.values():
        _rates(row, ctx, row.extra["quant"] in FP8_FORMATS)
    ref_impl = _impl(None, ctx)
    key = f"x_{dtype_name(ctx.dtype)}"
    if ctx.cuda:
        rows.update(_triton_kernels(shape, ctx, weights, flops, io_bytes))
    # Only quantised experts from here: the bf16 and MXFP4 weights go.
    weights.drop(None)
    weights.drop("mxfp4")

    x, tw, ids = inp.x, inp.topk_weights, inp.topk_ids
    check = None if ref is None else (lambda out: rel_err(out, ref))
    if "fp8_channel" in weights.by:
        q1, q2, s1, s2 = weights.by["fp8_channel"]
        nbytes = weights.nbytes("fp8_channel") + io_bytes

        def scaled(align):
            return lambda: B.scaled_grouped_mm_forward(x, q1, s1, q2, s2, tw, ids, align=align)

        fn, extra = _probe_scaled(scaled, ref, shape, ctx)
        if fn is not None:
            row = ctx.measure(STAGE, shape, SCALED_GROUPED_MM, fn, nbytes, flops, memory=True,
                              check=check, tol=TOL["fp8_channel"], quant="fp8_channel",
                              **extra)  # fmt: skip
            if row is not None:
                _rates(row, ctx, True)
                rows[SCALED_GROUPED_MM] = row
        del fn, q1, q2, s1, s2
        weights.drop("fp8_channel")
    if "fp8" in weights.by:
        fn = _probe_transformers(weights.by["fp8"], inp, shape, ctx)
        if fn is not None:
            row = ctx.measure(STAGE, shape, TRANSFORMERS, fn, weights.nbytes("fp8") + io_bytes,
                              flops, memory=True, check=check, tol=TOL["fp8"],
                              quant="fp8")  # fmt: skip
            if row is not None:
                _rates(row, ctx, True)
                rows[TRANSFORMERS] = row
        del fn
        weights.drop("fp8")
    for impl in rows:
        if impl != ref_impl:
            _ratio(rows, key, ref_impl, impl)
    _ratio(rows, "x_scaled_grouped_mm", SCALED_GROUPED_MM, _impl("fp8_channel", ctx))
    _ratio(rows, "x_transformers", TRANSFORMERS, _impl("fp8", ctx))


def _triton_kernels(shape: Shape, ctx: Context, weights: _Weights, flops, io_bytes) -> dict:
    """Rows :data:`TRITON_KERNELS` and :data:`GPT_OSS_MXFP4`, timed in turns (none, with the
    reason in ``ctx.skipped``, where ``triton_kernels`` cannot be imported)."""
    if not B.triton_kernels_available():
        ctx.skip(STAGE, shape, TRITON_KERNELS, "triton_kernels is not importable (put it on "
                 "PYTHONPATH: bench/README.md)")  # fmt: skip
        return {}
    if None not in weights.by or "mxfp4" not in weights.by:
        return {}
    inp = weights.inp
    x, tw, ids = inp.x, inp.topk_weights, inp.topk_ids
    w1, w2 = weights.by[None][:2]
    act = B.GPT_OSS_ACTIVATION
    warps = 4 if shape.T <= 512 else 8  # as triton_kernels' own benchmark picks them
    try:
        peer, peer_bytes = B.triton_kernels_experts(w1, w2, mxfp4=True, num_warps=warps)
    except ImportError as exc:  # another package of that name, or one of another version
        ctx.skip(STAGE, shape, TRITON_KERNELS, _reason(exc))
        return {}
    except Exception as exc:
        ctx.fail(STAGE, shape, TRITON_KERNELS, exc)
        return {}
    ref = ctx.attempt(STAGE, shape, TRITON_KERNELS, lambda: moe_route.fused_moe(
        x, w1, w2, tw, ids, activation=act, backend=ctx.backend))  # fmt: skip
    torch.cuda.empty_cache()  # (the conversion's temporaries)
    check = None if ref is None else (lambda out: rel_err(out, ref))
    q1, q2, s1, s2 = weights.by["mxfp4"]

    def ours():
        return moe_route.fused_moe(x, q1, q2, tw, ids, activation=act, quant="mxfp4",
                                   w1_scale=s1, w2_scale=s2, backend=ctx.backend)  # fmt: skip

    touched, E = inp.touched, shape.E
    entries = [
        Entry(GPT_OSS_MXFP4, ours, weights.nbytes("mxfp4") + io_bytes, flops, memory=True,
              check=check, tol=TOL["mxfp4"],
              extra={"quant": "mxfp4", "activation": act, "touched": touched,
                     "weight_bytes": weights.nbytes("mxfp4")}),
        Entry(TRITON_KERNELS, lambda: peer(x, tw, ids), peer_bytes * touched // E + io_bytes,
              flops, memory=True, check=check, tol=TOL["mxfp4"],
              extra={"quant": "mxfp4", "activation": act, "touched": touched,
                     "weight_bytes": peer_bytes * touched // E}),
    ]  # fmt: skip
    rows = ctx.measure_together(STAGE, shape, entries)
    for row in rows.values():
        _rates(row, ctx, False)
    _ratio(rows, "x_triton_kernels", TRITON_KERNELS, GPT_OSS_MXFP4)
    return rows


def _settle(ctx: Context) -> None:
    """Drain the device after a baseline raised (a sticky CUDA error raises here too: the
    stage's next step will say so)."""
    if ctx.cuda:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:300]


def _probe_scaled(make, ref, shape: Shape, ctx: Context):
    """``(fn, extra)`` of the ``_scaled_grouped_mm`` pipeline: groups as they fall, else each
    expert's group padded to 16 rows (for builds that want aligned groups); ``(None, {})``
    with the reason in ``ctx.skipped`` where neither runs."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        ctx.skip(STAGE, shape, SCALED_GROUPED_MM, f"torch {torch.__version__} has no "
                 "torch._scaled_grouped_mm")  # fmt: skip
        return None, {}
    reasons, ran = [], None
    for align in (1, 16):
        fn = make(align)
        try:
            out = fn()
        except Exception as exc:
            reasons.append(f"groups aligned to {align}: {_reason(exc)}")
            _settle(ctx)
            if isinstance(exc, NotImplementedError):  # not on this device at all
                break
            continue
        err = 0.0 if ref is None else rel_err(out, ref)
        del out
        ran = ran or (fn, align)
        if err <= TOL["fp8_channel"]:
            return fn, {"group_align": align, "use_fast_accum": True}
        reasons.append(f"groups aligned to {align}: error {err:.3g} against the bf16 output")
    if ran is not None:  # it runs, with a wrong result: measured, the check records it
        return ran[0], {"group_align": ran[1], "use_fast_accum": True}
    ctx.skip(STAGE, shape, SCALED_GROUPED_MM, "; ".join(reasons))
    return None, {}


def _probe_transformers(quantised, inp: Inputs, shape: Shape, ctx: Context):
    """transformers' FP8 ``grouped_mm`` experts function on the ``fp8`` weights, or None with
    the reason in ``ctx.skipped``."""
    if not ctx.cuda:
        ctx.skip(STAGE, shape, TRANSFORMERS, "CUDA only (its FP8 GEMMs are Triton kernels that "
                 "transformers loads from the hub with `kernels`)")  # fmt: skip
        return None
    q1, q2, s1, s2 = quantised
    x, tw, ids = inp.x, inp.topk_weights, inp.topk_ids
    try:
        forward = B.transformers_fp8_experts(q1, s1, q2, s2)
        forward(x, tw, ids)
    except Exception as exc:  # no transformers, no `kernels`, no hub access, another API
        _settle(ctx)
        ctx.skip(STAGE, shape, TRANSFORMERS, _reason(exc))
        return None
    return lambda: forward(x, tw, ids)


def _decode(shape: Shape, ctx: Context) -> None:
    weights, ref = _prepared(DECODE, shape, ctx, DECODE_FORMATS)
    entries = _entries(DECODE, shape, ctx, weights, ref, DECODE_FORMATS, 0.0, 0, False)
    rows = ctx.measure_together(DECODE, shape, entries)
    del entries
    ref_impl = _impl(None, ctx)
    for impl, row in rows.items():
        row.extra["over_floor"] = row.median_us / row.floor_us if row.floor_us > 0 else 0.0
        if impl != ref_impl:
            _ratio(rows, f"x_{dtype_name(ctx.dtype)}", ref_impl, impl)
    calls = {f"fused_moe {fmt or dtype_name(ctx.dtype)}": (fmt, weights.fused(fmt, ctx.backend))
             for fmt in (None, *DECODE_FORMATS) if fmt in weights.by}  # fmt: skip
    paths = {name: weights.eager_path(fmt, ctx.backend) for name, (fmt, _) in calls.items()}
    _host(shape, ctx, calls, paths)


def _host(shape: Shape, ctx: Context, calls: dict, paths: dict) -> None:
    """``quant-host`` rows: host time per eager call, the calls in turns (five loops of
    :data:`HOST_QUEUE_CALLS` calls each), and the path each eager call takes (``paths``)."""
    eager = {}
    for name, (_, fn) in calls.items():
        try:
            eager[name] = time_eager(fn, ctx.device).median_s
        except Exception as exc:
            ctx.fail(HOST, shape, name, exc)
    names = list(eager)
    if not names:
        return
    n = min(ctx.host_calls, HOST_QUEUE_CALLS)
    samples = {k: [] for k in names}
    for r in range(5):
        k0 = r % len(names)
        for name in names[k0:] + names[:k0]:
            fn = calls[name][1]
            t = time_host(fn, ctx.device, calls=n, repeats=1, warmup=3 if r == 0 else 1)
            samples[name].append(t.median_s)
    ref = next(iter(calls))  # the unquantised call
    for name in names:
        fmt, fn = calls[name]
        timing = _summarise(samples[name])
        extra = {"quant": fmt or dtype_name(ctx.dtype), "calls": n,
                 "eager_us": eager[name] * 1e6, "path": paths[name]}  # fmt: skip
        try:
            graph_us = _graph_us(fn, ctx)
        except Exception as exc:  # not capturable
            _settle(ctx)
            extra["graph"] = f"capture failed: {_reason(exc)}"[:200]
            graph_us = None
        if graph_us is not None:
            extra["graph_us"] = graph_us
        if ref in samples:
            extra["over_ref"] = timing.median_s / _summarise(samples[ref]).median_s
        ctx.rows.append(make_row(HOST, shape.label, name, timing, ctx.ceilings, 0, **extra))

"""The ``forward`` stage: the whole MoE forward, against the two PyTorch pipelines.

On CUDA, where OpenAI's ``triton_kernels`` can be imported (bench/README.md), also its
``matmul_ogs`` experts step (:func:`.baselines.triton_kernels_experts`, row
:data:`TRITON_KERNELS`) with the one gated activation it fuses, gpt-oss's clamped SwiGLU,
next to ``fused_moe`` with that activation (row :data:`GPT_OSS`), both checked against the
``_grouped_mm`` pipeline with it, in the same turns as the other rows; ``x_triton_kernels``
on the :data:`GPT_OSS` row is the peer's time over moe_route's. Where the package is absent
on CUDA, the reason is listed under ``skipped``.

:func:`forward_cost` (bytes and FLOPs of one forward) is also the base of the ``train``
stage's counts.
"""

from __future__ import annotations

import moe_route

from . import baselines as B
from .context import Context, Entry, Inputs, _tol, _weight_bytes, rel_err
from .shapes import Shape

TRITON_KERNELS = "triton_kernels matmul_ogs"
GPT_OSS = "moe_route gpt-oss swiglu"


def forward_cost(shape: Shape, inp: Inputs) -> tuple[int, int]:
    """(bytes, flops) of one MoE forward: x in, out, the touched experts' weights, the routing."""
    es = inp.x.element_size()
    nbytes = 2 * shape.T * shape.H * es + _weight_bytes(shape, inp) + shape.T * shape.K * 8
    return nbytes, 6 * shape.T * shape.K * shape.H * shape.I


def stage_forward(shape: Shape, ctx: Context) -> None:
    """The whole forward, routing maps → output, against the two PyTorch pipelines."""
    inp = ctx.inputs(shape)
    x, w1, w2, tw, ids = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids
    nbytes, flops = forward_cost(shape, inp)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    def grouped_mm():
        return B.grouped_mm_forward(x, w1t, w2t, tw, ids)

    def loop():
        return B.loop_forward(x, w1, w2, tw, ids)

    ref = ctx.attempt("forward", shape, "grouped_mm", grouped_mm)
    if ctx.loop_allowed(shape):
        if ref is None:
            ref = ctx.attempt("forward", shape, "loop", loop)
        ctx.measure("forward", shape, "loop", loop, nbytes, flops, graph=False, memory=True)
    check = None if ref is None else (lambda out: rel_err(out, ref))
    entries = [] if ref is None else [Entry("grouped_mm", grouped_mm, nbytes, flops, memory=True)]
    variants = [("moe_route", {})]
    if ctx.cuda:  # both finalize paths, whichever "auto" picks
        variants.append(("moe_route standalone", {"finalize": "standalone"}))
        variants.append(("moe_route fused", {"finalize": "fused"}))
    for impl, kw in variants:
        entries.append(Entry(
            impl, lambda kw=kw: moe_route.fused_moe(x, w1, w2, tw, ids, backend=ctx.backend, **kw),
            nbytes, flops, memory=True, check=check, tol=_tol(ctx),
        ))  # fmt: skip
    if ctx.cuda:
        entries += _triton_kernels_entries(shape, ctx, nbytes, flops)
    # grouped_mm and moe_route timed in turns (the floors are their ratios)
    rows = ctx.measure_together("forward", shape, entries)
    if TRITON_KERNELS in rows and GPT_OSS in rows and rows[GPT_OSS].median_us > 0:
        rows[GPT_OSS].extra["x_triton_kernels"] = (
            rows[TRITON_KERNELS].median_us / rows[GPT_OSS].median_us
        )


def _triton_kernels_entries(shape: Shape, ctx: Context, nbytes, flops) -> list[Entry]:
    """The :data:`GPT_OSS` and :data:`TRITON_KERNELS` entries (none, with the reason in
    ``ctx.skipped``, where ``triton_kernels`` cannot be imported)."""
    if not B.triton_kernels_available():
        ctx.skip("forward", shape, TRITON_KERNELS, "triton_kernels is not importable (put it "
                 "on PYTHONPATH: bench/README.md)")  # fmt: skip
        return []
    inp = ctx.inputs(shape)
    x, w1, w2, tw, ids = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids
    try:
        peer, _ = B.triton_kernels_experts(w1, w2)
    except ImportError as exc:  # another package of that name, or one of another version
        ctx.skip("forward", shape, TRITON_KERNELS, f"{type(exc).__name__}: {exc}")
        return []
    except Exception as exc:
        ctx.fail("forward", shape, TRITON_KERNELS, exc)
        return []
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    ref = ctx.attempt("forward", shape, TRITON_KERNELS, lambda: B.grouped_mm_forward(
        x, w1t, w2t, tw, ids, activation=B.GPT_OSS_ACTIVATION))  # fmt: skip
    check = None if ref is None else (lambda out: rel_err(out, ref))
    extra = {"activation": B.GPT_OSS_ACTIVATION}

    def ours():
        return moe_route.fused_moe(x, w1, w2, tw, ids, activation=B.GPT_OSS_ACTIVATION,
                                   backend=ctx.backend)  # fmt: skip

    return [
        Entry(GPT_OSS, ours, nbytes, flops, memory=True, check=check, tol=_tol(ctx),
              extra=dict(extra)),
        Entry(TRITON_KERNELS, lambda: peer(x, tw, ids), nbytes, flops, memory=True,
              check=check, tol=_tol(ctx), extra=dict(extra)),
    ]  # fmt: skip

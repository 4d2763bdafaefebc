"""The ``forward`` stage: the whole MoE forward, against the two PyTorch pipelines.

:func:`forward_cost` (bytes and FLOPs of one forward) is also the base of the ``train``
stage's counts.
"""

from __future__ import annotations

import moe_route

from . import baselines as B
from .context import Context, Entry, Inputs, _tol, _weight_bytes, rel_err
from .shapes import Shape


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
    # grouped_mm and moe_route timed in turns (the floors are their ratios)
    ctx.measure_together("forward", shape, entries)

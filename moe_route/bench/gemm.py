"""The ``gemm`` stage: GEMM1 (gathering, SwiGLU fused) and GEMM2 + finalize.

Against ``torch._grouped_mm``; on CUDA also GEMM2 with the finalize fused in its epilogue,
ordered and atomic.
"""

from __future__ import annotations

import torch

import moe_route

from . import baselines as B
from .context import Context, _tol, _weight_bytes, rel_err
from .shapes import Shape


def stage_gemm(shape: Shape, ctx: Context) -> None:
    """GEMM1 (gathering, SwiGLU fused) and GEMM2 + finalize, against ``torch._grouped_mm``."""
    inp = ctx.inputs(shape)
    x, w1, w2, tw, maps = inp.x, inp.w1, inp.w2, inp.topk_weights, inp.maps
    T, H, I, M, es = shape.T, shape.H, shape.I, shape.T * shape.K, x.element_size()  # noqa: E741
    wb = _weight_bytes(shape, inp)
    order, token, offs = inp.grouped_mm_route
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    g1_flops = 4 * M * H * I
    g1_bytes = T * H * es + wb * 2 // 3 + M * I * es
    ref_h = ctx.attempt(
        "gemm1", shape, "grouped_mm", lambda: B.grouped_mm_gemm1(x, w1t, token, offs)
    )
    if ref_h is not None:
        ctx.measure(
            "gemm1", shape, "grouped_mm", lambda: B.grouped_mm_gemm1(x, w1t, token, offs),
            g1_bytes, g1_flops,
        )  # fmt: skip

    def gemm1():
        return moe_route.grouped_gemm(
            x, w1, maps, activation="swiglu", gather=True, backend=ctx.backend
        )

    row = ctx.measure(
        "gemm1", shape, "moe_route", gemm1, g1_bytes, g1_flops,
        check=None if ref_h is None else (lambda h: rel_err(h, ref_h)), tol=_tol(ctx),
    )  # fmt: skip
    if row is not None:
        row.extra["tflops"] = g1_flops / (row.median_us * 1e-6) / 1e12
        row.extra["of_dense"] = g1_flops / (row.median_us * 1e-6) / ctx.ceilings.mm_flops_per_s
    ref_h = None  # free it before GEMM2
    h = ctx.attempt("gemm2+fin", shape, "moe_route", gemm1)
    if h is None:
        return

    g2_flops = 2 * M * H * I
    g2_bytes = M * I * es + wb // 3 + T * H * es
    ref = ctx.attempt(
        "gemm2+fin", shape, "grouped_mm",
        lambda: B.grouped_mm_gemm2_finalize(h, w2t, tw, order, token, offs, T),
    )  # fmt: skip
    if ref is not None:
        ctx.measure(
            "gemm2+fin", shape, "grouped_mm",
            lambda: B.grouped_mm_gemm2_finalize(h, w2t, tw, order, token, offs, T),
            g2_bytes, g2_flops,
        )  # fmt: skip
    check = None if ref is None else (lambda out: rel_err(out, ref))

    def standalone():
        y = moe_route.grouped_gemm(h, w2, maps, backend=ctx.backend)
        return moe_route.finalize_moe_routing(y, tw, maps, backend=ctx.backend)

    ctx.measure(
        "gemm2+fin", shape, "moe_route", standalone, g2_bytes, g2_flops, check=check, tol=_tol(ctx)
    )
    if not ctx.cuda:
        return
    # The epilogue-fused finalize, ordered (deterministic, the default) and atomic: the launch
    # fused_moe makes, with the tiles its plan takes for GEMM2 at this token bucket.
    from .. import arch, tuning
    from ..kernels.triton.gemm_finalize import grouped_gemm_finalize_triton

    rows_per_expert = tuning.token_bucket(T) * shape.K / shape.E
    cfg = tuning.gemm_config(rows_per_expert, False, h.dtype, arch.compute_capability(h.device))
    s2d, d2s, efs, expert_offsets = maps.tensors()

    def fused(ordered):
        if ordered:
            out = h.new_empty(T, H)
        else:  # float32 accumulator, as fused_moe's atomic path
            out = torch.zeros(T, H, dtype=torch.float32, device=h.device)
        grouped_gemm_finalize_triton(h, w2, expert_offsets, s2d, d2s, efs, tw, out, cfg,
                                     ordered=ordered)  # fmt: skip
        return out if ordered else out.to(h.dtype)

    for impl, ordered in (("moe_route fused", True), ("moe_route fused atomic", False)):
        ctx.measure(
            "gemm2+fin", shape, impl, lambda o=ordered: fused(o), g2_bytes, g2_flops,
            check=check, tol=_tol(ctx),
        )  # fmt: skip

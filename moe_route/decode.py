"""The decode path of the experts step: small eager inference calls without routing maps,
GEMM1 + activation per slot and GEMM2 + the finalize's ordered sum per token, two launches
(:mod:`moe_route.kernels.triton.decode`): whether a call takes it (:func:`decode_planned`),
and its custom op (``torch.ops.moe_route.moe_decode``) for tensors the prepared launch
cannot take as they are. ``fused_moe``'s and the layer's call memos keep the prepared
:class:`~moe_route.kernels.triton.decode.DecodeLaunch` of their signature."""

from __future__ import annotations

import torch

from . import tuning
from ._dispatch import Op
from .kernels.triton.decode import MAX_SLOTS, moe_decode_triton
from .plan import MoEPlan, epilogue_for


def decode_planned(plan: MoEPlan, gradient: bool) -> bool:
    """Whether a call takes the decode path, CUDA-graph capture aside (the caller asks that per
    call: ``fused_moe``'s memo, the layer's): a decode plan, eager inference (``gradient``:
    whether the call records a graph, :func:`moe_route._dispatch.wants_grad`).

    The decode path saves host time but in general not device time, so CUDA-graph capture
    and torch.compile keep the sorted path (docs/decisions.md, "Decode path threshold"),
    except under capture where the plan's tiles say the path is faster on the device too
    (:attr:`~moe_route.kernels.triton.decode.DecodeConfig.graphs`).
    """
    return not (plan.decode is None or gradient or torch.compiler.is_compiling())


def _moe_decode_impl(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    want_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, counts)`` on the decode path (Triton; no maps, no gradient): ``fused_moe``'s
    output, and with ``want_counts`` the routed slots per expert (``[E] int64``, else empty),
    which :class:`moe_route.MoELayer` returns as ``tokens_per_expert``. The op's
    implementation; eager calls on plain tensors run their prepared
    :class:`~moe_route.kernels.triton.decode.DecodeLaunch` without it."""
    E, K = w1.shape[0], topk_ids.shape[1]
    if want_counts and x.shape[0] * K > MAX_SLOTS:
        raise ValueError(
            f"moe_decode counts at most {MAX_SLOTS} slots per call, got T*K = "
            f"{x.shape[0]}*{K}: take the sorted path (fused_moe) at this size"
        )
    cfg = tuning.decode_tiles(x.dtype, tuning.expert_bytes(w1.shape, w2.shape, x.element_size()))
    counts = topk_ids.new_empty(E if want_counts else 0, dtype=torch.int64)
    out = moe_decode_triton(x, w1, w2, topk_weights, topk_ids, b1, b2, bias,
                            epilogue_for(activation, gate_up_layout), cfg,
                            counts if want_counts else None)  # fmt: skip
    return out, counts


def _decode_fake(x, w1, w2, topk_weights, topk_ids, *rest):
    want_counts = rest[-1]
    return x.new_empty(x.shape), topk_ids.new_empty(w1.shape[0] if want_counts else 0,
                                                    dtype=torch.int64)  # fmt: skip


DECODE = Op("moe_decode", _moe_decode_impl, _decode_fake)

"""The experts forward that :func:`~.registration.register` installs in transformers.

:func:`moe_route_experts_forward` runs one experts module as one :func:`moe_route.fused_moe`
call from its plan (:mod:`.plan`) and operands (16/32-bit, or quantised: :mod:`.quantized`);
a module moe_route cannot run falls back to transformers' own implementation after a
:class:`MoeRouteFallbackWarning` (or raises, with ``fallback="error"``).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ...moe import fused_moe
from .plan import ExpertsPlan, Unsupported, _operands, plan_for
from .quantized import _quant_operands, is_quantized_experts


class MoeRouteFallbackWarning(UserWarning):
    """An experts module that moe_route cannot run exactly ran on another implementation."""


def _resolve(module: nn.Module, plan: ExpertsPlan):
    """``(w1, w2, b1, b2, quant kwargs)`` of any experts module (empty kwargs: 16/32-bit)."""
    if is_quantized_experts(module):
        return _quant_operands(module, plan)
    return (*_operands(module, plan), {})


def _activation_dtype(hidden_states: torch.Tensor, w1: torch.Tensor, quant: dict) -> torch.dtype:
    """The dtype the experts take their tokens in: the weights' (16/32-bit experts; autocast may
    hand float32 activations to bf16 experts), the tokens' own for FP8 (bf16 / fp16 / fp32),
    bf16 for MXFP4 tokens of another dtype on CUDA (its GEMMs take 16-bit tokens)."""
    spec = quant.get("quant")
    if spec is None:
        return w1.dtype
    dt = hidden_states.dtype
    if dt in (torch.bfloat16, torch.float16):
        return dt
    if dt == torch.float32 and (spec.fp8 or not hidden_states.is_cuda):
        return dt
    return torch.bfloat16


def _fallback_table(module: nn.Module):
    """transformers' experts functions for ``module``'s kind (FP8 modules have their own)."""
    if is_quantized_experts(module):
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        return ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS


# --------------------------------------------------------------------------- the forward
def _fallback_forward(module, hidden_states, top_k_index, top_k_weights, fallback, reason):
    cls = type(module).__name__
    if fallback == "error":
        raise NotImplementedError(f"moe_route cannot run {cls}: {reason}")
    warnings.warn(
        f"moe_route cannot run {cls} ({reason}); running transformers' {fallback!r} experts "
        "implementation for it instead (moe_route.integrations.hf.register(fallback='error') "
        "raises here)",
        MoeRouteFallbackWarning,
        stacklevel=3,
    )
    if fallback == "eager":
        # use_experts_implementation wraps the class's own forward with functools.wraps.
        eager = type(module).forward.__wrapped__
        return eager(module, hidden_states, top_k_index, top_k_weights)
    table = _fallback_table(module)
    return table[fallback](module, hidden_states, top_k_index, top_k_weights)


def moe_route_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    fallback: str = "grouped_mm",
    **fused_moe_options,
) -> torch.Tensor:
    """The experts forward that :func:`register` installs (see the module docstring).

    Args:
        module: an experts module of transformers (``@use_experts_implementation``).
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, K]`` expert ids (ids ``>= E`` are slots of other EP ranks).
        top_k_weights: ``[T, K]`` router weights.
        fallback: what runs a module moe_route cannot: ``"grouped_mm"``, ``"batched_mm"``,
            ``"eager"`` (after a :class:`MoeRouteFallbackWarning`), or ``"error"``.
        **fused_moe_options: passed to :func:`moe_route.fused_moe` (``backend``, ...).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    try:
        plan = plan_for(module)
        operands = _resolve(module, plan)
    except Unsupported as exc:
        return _fallback_forward(
            module, hidden_states, top_k_index, top_k_weights, fallback, str(exc)
        )
    return _run(
        module, plan, operands, hidden_states, top_k_index, top_k_weights, fused_moe_options
    )


def _run(module, plan, operands, hidden_states, top_k_index, top_k_weights, options):
    """The one :func:`moe_route.fused_moe` call that runs ``module`` (``operands``: what
    :func:`_resolve` gives for ``plan``): the forward's, and what :func:`~.warmup.warmup`
    launches, so that both build the same arguments."""
    w1, w2, b1, b2, quant = operands
    ids = top_k_index
    if getattr(module, "_is_expert_parallel", False):
        ids = torch.where(ids >= w1.shape[0], -1, ids)  # another rank's slot: dropped here
    out = fused_moe(
        hidden_states.to(_activation_dtype(hidden_states, w1, quant)),
        w1,
        w2,
        top_k_weights,
        ids,
        activation=plan.activation,
        gate_up_layout=plan.gate_up_layout,
        b1=b1,
        b2=b2,
        **quant,
        **options,
    )
    return out.to(hidden_states.dtype)

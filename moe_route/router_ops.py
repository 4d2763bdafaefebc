"""The routers' custom ops: the Triton kernels of :mod:`moe_route.routing` as ``torch.library`` ops.

``moe_route::softmax_topk`` and ``moe_route::sigmoid_grouped_topk`` (schema, fake, autograd
through :class:`moe_route._dispatch.Op`), each with its backward op. :mod:`moe_route.routing`
validates and picks the backend, then calls :data:`SOFTMAX_TOPK` / :data:`SIGMOID_GROUPED_TOPK`.
"""

from __future__ import annotations

import torch

from ._dispatch import Op
from .kernels.triton.router_sigmoid import (
    sigmoid_grouped_topk_triton,
    sigmoid_topk_backward_triton,
)
from .kernels.triton.router_softmax import softmax_topk_backward_triton, softmax_topk_triton


def _score_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- router op
def _softmax_topk_impl(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = _router_outputs(logits, k)
    softmax_topk_triton(logits, k, renormalize, weights, ids)
    return weights, ids


def _softmax_topk_fake(logits, k, renormalize):
    return _router_outputs(logits, k)


def _router_outputs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's outputs, uninitialised: ``weights [T, K]`` in the score dtype, ``ids`` int32."""
    T = logits.shape[0]
    return (
        logits.new_empty(T, k, dtype=_score_dtype(logits)),
        logits.new_empty(T, k, dtype=torch.int32),
    )


def _softmax_topk_backward_impl(
    grad: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    renormalize: bool,
) -> torch.Tensor:
    dlogits = _softmax_topk_backward_fake(grad, weights, ids, logits, renormalize)
    softmax_topk_backward_triton(grad, weights, ids, logits, renormalize, dlogits)
    return dlogits


def _softmax_topk_backward_fake(grad, weights, ids, logits, renormalize):
    return logits.new_empty(logits.shape)


_SOFTMAX_TOPK_BACKWARD = Op(
    "softmax_topk_backward", _softmax_topk_backward_impl, _softmax_topk_backward_fake
)


def _setup_context(ctx, inputs, output):
    logits, _, renormalize = inputs
    ctx.save_for_backward(logits, *output)
    ctx.renormalize = renormalize


def _backward(ctx, grad_weights, _grad_ids):
    logits, weights, ids = ctx.saved_tensors
    dlogits = _SOFTMAX_TOPK_BACKWARD(grad_weights, weights, ids, logits, ctx.renormalize)
    return dlogits, None, None


#: ``moe_route::softmax_topk(logits, k, renormalize) -> (weights, ids)``, the Triton kernel.
SOFTMAX_TOPK = Op(
    "softmax_topk", _softmax_topk_impl, _softmax_topk_fake, setup_context=_setup_context,
    backward=_backward,
)  # fmt: skip


# --------------------------------------------------------------------------- grouped sigmoid op
def _sigmoid_grouped_impl(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = _router_outputs(logits, k)
    sigmoid_grouped_topk_triton(logits, expert_bias, k, n_group, topk_group, renormalize,
                                routed_scaling_factor, weights, ids)  # fmt: skip
    return weights, ids


def _sigmoid_grouped_fake(logits, expert_bias, k, *_):
    return _router_outputs(logits, k)


def _sigmoid_grouped_backward_impl(
    grad: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    renormalize: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:
    dlogits = logits.new_empty(logits.shape)
    sigmoid_topk_backward_triton(grad, ids, logits, renormalize, routed_scaling_factor, dlogits)
    return dlogits


def _sigmoid_grouped_backward_fake(grad, ids, logits, *_):
    return logits.new_empty(logits.shape)


_SIGMOID_GROUPED_BACKWARD = Op(
    "sigmoid_grouped_topk_backward", _sigmoid_grouped_backward_impl,
    _sigmoid_grouped_backward_fake,
)  # fmt: skip


def _sigmoid_setup_context(ctx, inputs, output):
    logits, _, _, _, _, renormalize, scale = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.config = (renormalize, scale)


def _sigmoid_backward(ctx, grad_weights, _grad_ids):
    logits, ids = ctx.saved_tensors
    dlogits = _SIGMOID_GROUPED_BACKWARD(grad_weights, ids, logits, *ctx.config)
    return dlogits, None, None, None, None, None, None


#: ``moe_route::sigmoid_grouped_topk(logits, expert_bias, k, n_group, topk_group, renormalize,
#: routed_scaling_factor) -> (weights, ids)``, the Triton kernel (``expert_bias`` gets no
#: gradient: pass it detached).
SIGMOID_GROUPED_TOPK = Op(
    "sigmoid_grouped_topk", _sigmoid_grouped_impl, _sigmoid_grouped_fake,
    setup_context=_sigmoid_setup_context, backward=_sigmoid_backward,
)  # fmt: skip

"""The finalize in the torch backend (the weighted sum over each token's slots, ``k``
ascending) and its backward."""

from __future__ import annotations

import torch

from .common import _as, _compute_dtype, _sum_slots


# --------------------------------------------------------------------------- finalize
def _finalize_rows(rows, weights, routed, K, T):
    """``Σ_k weights[k, t] · rows[k*T + t]`` in ascending ``k``; with ``routed`` given, a
    dropped slot's term is zero whatever its row or weight holds (NaN included)."""
    terms = rows.view(K, T, rows.shape[1]) * weights.unsqueeze(-1)
    if routed is not None:
        terms = torch.where(routed.unsqueeze(-1), terms, 0)
    return _sum_slots(terms, K)


def finalize_torch(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_route.reference.finalize_moe_routing_reference`: ``out[t] = bias[t] +
    Σ_k w[t,k] · y_perm[dest(k*T+t)]`` over routed slots, ``k`` ascending, rounded once."""
    T, K = topk_weights.shape
    cdt = _compute_dtype(y_perm, topk_weights)
    if T == 0:
        return y_perm.new_empty(0, y_perm.shape[1])
    rows = _as(y_perm.index_select(0, src_to_dest), cdt)  # k-major: row k*T + t
    routed = expert_for_src.view(K, T) >= 0
    if y_perm.device.type == "cpu" and bool(routed.all()):  # a host read: CPU tensors only
        routed = None
    acc = _finalize_rows(rows, _as(topk_weights.t(), cdt), routed, K, T)
    if bias is not None:
        acc += _as(bias, cdt)
    return _as(acc, y_perm.dtype)


def finalize_backward_torch(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    *,
    need_dy: bool = True,
    need_dw: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d y_perm, d topk_weights)`` of :func:`finalize_torch` (``None`` where not asked):
    ``dy[dest(k*T+t)] = w[t,k] dout[t]``, ``dw[t,k] = <dout[t], y_perm[dest]>`` for routed
    slots, zero for dropped ones (whatever their weight or row hold)."""
    T, K = topk_weights.shape
    cdt = _compute_dtype(dout, y_perm, topk_weights)
    g = _as(dout, cdt)
    routed = expert_for_src.view(K, T) >= 0
    dy = dw = None
    if need_dy:
        w = torch.where(routed, _as(topk_weights.t(), cdt), 0)
        rows = _as((w.unsqueeze(-1) * g).reshape(K * T, g.shape[1]), y_perm.dtype)  # k-major
        dy = torch.empty(y_perm.shape, dtype=y_perm.dtype, device=y_perm.device)
        dy.index_copy_(0, src_to_dest.long(), rows)
    if need_dw:
        rows = _as(y_perm.index_select(0, src_to_dest), cdt).view(K, T, y_perm.shape[1])
        dots = (rows * g).sum(-1)
        dw = _as(torch.where(routed, dots, 0).t().contiguous(), topk_weights.dtype)
    return dy, dw

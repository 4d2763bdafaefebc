"""Reference of the stages that move rows between token order and expert order: the routing
maps (the permutation tables of the data contract), expand, and finalize with its backward."""

from __future__ import annotations

import torch

from ._dtype import _compute_dtype


# --------------------------------------------------------------------------- routing maps
def routing_maps_reference(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four routing tables of the data contract, by a stable sort of unique keys.

    Returns:
        ``expanded_source_row_to_expanded_dest_row [T*K] int32``,
        ``expanded_dest_row_to_expanded_source_row [T*K] int32``,
        ``expert_for_source_row [T*K] int32`` (``-1`` for dropped slots),
        ``expert_first_token_offset [E+1] int64``.
    """
    T, K = topk_ids.shape
    N = T * K
    device = topk_ids.device
    ids = topk_ids.to(torch.int64)
    t = torch.arange(T, device=device).unsqueeze(1).expand(T, K)
    k = torch.arange(K, device=device).unsqueeze(0).expand(T, K)
    token_major = t * K + k  # order inside one expert: token, then slot
    source = k * T + t  # expanded source row s = k*T + t
    dropped = (ids < 0) | (ids >= num_experts)  # unchecked out-of-range ids count as dropped
    # Routed rows sort by (expert, token, slot); dropped rows after all of them by source row.
    key = torch.where(dropped, num_experts * N + source, ids * N + token_major)
    dest_to_token_major = torch.argsort(key.reshape(-1))  # keys are unique: the order is total
    dest_to_src = source.reshape(-1)[dest_to_token_major]
    src_to_dest = torch.empty_like(dest_to_src)
    src_to_dest[dest_to_src] = torch.arange(N, device=device)
    expert_for_source_row = torch.where(dropped, -1, ids).t().reshape(-1)  # k-major, as s
    counts = torch.bincount(ids[~dropped].reshape(-1), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return (
        src_to_dest.to(torch.int32),
        dest_to_src.to(torch.int32),
        expert_for_source_row.to(torch.int32),
        offsets,
    )


# --------------------------------------------------------------------------- expand
def expand_rows_reference(
    x: torch.Tensor,
    expanded_dest_row_to_expanded_source_row: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
) -> torch.Tensor:
    """``x_perm[d] = x[dest_to_src[d] mod T]`` for routed rows; dropped rows are zero."""
    T = x.shape[0]
    dest_to_src = expanded_dest_row_to_expanded_source_row.to(torch.int64)
    N = dest_to_src.numel()
    x_perm = x[dest_to_src % T] if T > 0 else x.new_zeros(N, x.shape[1])
    routed = torch.arange(N, device=x.device) < expert_first_token_offset[-1]
    return x_perm.masked_fill(~routed.unsqueeze(1), 0)


# --------------------------------------------------------------------------- finalize
def finalize_moe_routing_reference(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    expanded_source_row_to_expanded_dest_row: torch.Tensor,
    expert_for_source_row: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = bias[t] + Σ_k w[t,k] · y_perm[dest(k*T+t)]`` over routed slots, k ascending.

    Accumulates in float32 (float64 for float64 inputs) and rounds once to ``y_perm.dtype``.
    A dropped slot contributes nothing, whatever its weight or row hold (NaN included).
    """
    T, K = topk_weights.shape
    cdt = _compute_dtype(y_perm, topk_weights)
    H = y_perm.shape[1]
    acc = torch.zeros(T, H, dtype=cdt, device=y_perm.device)
    dest = expanded_source_row_to_expanded_dest_row.to(torch.int64).view(K, T)
    routed = (expert_for_source_row >= 0).view(K, T)
    zero = torch.zeros((), dtype=cdt, device=y_perm.device)
    for k in range(K):
        term = topk_weights[:, k].to(cdt).unsqueeze(1) * y_perm[dest[k]].to(cdt)
        acc = acc + torch.where(routed[k].unsqueeze(1), term, zero)
    if bias is not None:
        acc = acc + bias.to(cdt)
    return acc.to(y_perm.dtype)


def finalize_moe_routing_backward_reference(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    expanded_source_row_to_expanded_dest_row: torch.Tensor,
    expert_for_source_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`finalize_moe_routing_reference` w.r.t. ``y_perm`` and the weights.

    ``d y_perm[dest(k*T+t)] = w[t,k] dout[t]`` and ``d w[t,k] = <dout[t], y_perm[dest]>`` for
    routed slots; zero for dropped slots (whatever their weight or row hold).
    """
    T, K = topk_weights.shape
    cdt = _compute_dtype(dout, y_perm, topk_weights)
    dest = expanded_source_row_to_expanded_dest_row.to(torch.int64).view(K, T)
    routed = (expert_for_source_row >= 0).view(K, T)
    g = dout.to(cdt)
    dy = torch.zeros(y_perm.shape, dtype=cdt, device=y_perm.device)
    dw = torch.zeros(T, K, dtype=cdt, device=y_perm.device)
    for k in range(K):
        w = torch.where(routed[k], topk_weights[:, k].to(cdt), 0)
        dy[dest[k]] = w.unsqueeze(1) * g
        dot = (g * y_perm[dest[k]].to(cdt)).sum(1)
        dw[:, k] = torch.where(routed[k], dot, 0)
    return dy.to(y_perm.dtype), dw.to(topk_weights.dtype)

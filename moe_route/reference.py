"""Pure-PyTorch reference for every stage of the MoE token path.

This module *defines* the semantics of ``DESIGN.md``; every backend is tested against it, the
benchmarks use it as their oracle, and it is the CPU fallback. It favours clarity over speed:
loops over experts are fine here, kernels elsewhere must not have them.

Arithmetic is float32, or float64 when the inputs are float64 (for ``gradcheck``); results are
returned in the dtype of the activations, rounded once.

Index conventions (the data contract):

* ``T`` tokens, ``K`` slots per token, ``E`` experts; expanded source row ``s = k*T + t``.
* Permuted (dest) order: experts ascending, then token ascending, then slot ``k`` ascending;
  dropped slots (``topk_ids == -1``) after every routed row, in source-row order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "geglu", "silu", "gelu", "relu", "identity")
GATED_ACTIVATIONS = ("swiglu", "geglu")
GATE_UP_LAYOUTS = ("concat", "interleaved")


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )


# --------------------------------------------------------------------------- router
def topk_routing_reference(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Mixtral renormalises, Qwen3-MoE does by option).

    Args:
        router_logits: ``[T, E]`` float.
        top_k: ``K``, experts per token.
        renormalize: divide the K selected probabilities by their sum.

    Returns:
        ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``; ids of a token in descending
        probability order (ties: lower expert id first, as ``torch.topk``).
    """
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


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
    return torch.where(routed.unsqueeze(1), x_perm, torch.zeros((), dtype=x.dtype))


# --------------------------------------------------------------------------- activations
def split_gate_up(
    z: torch.Tensor, gate_up_layout: str = "concat"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split GEMM1's ``[M, 2I]`` output into gate and up (``"concat"`` or ``"interleaved"``)."""
    if gate_up_layout == "concat":
        gate, up = z.chunk(2, dim=-1)
    elif gate_up_layout == "interleaved":
        gate, up = z[..., 0::2], z[..., 1::2]
    else:
        raise ValueError(f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}")
    return gate, up


def activation_reference(z: torch.Tensor, activation: str, gate_up_layout: str = "concat"):
    """Apply one activation of DESIGN.md to GEMM1's pre-activation ``z``.

    Gated activations take ``[M, 2I]`` and return ``[M, I]``: ``swiglu = silu(g) * u``,
    ``geglu = gelu(g) * u`` (exact, erf-based gelu everywhere in this library).
    """
    if activation in GATED_ACTIVATIONS:
        gate, up = split_gate_up(z, gate_up_layout)
        act = F.silu if activation == "swiglu" else F.gelu
        return act(gate) * up
    if activation == "silu":
        return F.silu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "relu":
        return F.relu(z)
    if activation == "identity":
        return z
    raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")


# --------------------------------------------------------------------------- grouped GEMM
def grouped_gemm_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "identity",
    gate_up_layout: str = "concat",
) -> torch.Tensor:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for the rows ``d`` of each expert ``e``.

    Args:
        a: ``[M, Kdim]`` permuted rows (``M >= offset[E]``; rows past it are left zero).
        w: ``[E, N, Kdim]`` any strided view.
        expert_first_token_offset: ``[E+1]`` int64.
        bias: optional ``[E, N]``.
    """
    cdt = _compute_dtype(a, w)
    offsets = expert_first_token_offset.tolist()  # the oracle may sync; kernels must not
    n_out = w.shape[1] // 2 if activation in GATED_ACTIVATIONS else w.shape[1]
    out = torch.zeros(a.shape[0], n_out, dtype=cdt, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        z = a[lo:hi].to(cdt) @ w[e].to(cdt).t()
        if bias is not None:
            z = z + bias[e].to(cdt)
        out[lo:hi] = activation_reference(z, activation, gate_up_layout)
    return out.to(a.dtype)


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


# --------------------------------------------------------------------------- whole chain
def moe_forward_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole MoE forward of DESIGN.md: maps → expand → GEMM1+act → GEMM2 → finalize.

    Args:
        x: ``[T, H]``; w1: ``[E, 2I or I, H]``; w2: ``[E, H, I]``;
        topk_weights: ``[T, K]``; topk_ids: ``[T, K]`` (``-1`` = dropped).
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    cdt = _compute_dtype(x, w1, w2)  # no intermediate rounding: the chain runs in cdt
    src_to_dest, dest_to_src, expert_for_src, offsets = routing_maps_reference(
        topk_ids, w1.shape[0]
    )
    x_perm = expand_rows_reference(x.to(cdt), dest_to_src, offsets)
    h = grouped_gemm_reference(
        x_perm, w1, offsets, b1, activation=activation, gate_up_layout=gate_up_layout
    )
    y = grouped_gemm_reference(h, w2, offsets, b2)
    out = finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
    return out.to(x.dtype)

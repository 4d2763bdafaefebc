"""Reference of the whole MoE layer: the forward chain of DESIGN.md stage after stage, and
its explicit gradients from the saved pre-activation."""

from __future__ import annotations

import torch

from ._dtype import _compute_dtype
from .experts import activation_backward_reference, activation_reference, grouped_gemm_reference
from .maps import expand_rows_reference, finalize_moe_routing_reference, routing_maps_reference


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


def moe_backward_reference(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    z: torch.Tensor,
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    b2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Explicit gradients of :func:`moe_forward_reference` (without ``bias``) given ``dout``.

    Uses the saved pre-activation ``z [T*K, 2I or I]`` (GEMM1's output before the activation,
    in permuted order) instead of GEMM2's output: for the slot ``(t, k)`` in row ``d`` of
    expert ``e``, with ``g[d] = dout[t] @ W2[e]`` and ``h = act(z)``,

    * ``d w[t,k] = <dout[t], y[d]> = <g[d], h[d]> + <dout[t], b2[e]>``,
    * ``dh[d] = w[t,k] g[d]``, ``dz = act'(z) dh``, ``dx_perm[d] = dz[d] @ W1[e]``,
      ``dx[t] = Σ_k dx_perm[dest(k*T+t)]`` (k ascending),
    * ``dW2[e] = Σ_d (w dout[t])^T h[d]``, ``db2[e] = Σ_d w dout[t]``,
      ``dW1[e] = Σ_d dz[d]^T x[t]``, ``db1[e] = Σ_d dz[d]``.

    Args:
        maps: ``(src_to_dest, dest_to_src, expert_for_src, offsets)``.

    Returns:
        ``(dx, dw1, dw2, d_topk_weights, db1, db2)`` in the dtypes of their primals; ``dW`` of an
        expert with no rows is exactly zero.
    """
    cdt = _compute_dtype(dout, x, w1, w2, z)
    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    T, K = topk_weights.shape
    d2s = dest_to_src.to(torch.int64)
    tok = d2s % T if T else d2s
    slot = d2s // T if T else d2s
    dout_c, x_c, z_c = dout.to(cdt), x.to(cdt), z.to(cdt)
    wts = topk_weights.to(cdt)
    M = d2s.numel()
    dx_perm = torch.zeros(M, x.shape[1], dtype=cdt, device=x.device)
    dy_dot = torch.zeros(M, dtype=cdt, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=cdt, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=cdt, device=x.device)
    db1 = torch.zeros(w1.shape[:2], dtype=cdt, device=x.device)
    db2 = torch.zeros(w2.shape[:2], dtype=cdt, device=x.device)
    bounds = offsets.tolist()  # the oracle may sync; kernels must not
    for e in range(w1.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        rows_t = tok[lo:hi]
        w_row = wts[rows_t, slot[lo:hi]].unsqueeze(1)
        h_e = activation_reference(z_c[lo:hi], activation, gate_up_layout)
        g_e = dout_c[rows_t] @ w2[e].to(cdt)
        dz_e = activation_backward_reference(z_c[lo:hi], w_row * g_e, activation, gate_up_layout)
        dy_dot[lo:hi] = (g_e * h_e).sum(1)
        if b2 is not None:
            dy_dot[lo:hi] += dout_c[rows_t] @ b2[e].to(cdt)
        dx_perm[lo:hi] = dz_e @ w1[e].to(cdt)
        dy_e = w_row * dout_c[rows_t]
        dw2[e] = dy_e.t() @ h_e
        db2[e] = dy_e.sum(0)
        dw1[e] = dz_e.t() @ x_c[rows_t]
        db1[e] = dz_e.sum(0)
    routed = (expert_for_src >= 0).view(K, T)
    dest = src_to_dest.to(torch.int64).view(K, T)
    dx = torch.zeros(T, x.shape[1], dtype=cdt, device=x.device)
    d_topk = torch.zeros(T, K, dtype=cdt, device=x.device)
    for k in range(K):
        dx = dx + torch.where(routed[k].unsqueeze(1), dx_perm[dest[k]], 0)
        d_topk[:, k] = torch.where(routed[k], dy_dot[dest[k]], 0)
    db2_dtype = b2.dtype if b2 is not None else w2.dtype
    return (
        dx.to(x.dtype),
        dw1.to(w1.dtype),
        dw2.to(w2.dtype),
        d_topk.to(topk_weights.dtype),
        db1.to(w1.dtype),
        db2.to(db2_dtype),
    )

"""The MoE chain in the torch backend: the forward (GEMM1 + activation, GEMM2, finalize) and its
backward, and the forward on quantised experts."""

from __future__ import annotations

import torch

from .common import (
    _activation,
    _as,
    _compute_dtype,
    _segment_mm,
    _segment_outer,
    _segment_sum,
    _Segments,
    _sum_slots,
    _with_zero_tail,
)
from .finalize import _finalize_rows
from .grouped_gemm import _gathered_rows


# --------------------------------------------------------------------------- whole chain
def moe_forward_torch(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    *,
    keep_z: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MoE forward that also returns GEMM1's pre-activation: ``(out [T, H], z [M, N1])``
    in ``x.dtype``, as the reference branch of ``moe_route::moe_experts``: ``z`` is rounded
    to ``x.dtype`` (it is what the backward gets) and ``h = act(z)`` is computed from it;
    GEMM2's rows stay in the compute dtype until the finalize sum is rounded once. Rows of
    ``z`` past the routed ones are zero. ``keep_z=False`` (inference) returns ``(out, None)``
    and skips building ``z``."""
    T = topk_weights.shape[0]
    M = dest_to_src.numel()
    cdt = _compute_dtype(x, w1, w2)
    seg = _Segments(offsets)
    n = seg.n
    z = _segment_mm(_gathered_rows(x, dest_to_src, n, cdt), w1, seg, b1)
    z_out = _with_zero_tail(z, M, x.dtype) if keep_z else None
    if x.dtype != cdt:  # the activation reads the rounded z, as the backward will
        z = z.to(x.dtype).to(cdt)
    y = _segment_mm(_activation(z, activation, gate_up_layout), w2, seg, b2)
    if T == 0:
        return x.new_empty(0, w2.shape[1]), z_out
    acc = _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M, cdt)
    return _as(acc, x.dtype), z_out


def _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M: int, cdt):
    """The finalize of the MoE forward in ``cdt``: ``Σ_k w[t,k] · y[dest(k*T+t)] + bias[t]``
    over the routed rows ``y [n, H]`` (``n <= M``; T > 0)."""
    T, K = topk_weights.shape
    weights = _as(topk_weights.t(), cdt)
    if y.shape[0] < M:  # dropped slots read zero rows, and their weights (NaN too) are masked
        y = _with_zero_tail(y, M, cdt)
        weights = torch.where(expert_for_src.view(K, T) >= 0, weights, 0)
    acc = _finalize_rows(y.index_select(0, src_to_dest), weights, None, K, T)
    if bias is not None:
        acc += _as(bias, cdt)
    return acc


def moe_backward_torch(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b2: torch.Tensor | None,
    z: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    *,
    need_dx: bool = True,
    need_dw1: bool = True,
    need_dw2: bool = True,
    need_dtopk: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of :func:`moe_forward_torch` (without ``bias``), the formulas of
    :func:`moe_route.reference.moe_backward_reference` (``z`` is the forward's pre-activation;
    ``b1`` is not needed, ``expert_for_src`` not read: dropped slots read zero rows):
    ``(dx, dw1, dw2, d_topk_weights, db1, db2)`` in the dtypes of their primals, ``dW`` of an
    expert with no rows exactly zero. ``need_dw1`` / ``need_dw2`` cover ``db1`` / ``db2``; a
    gradient not asked for is ``None``."""
    T, K = topk_weights.shape
    H = x.shape[1]
    M = dest_to_src.numel()
    cdt = _compute_dtype(dout, x, w1, w2, z)
    seg = _Segments(offsets)
    n = seg.n
    src = dest_to_src[:n]
    token = src % T if T else src
    w_row = _as(topk_weights.t().reshape(-1), cdt).index_select(0, src).unsqueeze(1)
    z_c = _as(z[:n], cdt)
    g_out = _as(dout, cdt).index_select(0, token)  # dout[t] of each routed row
    h = g = dz = None
    if need_dtopk or need_dw2:
        h = _activation(z_c, activation, gate_up_layout)
    if need_dtopk or need_dx or need_dw1:
        g = _segment_mm(g_out, w2.transpose(1, 2), seg)  # dout[t] @ W2[e]
    if need_dx or need_dw1:
        dz = _activation(z_c, activation, gate_up_layout, w_row * g)

    dx = dw1 = dw2 = dtopk = db1 = db2 = None
    if need_dtopk:
        dots = (g * h).sum(1)
        if b2 is not None:
            dots += (g_out * seg.per_row(_as(b2, cdt))).sum(1)
        dtopk = dots.new_zeros(M)  # source order k*T + t; dropped slots stay zero
        dtopk[src] = dots
        dtopk = _as(dtopk.view(K, T).t().contiguous(), topk_weights.dtype)
    if need_dw2:
        dy = w_row * g_out
        dw2 = _as(_segment_outer(dy, h, seg), w2.dtype)
        db2 = _as(_segment_sum(dy, seg), b2.dtype if b2 is not None else w2.dtype)
    if need_dx:
        dx_perm = _segment_mm(dz, w1.transpose(1, 2), seg)  # dz @ W1[e]
        if T == 0:
            dx = x.new_zeros(x.shape)
        else:
            full = _with_zero_tail(dx_perm, M, cdt)  # dropped slots read its zero rows
            dx = _as(_sum_slots(full.index_select(0, src_to_dest).view(K, T, H), K), x.dtype)
    if need_dw1:
        x_rows = _as(x, cdt).index_select(0, token)
        dw1 = _as(_segment_outer(dz, x_rows, seg), w1.dtype)
        db1 = _as(_segment_sum(dz, seg), w1.dtype)
    return dx, dw1, dw2, dtopk, db1, db2


# --------------------------------------------------------------------------- quantised experts
def moe_forward_quant_torch(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    spec,
) -> torch.Tensor:
    """The MoE forward on quantised experts (:mod:`moe_route.quant`), the contract the Triton
    kernels keep: weights dequantised to float32; on FP8 the tokens quantised per token (per
    128 columns, or per row for ``fp8_channel``) by the reference quantiser and GEMM2's input
    ``act(z)`` quantised per 128 columns from its float32 value; on MXFP4 the activations stay
    16-bit (``act(z)`` rounded to ``x.dtype``, as GEMM2 reads it). Products and the finalize in
    float32, rounded once to ``x.dtype``."""
    from ... import quant
    from ...activations import as_activation

    T = topk_weights.shape[0]
    M = dest_to_src.numel()
    seg = _Segments(offsets)
    n = seg.n
    n1 = w1.shape[1]
    W1 = quant.dequantize_experts(w1, w1_scale, spec, x.shape[1])
    n_inter = n1 // 2 if as_activation(activation).gated else n1
    W2 = quant.dequantize_experts(w2, w2_scale, spec, n_inter)
    if spec.fp8:
        xq, xs = quant.quantize_fp8_rows(x, spec.act_group, ue8m0=spec.ue8m0)
        rows = quant.dequantize_fp8_rows(xq, xs, spec.act_group)
    else:
        rows = x.float()
    z = _segment_mm(_gathered_rows(rows, dest_to_src, n, torch.float32), W1, seg, b1)
    h = _activation(z, activation, gate_up_layout)
    if spec.fp8:
        hq, hs = quant.quantize_fp8_rows(h, quant.SCALE_K, ue8m0=spec.ue8m0)
        h = quant.dequantize_fp8_rows(hq, hs, quant.SCALE_K)
    else:
        h = h.to(x.dtype).float()
    y = _segment_mm(h, W2, seg, b2)
    if T == 0:
        return x.new_empty(0, x.shape[1])
    acc = _weighted_sum(y, topk_weights, src_to_dest, expert_for_src, bias, M, torch.float32)
    return _as(acc, x.dtype)

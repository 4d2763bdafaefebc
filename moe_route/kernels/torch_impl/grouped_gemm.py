"""The grouped GEMM (+ activation) in the torch backend, over the routed rows of each expert,
and its backward."""

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


# --------------------------------------------------------------------------- grouped GEMM
def _gathered_rows(a, dest_to_src, n, cdt):
    """The ``n`` routed rows in the compute dtype: ``a``'s first rows, or with ``dest_to_src``
    the token rows ``a[dest_to_src[d] mod T]``."""
    if dest_to_src is None:
        return _as(a[:n], cdt)
    return _as(a.index_select(0, dest_to_src[:n] % a.shape[0]), cdt)


def grouped_gemm_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "identity",
    gate_up_layout: str = "concat",
    dest_to_src: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_route.reference.grouped_gemm_reference`: ``out[d] = act(a[d] @ w[e].T +
    bias[e])`` for the routed rows of each expert, zero rows after them; with ``dest_to_src``,
    row ``d`` is ``a[dest_to_src[d] mod T]`` (``a`` is ``x [T, Kd]``; no ``x_perm`` is built,
    only the routed rows are gathered). ``[M, N_out]`` in ``a.dtype``."""
    M = dest_to_src.numel() if dest_to_src is not None else a.shape[0]
    seg = _Segments(offsets)
    cdt = _compute_dtype(a, w)
    rows = _gathered_rows(a, dest_to_src, seg.n, cdt)
    h = _activation(_segment_mm(rows, w, seg, bias), activation, gate_up_layout)
    return _with_zero_tail(h, M, a.dtype)


def grouped_gemm_backward_torch(
    dout: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    gather: bool,
    *,
    need_da: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(da, dw, db)`` of :func:`grouped_gemm_torch` given ``dout [M, N_out]`` (``None``
    where not asked), the torch branch of ``moe_route.grouped_gemm``'s backward:
    ``dz = act'(z) dout`` (``z`` recomputed), ``da[d] = dz[d] @ w[e]``, ``dw[e] = Σ dz^T a``,
    ``db[e] = Σ dz``; rows of dropped slots get a zero ``da``, an expert without rows zero
    ``dw``/``db``. With ``gather``, ``a`` is ``x [T, Kd]`` (row ``d`` read
    ``a[dest_to_src[d] mod T]``) and ``da`` is ``[T, Kd]``: the sum over each token's slots in
    ascending ``k`` (``expert_for_src`` is not read: dropped slots read ``da_perm``'s zero
    rows). Dtypes: ``a``'s, ``w``'s, ``w``'s."""
    seg = _Segments(offsets)
    n = seg.n
    cdt = _compute_dtype(dout, a, w)
    rows = _gathered_rows(a, dest_to_src if gather else None, n, cdt)
    dz = _as(dout[:n], cdt)
    if activation != "identity":
        z = _segment_mm(rows, w, seg, bias)
        dz = _activation(z, activation, gate_up_layout, dz)
    da = dw = db = None
    if need_da:
        da_perm = _segment_mm(dz, w.transpose(1, 2), seg)  # dz @ w[e]
        if not gather:
            da = _with_zero_tail(da_perm, a.shape[0], a.dtype)
        elif a.shape[0] == 0:
            da = a.new_zeros(a.shape)
        else:  # the K copies of each token, summed in k order (dropped ones read zero rows)
            T, Kd = a.shape
            K = src_to_dest.numel() // T
            full = _with_zero_tail(da_perm, src_to_dest.numel(), cdt)
            da = _as(_sum_slots(full.index_select(0, src_to_dest).view(K, T, Kd), K), a.dtype)
    if need_dw:
        dw = _as(_segment_outer(dz, rows, seg), w.dtype)
    if need_db:
        db = _as(_segment_sum(dz, seg), w.dtype)
    return da, dw, db

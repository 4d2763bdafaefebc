"""The softmax top-``K`` router in one launch, and its backward in another.

Rows, limits and the exact ``exp`` / division are :mod:`.router`'s.

**Softmax** (:func:`softmax_topk_triton`, ``BLOCK_E = next_pow2(E)`` columns). Selection: ``K``
rounds of "largest remaining logit, ties to the lowest column". The order is that of the logits
themselves, which is the order of the probabilities (softmax is monotone) without depending on
how a device rounds ``exp``: two distinct logits whose float32 probabilities round equal still
rank by logit, and equal logits (``-0.0 == +0.0``) rank by expert id. NaN ranks above ``+inf``
(lowest id first among NaNs), as in ``torch.sort``, so the ids are those of
:func:`moe_route.routing.softmax_topk_torch` bit for bit. A row holding a NaN or ``+inf`` logit,
or only ``-inf``, has a NaN softmax: all its weights are NaN, as torch's.

Weights: ``e = exp(x - max)`` and ``S = Σ e`` per row; a chosen expert's weight is ``e / S``,
or ``e / Σ_chosen e`` when renormalised (the same value as ``(e/S) / Σ_chosen (e/S)`` with
fewer roundings). Divisions round to nearest, ``exp`` is libdevice's (not the ``ex2.approx``
that ``tl.exp`` lowers to), so the weights sit within a few float32 ulps of torch's.

Backward (:func:`_softmax_topk_backward_kernel`), with ``g`` the weights' gradient and
``w`` the weights: renormalised weights are a softmax over the ``K`` chosen logits, so
``dlogits[id_k] = w_k (g_k - Σ_j w_j g_j)`` and zero elsewhere; without renormalisation
``dlogits = p ⊙ (g scattered to the ids - Σ_j w_j g_j)`` with ``p`` the full softmax, recomputed
from the logits by the forward's own code (same bits). One launch, each output element written
once by one program: deterministic.

The selection (:func:`_select_softmax`) is also the fused router's (:mod:`.router_gate`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, ThinKernel, cdiv, int_key, next_pow2
from .router import _acc, _blocks, _div, _exp, _load_rows


@triton.jit
def _row_max_sum(x, ACC: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """``(m, S)``: the largest non-NaN logit and ``Σ exp(x - m)`` per row (NaN when the row
    holds a NaN or ``+inf``, or only ``-inf``: then torch's softmax is NaN too)."""
    m = tl.max(tl.where(x == x, x, float("-inf")), axis=1)
    s = tl.sum(_exp(x - m[:, None], ACCURATE_EXP), axis=1)
    return m, s


@triton.jit(do_not_specialize=["T"])
def _softmax_topk_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    stride_lt,
    stride_le,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ACC: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows, cols, x = _load_rows(logits_ptr, tl.program_id(0), T, E, stride_lt, stride_le, ACC,
                               BLOCK_T, BLOCK_E)  # fmt: skip
    _select_softmax(x, rows, cols, w_ptr, ids_ptr, T, E, K, K_POW2, RENORMALIZE, ACC,
                    ACCURATE_EXP, BLOCK_T, BLOCK_E)  # fmt: skip


@triton.jit
def _select_softmax(x, rows, cols, w_ptr, ids_ptr, T, E, K: tl.constexpr, K_POW2: tl.constexpr,
                    RENORMALIZE: tl.constexpr, ACC: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """The ``K`` largest of the rows' logits ``x`` (padding columns ``-inf``) and their softmax
    weights, stored to ``w_ptr`` / ``ids_ptr`` (``[T, K]``, contiguous)."""
    m, s = _row_max_sum(x, ACC, ACCURATE_EXP)
    # Selection key: the logit, NaN as +inf; among equal keys the lowest rank, where a NaN's
    # rank is its column - BLOCK_E (so NaNs come first, by column) and another's its column.
    is_nan = x != x
    key = tl.where(is_nan, float("inf"), x)
    rank = tl.where(is_nan, cols[None, :] - BLOCK_E, cols[None, :])
    avail = (cols < E)[None, :] & (rows >= 0)[:, None]
    slots = tl.arange(0, K_POW2)[None, :]
    chosen_e = tl.zeros([BLOCK_T, K_POW2], dtype=ACC)
    chosen_id = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    for k in range(K):
        top = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        best = tl.min(tl.where(avail & (key == top[:, None]), rank, BLOCK_E), axis=1)
        avail = avail & (rank != best[:, None])
        # exp of the chosen logit itself (== top unless NaN, and a NaN row's weights are NaN)
        e = _exp(top - m, ACCURATE_EXP)
        chosen_e = tl.where(slots == k, e[:, None], chosen_e)
        chosen_id = tl.where(slots == k, tl.where(best < 0, best + BLOCK_E, best)[:, None],
                             chosen_id)  # fmt: skip
    # slots >= K hold 0
    denom = tl.sum(chosen_e, axis=1) if RENORMALIZE else s
    w = _div(chosen_e, denom[:, None])
    w = tl.where((s != s)[:, None], float("nan"), w)
    out = rows.to(tl.int64)[:, None] * K + slots
    mask = (rows < T)[:, None] & (slots < K)
    tl.store(w_ptr + out, w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, chosen_id, mask=mask)


_FORWARD = ThinKernel(_softmax_topk_kernel)


def softmax_topk_triton(
    logits: torch.Tensor, k: int, renormalize: bool, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    """Route ``logits [T, E]`` (any strides) into ``weights [T, K]`` (float32, float64 for
    float64 logits) and ``ids [T, K]`` int32, both preallocated contiguous."""
    T, E = logits.shape
    if T == 0:
        return
    block_t, block_e, num_warps = _blocks(E)
    st, se = logits.stride()
    acc = _acc(logits.dtype)
    key = (logits.dtype, k, renormalize, block_t, block_e, int_key(E, st, se))  # fmt: skip
    _FORWARD.launch(
        key, (cdiv(T, block_t),), (logits, weights, ids, T, E, st, se),
        lambda: dict(
            K=k, K_POW2=next_pow2(k), RENORMALIZE=renormalize, ACC=acc,
            ACCURATE_EXP=not INTERPRETING, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
        ),
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _softmax_topk_backward_kernel(
    g_ptr,
    w_ptr,
    ids_ptr,
    logits_ptr,
    dl_ptr,
    T,
    E,
    stride_gt,
    stride_gk,
    stride_lt,
    stride_le,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ACC: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    in_row = rows < T
    rows64 = rows.to(tl.int64)
    slots = tl.arange(0, K_POW2)
    slot_mask = in_row[:, None] & (slots < K)[None, :]
    g_tile = tl.load(g_ptr + rows64[:, None] * stride_gt + slots[None, :] * stride_gk,
                     mask=slot_mask, other=0.0).to(ACC)  # fmt: skip
    w_tile = tl.load(w_ptr + rows64[:, None] * K + slots[None, :], mask=slot_mask, other=0.0)
    wg = tl.sum(w_tile.to(ACC) * g_tile, axis=1)  # Σ_j w_j g_j
    # Scatter the K slots' values to their columns; the ids of a row are distinct.
    scattered = tl.zeros([BLOCK_T, BLOCK_E], dtype=ACC)
    for k in range(K):
        g = tl.load(g_ptr + rows64 * stride_gt + k * stride_gk, mask=in_row, other=0.0).to(ACC)
        e = tl.load(ids_ptr + rows64 * K + k, mask=in_row, other=-1)
        if RENORMALIZE:
            w = tl.load(w_ptr + rows64 * K + k, mask=in_row, other=0.0).to(ACC)
            g = w * (g - wg)
        scattered = tl.where(cols[None, :] == e[:, None], g[:, None], scattered)
    if RENORMALIZE:
        dl = scattered
    else:
        _, _, x = _load_rows(logits_ptr, pid, T, E, stride_lt, stride_le, ACC, BLOCK_T, BLOCK_E)
        m, s = _row_max_sum(x, ACC, ACCURATE_EXP)
        p = _div(_exp(x - m[:, None], ACCURATE_EXP), s[:, None])
        dl = p * (scattered - wg[:, None])
    dl = tl.where((wg != wg)[:, None], float("nan"), dl)  # as torch's softmax backward
    out = rows64[:, None] * E + cols[None, :]
    tl.store(dl_ptr + out, dl.to(dl_ptr.dtype.element_ty),
             mask=in_row[:, None] & (cols < E)[None, :])  # fmt: skip


_BACKWARD = ThinKernel(_softmax_topk_backward_kernel)


def softmax_topk_backward_triton(
    grad: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    renormalize: bool,
    dlogits: torch.Tensor,
) -> None:
    """``dlogits [T, E]`` (preallocated contiguous, ``logits``' dtype) from the weights'
    gradient ``grad [T, K]`` (any strides) and the forward's contiguous ``weights`` and ``ids``;
    ``logits`` is read only without renormalisation."""
    T, E = logits.shape
    if T == 0:
        return
    k = weights.shape[1]
    block_t, block_e, num_warps = _blocks(E)
    sgt, sgk = grad.stride()
    st, se = logits.stride()
    acc = _acc(logits.dtype)
    key = (logits.dtype, grad.dtype, k, renormalize, block_t, block_e,
           int_key(E, sgt, sgk, st, se))  # fmt: skip
    _BACKWARD.launch(
        key, (cdiv(T, block_t),), (grad, weights, ids, logits, dlogits, T, E, sgt, sgk, st, se),
        lambda: dict(
            K=k, K_POW2=next_pow2(k), RENORMALIZE=renormalize, ACC=acc,
            ACCURATE_EXP=not INTERPRETING, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
        ),
    )  # fmt: skip

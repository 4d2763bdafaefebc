"""DeepSeek-V3's grouped sigmoid top-``K`` router in one launch, and its backward in another.

Rows, limits and the exact ``exp`` / division are :mod:`.router`'s.

**Grouped sigmoid** (:func:`sigmoid_grouped_topk_triton`, the kernel of
:func:`moe_route.routing.sigmoid_grouped_topk`). The row is held as a
``[NG_POW2, G_POW2]`` tile, group ``g``'s expert ``j`` (expert ``g*G + j``) at ``[g, j]``, so
that a group is one axis of the tile. Scores ``s = 1 / (1 + exp(-x))`` as torch computes them
(libdevice ``exp``, a division rounded to nearest: the same bits as torch's CUDA sigmoid, so
the choice scores ``c = s + bias`` and the group sums are torch's too and the ids can be
exact); the selection then follows :func:`moe_route.routing.sigmoid_grouped_topk_torch` step
for step, in the order of ``torch.sort`` / ``torch.topk``: NaN above ``+inf`` and ties to the
lower index, for groups as for experts:

1. a group's score is the sum of its two largest choice scores (its largest when ``G = 1``),
   NaN when it holds a NaN;
2. ``TOPK_GROUP`` rounds of "best remaining group" keep groups; the other groups' choice scores
   become ``-inf`` (and still compete, as torch's ``masked_fill`` leaves them);
3. ``K`` rounds of "best remaining expert" choose the ids;
4. the weights are the chosen experts' ``s`` (gathered again from the logits: the same bits),
   divided by ``Σ s + 1e-20`` when renormalised, times ``SCALE`` (``routed_scaling_factor``,
   a constexpr: one variant per factor, a layer has one).

Without a group limit (``topk_group == n_group``) the launcher lays the row out as one group,
so the tile is the softmax kernel's ``next_pow2(E)`` columns; with one, the padded tile is at
most ``2 * next_pow2(E)`` wide.

Its backward (:func:`_sigmoid_topk_backward_kernel`) is the autograd of the torch path: with
``u_k = s[id_k]``, ``D = Σ u + 1e-20`` and ``γ = SCALE * g``, ``du_k = (γ_k - Σ_j γ_j u_j / D) / D``
when renormalised (``γ_k`` otherwise), scattered to the ids, times ``(1 - s) * s`` (torch's
sigmoid backward: NaN where ``s`` is NaN, even off the chosen ids). The expert bias gets no
gradient (the torch path detaches it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, ThinKernel, cdiv, int_key, next_pow2
from .router import MAX_BLOCK_T, TILE, _acc, _blocks, _div, _exp, _load_rows


def _grouped_blocks(n_group: int, group_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, NG_POW2, G_POW2, num_warps)`` for ``n_group`` groups of ``group_size``
    experts (never from ``T``: no compile per token count)."""
    ng_pow2, g_pow2 = next_pow2(n_group), next_pow2(group_size)
    width = ng_pow2 * g_pow2
    block_t = max(1, min(MAX_BLOCK_T, TILE // width))
    num_warps = max(4, min(16, block_t * width // 512))
    return block_t, ng_pow2, g_pow2, num_warps


@triton.jit
def _sigmoid(x, ACCURATE_EXP: tl.constexpr):
    # torch's sigmoid (CPU and CUDA): 1 / (1 + exp(-x)), the division rounded to nearest
    d = 1.0 + _exp(-x, ACCURATE_EXP)
    return _div(tl.full(d.shape, 1.0, d.dtype), d)


@triton.jit(do_not_specialize=["T"])
def _sigmoid_grouped_topk_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    T,
    NG,
    G,
    stride_lt,
    stride_le,
    stride_b,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    ACC: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NG_POW2: tl.constexpr,
    G_POW2: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows64 = rows.to(tl.int64)
    in_row = rows < T
    gi = tl.arange(0, NG_POW2)
    ji = tl.arange(0, G_POW2)
    expert = gi[:, None] * G + ji[None, :]  # [NG_POW2, G_POW2]
    valid = (gi < NG)[:, None] & (ji < G)[None, :]
    ptrs = (logits_ptr + rows64[:, None, None] * stride_lt
            + (expert.to(tl.int64) * stride_le)[None, :, :])  # fmt: skip
    x = tl.load(ptrs, mask=in_row[:, None, None] & valid[None, :, :], other=0.0).to(ACC)
    c = _sigmoid(x, ACCURATE_EXP)  # [BLOCK_T, NG_POW2, G_POW2]
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert.to(tl.int64) * stride_b, mask=valid, other=0.0)
        c = c + b.to(ACC)[None, :, :]
    # Padding experts never compete; `avail` broadcast to the full tile once.
    avail = valid[None, :, :] & (rows >= 0)[:, None, None]
    if GROUPED:
        nan = c != c
        plain = tl.where(avail & ~nan, c, float("-inf"))
        top1 = tl.max(plain, axis=2)  # [BLOCK_T, NG_POW2]
        # the second largest: drop one (the lowest) position holding top1
        first = tl.min(tl.where(plain == top1[:, :, None], ji[None, None, :], G_POW2), axis=2)
        top2 = tl.max(tl.where(ji[None, None, :] == first[:, :, None], float("-inf"), plain),
                      axis=2)  # fmt: skip
        score = tl.where(G > 1, top1 + top2, top1)
        score = tl.where(tl.max((avail & nan).to(tl.int32), axis=2) > 0, float("nan"), score)
        # keep TOPK_GROUP groups: NaN first (lower group first), then descending, ties lower
        g_nan = score != score
        g_key = tl.where(g_nan, float("inf"), score)
        g_rank = tl.where(g_nan, gi[None, :] - NG_POW2, gi[None, :])
        g_avail = (gi < NG)[None, :] & (rows >= 0)[:, None]
        kept = g_rank != g_rank  # all False, [BLOCK_T, NG_POW2]
        for _ in range(TOPK_GROUP):
            top = tl.max(tl.where(g_avail, g_key, float("-inf")), axis=1)
            best = tl.min(tl.where(g_avail & (g_key == top[:, None]), g_rank, NG_POW2), axis=1)
            hit = g_rank == best[:, None]
            g_avail = g_avail & ~hit
            kept = kept | hit
        c = tl.where(kept[:, :, None], c, float("-inf"))
    # Selection key: the choice score, NaN as +inf; among equal keys the lowest rank, a NaN's
    # rank being its expert id - width (NaNs first, by id), another's its id.
    width = NG_POW2 * G_POW2
    nan = c != c
    key = tl.where(nan, float("inf"), c)
    rank = tl.where(nan, expert[None, :, :] - width, expert[None, :, :])
    slots = tl.arange(0, K_POW2)[None, :]
    chosen = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    for k in range(K):
        top = tl.max(tl.max(tl.where(avail, key, float("-inf")), axis=2), axis=1)
        best = tl.min(tl.min(tl.where(avail & (key == top[:, None, None]), rank, width),
                             axis=2), axis=1)  # fmt: skip
        avail = avail & (rank != best[:, None, None])
        chosen = tl.where(slots == k, tl.where(best < 0, best + width, best)[:, None], chosen)
    # The chosen experts' unbiased scores, from their logits again (the same bits as above).
    mask = in_row[:, None] & (slots < K)
    xk = tl.load(logits_ptr + rows64[:, None] * stride_lt + chosen.to(tl.int64) * stride_le,
                 mask=mask, other=0.0).to(ACC)  # fmt: skip
    w = tl.where(slots < K, _sigmoid(xk, ACCURATE_EXP), 0.0)
    if RENORMALIZE:
        w = _div(w, (tl.sum(w, axis=1) + tl.full([], 1e-20, ACC))[:, None])
    if SCALE != 1.0:
        w = w * tl.full([], SCALE, ACC)
    out = rows64[:, None] * K + slots
    tl.store(w_ptr + out, w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, chosen, mask=mask)


_SIGMOID_FORWARD = ThinKernel(_sigmoid_grouped_topk_kernel)


def sigmoid_grouped_topk_triton(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """Route ``logits [T, E]`` (any strides; ``expert_bias [E]`` any stride, or None) into
    ``weights [T, K]`` (float32, float64 for float64 logits) and ``ids [T, K]`` int32, both
    preallocated contiguous. ``scale`` is ``routed_scaling_factor``."""
    T, E = logits.shape
    if T == 0:
        return
    grouped = topk_group < n_group
    if not grouped:  # every group kept: one group, the narrowest tile
        n_group = topk_group = 1
    G = E // n_group
    block_t, ng_pow2, g_pow2, num_warps = _grouped_blocks(n_group, G)
    st, se = logits.stride()
    has_bias = expert_bias is not None
    bias = expert_bias if has_bias else logits
    sb = expert_bias.stride(0) if has_bias else 0
    acc = _acc(logits.dtype)
    key = (logits.dtype, bias.dtype, k, topk_group, has_bias, renormalize, scale, block_t,
           ng_pow2, g_pow2, int_key(n_group, G, st, se, sb))  # fmt: skip
    _SIGMOID_FORWARD.launch(
        key, (cdiv(T, block_t),), (logits, bias, weights, ids, T, n_group, G, st, se, sb),
        lambda: dict(
            K=k, K_POW2=next_pow2(k), TOPK_GROUP=topk_group, GROUPED=grouped, HAS_BIAS=has_bias,
            RENORMALIZE=renormalize, SCALE=scale, ACC=acc, ACCURATE_EXP=not INTERPRETING,
            BLOCK_T=block_t, NG_POW2=ng_pow2, G_POW2=g_pow2, num_warps=num_warps,
        ),
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _sigmoid_topk_backward_kernel(
    g_ptr,
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
    SCALE: tl.constexpr,
    ACC: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rows64 = rows.to(tl.int64)
    in_row = rows < T
    slots = tl.arange(0, K_POW2)[None, :]
    slot_mask = in_row[:, None] & (slots < K)
    ids = tl.load(ids_ptr + rows64[:, None] * K + slots, mask=slot_mask, other=0)
    g = tl.load(g_ptr + rows64[:, None] * stride_gt + slots * stride_gk, mask=slot_mask,
                other=0.0).to(ACC)  # fmt: skip
    if SCALE != 1.0:
        g = g * tl.full([], SCALE, ACC)
    if RENORMALIZE:
        xk = tl.load(logits_ptr + rows64[:, None] * stride_lt + ids.to(tl.int64) * stride_le,
                     mask=slot_mask, other=0.0).to(ACC)  # fmt: skip
        u = tl.where(slots < K, _sigmoid(xk, ACCURATE_EXP), 0.0)
        d = tl.sum(u, axis=1) + tl.full([], 1e-20, ACC)
        gw = tl.sum(g * _div(u, d[:, None]), axis=1)  # Σ_j γ_j w_j, w the unscaled weights
        g = _div(g - gw[:, None], d[:, None])
    # Scatter the K slots' values to their columns; the ids of a row are distinct.
    cols = tl.arange(0, BLOCK_E)
    scattered = tl.zeros([BLOCK_T, BLOCK_E], dtype=ACC)
    for k in range(K):
        e = tl.load(ids_ptr + rows64 * K + k, mask=in_row, other=-1)
        gk = tl.sum(tl.where(slots == k, g, 0.0), axis=1)
        scattered = tl.where(cols[None, :] == e[:, None], gk[:, None], scattered)
    _, _, x = _load_rows(logits_ptr, pid, T, E, stride_lt, stride_le, ACC, BLOCK_T, BLOCK_E)
    s = _sigmoid(x, ACCURATE_EXP)
    dl = scattered * (1.0 - s) * s  # torch's sigmoid_backward, in its order
    out = rows64[:, None] * E + cols[None, :]
    tl.store(dl_ptr + out, dl.to(dl_ptr.dtype.element_ty),
             mask=in_row[:, None] & (cols < E)[None, :])  # fmt: skip


_SIGMOID_BACKWARD = ThinKernel(_sigmoid_topk_backward_kernel)


def sigmoid_topk_backward_triton(
    grad: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    renormalize: bool,
    scale: float,
    dlogits: torch.Tensor,
) -> None:
    """``dlogits [T, E]`` (preallocated contiguous, ``logits``' dtype) of the grouped sigmoid
    router from the weights' gradient ``grad [T, K]`` (any strides), the forward's contiguous
    ``ids`` and its ``logits``. The groups and the bias only chose the ids: not needed here."""
    T, E = logits.shape
    if T == 0:
        return
    k = ids.shape[1]
    block_t, block_e, num_warps = _blocks(E)
    sgt, sgk = grad.stride()
    st, se = logits.stride()
    acc = _acc(logits.dtype)
    key = (logits.dtype, grad.dtype, k, renormalize, scale, block_t, block_e,
           int_key(E, sgt, sgk, st, se))  # fmt: skip
    _SIGMOID_BACKWARD.launch(
        key, (cdiv(T, block_t),), (grad, ids, logits, dlogits, T, E, sgt, sgk, st, se),
        lambda: dict(
            K=k, K_POW2=next_pow2(k), RENORMALIZE=renormalize, SCALE=scale, ACC=acc,
            ACCURATE_EXP=not INTERPRETING, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
        ),
    )  # fmt: skip

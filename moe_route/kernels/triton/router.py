"""The routers in one launch each: softmax top-``K`` (also fused with the router's matmul) and
DeepSeek-V3's grouped sigmoid top-``K``.

Program ``p`` owns tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)`` and holds their whole rows of ``E``
logits in registers, scored in float32 (float64 for float64 logits).

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

**The router's matmul fused in** (:func:`gate_softmax_topk_triton`, for an inference
``MoELayer`` at up to 64 tokens, :func:`moe_route.routing.route_softmax_fused`). A program
computes its 16 tokens' logits ``x G^T`` (float32 MMAs over ``H``, so it reads the whole gate:
only gates up to 256 experts and 1 MiB), stores them in the logits' dtype and routes the stored
values with the softmax kernel's own selection: the ids and weights are those of the softmax
top-k on those logits, bit for bit. It saves a matmul launch, the host time that matters at
decode sizes.

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
from triton.language.extra import libdevice

from . import INTERPRETING, LaunchKey, ThinKernel, cdiv, int_key, next_pow2

#: Most experts one program holds (``BLOCK_E``, registers: a few ``[BLOCK_E]`` tiles over up to
#: 16 warps; the grouped sigmoid kernel's padded tile is at most twice as wide). Wider rows
#: would need a chunked selection; the public functions take the torch path above it on
#: ``backend="auto"`` and raise on ``backend="triton"``.
MAX_EXPERTS = 8192
#: Logits per program (``BLOCK_T * BLOCK_E``): 16 per thread of 4 warps, several tokens per
#: program at the usual ``E <= 256``.
TILE = 2048
#: Most tokens per program.
MAX_BLOCK_T = 16


def check_num_experts_supported(num_experts: int) -> None:
    """Raise ``ValueError`` (before any launch) if one program cannot hold ``E`` logits."""
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"num_experts={num_experts}: the Triton router kernels hold a token's "
            f"{num_experts} logits in one program, at most {MAX_EXPERTS}; use backend='auto' "
            "(which takes the torch path above the limit) or backend='torch'"
        )


def _blocks(E: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_E, num_warps)`` for ``E`` experts (never from ``T``: no compile per
    token count)."""
    block_e = next_pow2(E)
    block_t = max(1, min(MAX_BLOCK_T, TILE // block_e))
    num_warps = max(4, min(16, block_t * block_e // 512))
    return block_t, block_e, num_warps


@triton.jit
def _exp(x, ACCURATE_EXP: tl.constexpr):
    # libdevice is not available to the interpreter, whose tl.exp is numpy's (accurate).
    if ACCURATE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _div(a, b):
    # `/` on float32 lowers to div.full.f32 (2 ulp); float64 division is IEEE already.
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _load_rows(logits_ptr, pid, T, E, stride_lt, stride_le, ACC: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """``(rows, cols, x)``: the program's rows, its columns and the logits in ``ACC``, padding
    columns ``-inf`` (they never win and add 0 to the sum), padding rows 0 (finite)."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    in_col = cols < E
    mask = (rows < T)[:, None] & in_col[None, :]
    # int64 offsets: a transposed [T, E] view has stride_le = T
    ptrs = (logits_ptr + rows.to(tl.int64)[:, None] * stride_lt
            + cols.to(tl.int64)[None, :] * stride_le)  # fmt: skip
    x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    x = tl.where(in_col[None, :], x, float("-inf"))
    return rows, cols, x


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


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


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


#: The router's matmul fused with the softmax top-k (:func:`gate_softmax_topk_triton`): one
#: program per 16 tokens reads the whole gate weight, so only where that is small.
GATE_MAX_EXPERTS = 256
GATE_MAX_BYTES = 1 << 20
_GATE_BLOCK_T = 16  # the smallest M of an MMA


@triton.jit(do_not_specialize=["T"])
def _gate_softmax_topk_kernel(
    x_ptr, g_ptr, logits_ptr, w_ptr, ids_ptr, T, E, H, stride_xt, stride_xh, stride_ge,
    stride_gh, K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
    ACCURATE_EXP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program ``p``: tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``. Their logits ``x G^T`` summed in
    float32 over ``H`` (one MMA per ``BLOCK_H`` step), rounded to the logits' dtype and
    stored, then routed from the stored values by :func:`_select_softmax`."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    hs = tl.arange(0, BLOCK_H)
    row_ok = rows < T
    col_ok = cols < E
    rows64 = rows.to(tl.int64)
    x_ptrs = x_ptr + rows64[:, None] * stride_xt + hs[None, :] * stride_xh
    g_ptrs = g_ptr + cols.to(tl.int64)[None, :] * stride_ge + hs[:, None] * stride_gh
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = h0 + hs < H
        a = tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        b = tl.load(g_ptrs, mask=h_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_H * stride_xh
        g_ptrs += BLOCK_H * stride_gh
    logits = acc.to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + rows64[:, None] * E + cols[None, :], logits,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
    x = tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf"))
    _select_softmax(x, rows, cols, w_ptr, ids_ptr, T, E, K, K_POW2, RENORMALIZE, tl.float32,
                    ACCURATE_EXP, BLOCK_T, BLOCK_E)  # fmt: skip


_GATE = ThinKernel(_gate_softmax_topk_kernel)


def gate_fits(num_experts: int, gate_bytes: int) -> bool:
    """Whether :func:`gate_softmax_topk_triton` takes a gate of this size."""
    return num_experts <= GATE_MAX_EXPERTS and gate_bytes <= GATE_MAX_BYTES


class GateLaunch:
    """:func:`gate_softmax_topk_triton` prepared for one configuration of arguments (dtypes,
    strides, ``E``, ``H``, ``k``; not ``T``): a call allocates the three outputs and launches.
    Keeps no tensor."""

    def __init__(self, x: torch.Tensor, gate_weight: torch.Tensor, k: int, renormalize: bool,
                 logits_dtype: torch.dtype):  # fmt: skip
        H = x.shape[1]
        E = gate_weight.shape[0]
        self.E, self.k, self.logits_dtype = E, k, logits_dtype
        block_e = max(16, next_pow2(E))
        # One program reads the whole gate, so what it keeps in flight sets the speed; 256
        # experts take 64-wide steps for shared memory (docs/decisions.md, "One-launch router").
        block_h = 32 if x.dtype == torch.float32 else (128 if block_e <= 128 else 64)
        stages = 3 if x.dtype == torch.float32 else 4
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32: ignored for 16-bit)
        sx, sg = x.stride(), gate_weight.stride()
        self.key = LaunchKey((x.dtype, gate_weight.dtype, logits_dtype, k, renormalize, block_e,
                              int_key(E, H, *sx, *sg)))  # fmt: skip
        self.tail = (E, H, *sx, *sg)
        self.constexprs = lambda: dict(
            K=k, K_POW2=next_pow2(k), RENORMALIZE=renormalize, ACCURATE_EXP=not INTERPRETING,
            DOT_PRECISION=precision, BLOCK_T=_GATE_BLOCK_T, BLOCK_E=block_e, BLOCK_H=block_h,
            num_warps=4, num_stages=stages,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, gate_weight: torch.Tensor):
        """``(logits [T, E], weights [T, K] float32, ids [T, K] int32)``, new and contiguous."""
        T = x.shape[0]
        logits = x.new_empty(T, self.E, dtype=self.logits_dtype)
        weights = x.new_empty(T, self.k, dtype=torch.float32)
        ids = x.new_empty(T, self.k, dtype=torch.int32)
        self.fill(x, gate_weight, logits, weights, ids)
        return logits, weights, ids

    def fill(self, x, gate_weight, logits, weights, ids) -> None:
        """The launch into given outputs (contiguous, of the prepared dtypes)."""
        T = x.shape[0]
        if T:
            _GATE.launch(self.key, (cdiv(T, _GATE_BLOCK_T),),
                         (x, gate_weight, logits, weights, ids, T, *self.tail),
                         self.constexprs)  # fmt: skip


def gate_softmax_topk_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    k: int,
    renormalize: bool,
    logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """``logits = x @ gate_weight^T`` (``[T, E]``, contiguous, in its own dtype: float32 or
    ``x``'s) and its softmax top-``k`` into ``weights [T, K]`` float32 and ``ids [T, K]``
    int32 (contiguous), in one launch: what ``softmax_topk(linear(x, gate_weight), k)`` gives
    on the logits this kernel stores (summed in another order than a matmul library's).
    ``x [T, H]`` and ``gate_weight [E, H]``: one 16- or 32-bit dtype, any strides; the gate
    within :func:`gate_fits`. Prepares its :class:`GateLaunch` on every call."""
    GateLaunch(x, gate_weight, k, renormalize, logits.dtype).fill(x, gate_weight, logits,
                                                                   weights, ids)  # fmt: skip


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


# --------------------------------------------------------------------------- grouped sigmoid
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

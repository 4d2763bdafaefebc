"""Grouped GEMM over expert-grouped rows: one launch for all experts, three kernels.

Rows of expert ``e`` are ``[offset[e], offset[e+1])`` of the permuted order; they are cut into
``BLOCK_M``-row *m-tiles*, numbered expert after expert. Each program finds the expert of its
m-tile from ``expert_first_token_offset`` itself (:func:`_tile_expert`: a prefix sum of the
experts' tile counts, in registers), so nothing is launched or stored before the GEMM. The grid
is an upper bound that depends only on ``T*K`` and the tile sizes (``cdiv(T*K, BLOCK_M) + E + 1``
m-tiles), never on the routing: programs past the last real m-tile exit at once, and an expert
with no rows owns no m-tile. No host synchronisation, no per-expert launch. Program ``pid``
computes the ``[BLOCK_M, BLOCK_N]`` tile ``(m_tile, n_tile)``, m-tiles grouped ``GROUP_M`` at a
time so that consecutive programs reuse the same weight columns in L2.

The main loop (:func:`_mainloop`) is shared; each kernel owns one epilogue:

* :func:`_gemm_kernel` — GEMM1 and GEMM2: bias, then the activation (plain, or gated with gate
  and up accumulators over the same ``A`` tile, ``W1`` rows gate-then-up or interleaved; its
  math and parameters in :mod:`.activation`, from a :class:`GemmEpilogue`), and
  with ``STORE_PRE`` (training) also the pre-activation ``z``, rounded to the input dtype, from
  which the activation is then computed (the backward recomputes ``act(z)`` from the saved
  ``z`` and must see the forward's bits). ``GATHER`` reads ``A`` row ``d`` as
  ``x[dest_to_src[d] mod T]``: ``x_perm`` is never written. Programs past the experts write
  zeros to the dropped rows ``[offset[E], M)``, so every output row is defined.
  :func:`_gemm_persistent_kernel` (``GemmConfig.persistent``) does the same work with a few
  programs per SM, each looping over the routed tiles with a stride of the grid (the tiles'
  experts from one prefix sum per program; an exact loop bound read from ``offsets`` on the
  device, so no host sync and a routing-independent grid), the loop flattened so that the
  next tile's loads overlap this tile's epilogue. Its groups never mix experts
  (:func:`_expert_grouped_tile`). Each tile is computed by the same :func:`_gemm_tile`: the
  same arithmetic in both kernels, whatever the order.
* :func:`_gemm_act_bwd_kernel` — GEMM2's backward with the activation's backward:
  ``g[d] = dout[t] @ W2[e]`` (``A`` gathered from ``dout``, ``W = W2`` seen as ``[E, I, H]``);
  the epilogue recomputes ``h[d] = act(z[d])``, writes ``w[t,k]·h[d]`` (for ``dW2``), the
  partial router-weight gradient ``<g[d], h[d]>`` of its column tile (summed in fixed order by
  :mod:`.weight_grad`), and ``dz = act'(z)·w[t,k]·g`` in ``W1``'s gate/up layout. (The
  split alternative, a plain GEMM storing ``g`` and then a pass over the rows, is
  :mod:`.act_backward`.)
* :func:`_gemm_finalize_kernel` — GEMM2 with the finalize in its epilogue, in one of two
  modes. ``ORDERED`` (deterministic): the tile stores its rows of ``y`` to a scratch
  ``[T*K, H]`` buffer, then each row bumps the arrival counter of its ``(token, column tile)``;
  the row whose bump completes the token reduces the token's rows in ``k`` order — the
  standalone finalize's arithmetic, so the bits do not depend on which tile arrives last.
  Otherwise (atomic): ``w[t,k]·y[d]`` is added into a float32 (float64) ``[T, H]`` output with
  atomics; the sum order then varies run to run.

``W`` may be stored n-major (``[E, N, Kd]``, unit stride along ``Kd``, the usual weight) or
k-major (unit stride along ``N``, e.g. ``W2.transpose(1, 2)`` in the backward); TMA reads
either (``W_KMAJOR``). float64 (for ``gradcheck``) multiplies on the FMA units (``"fma"``).
Arguments that change with the token count (``M_ROWS``, ``M_TILES``, ``T``) are not
specialised: a new ``T`` reuses the compiled kernel of its tile configuration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import (
    LaunchKey,
    ThinKernel,
    cdiv,
    cuda_index,
    launch_key_part,
    next_pow2,
    shared_memory_optin,
)
from .activation import gated_backward, gated_forward, plain_backward, plain_forward
from .tma import (
    TMA_DTYPES,
    Descriptor,
    bounded_rows_descriptor,
    descriptor,
    layout_ok,
    store_rows,
    store_rows_part,
    tma_ok,
)

#: Rows per step of the ordered fused finalize's reduction.
RED_ROWS = 16
#: The most experts a grouped GEMM takes: each program holds the experts' tile counts in
#: registers to find its expert (8192 int32 spread over a program's threads).
MAX_EXPERTS = 8192

_VARYING = ["M_ROWS", "M_TILES", "T"]


@launch_key_part
@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of one grouped GEMM launch (chosen by :mod:`moe_route.tuning`)."""

    block_m: int
    block_n: int
    block_k: int
    #: m-tiles per group sweeping the n-tiles: ``group_m`` consecutive ones in the per-tile
    #: kernels (:func:`_swizzle`), at most ``group_m`` of one expert in the persistent kernel
    #: (:func:`_expert_grouped_tile`)
    group_m: int
    num_warps: int
    num_stages: int
    #: Load the non-gathered operands through TMA descriptors (SM90+, 16-bit, aligned).
    use_tma: bool = False
    #: GEMM1 / GEMM2 (:func:`grouped_gemm_triton`) only: programs per SM of the persistent
    #: kernel (0: one program per tile). The other kernels take the per-tile grid whatever
    #: this says.
    persistent: int = 0
    #: With ``persistent`` and every operand read through TMA: a warp-specialised loop.
    warp_specialize: bool = False
    #: With ``persistent`` and ``use_tma`` (GEMM1 / GEMM2): the output and the pre-activation
    #: stored through TMA (asynchronous, overlapping the next tile's main loop) where shared
    #: memory holds their staging beside the main loop's stages.
    tma_store: bool = False


@launch_key_part
@dataclass(frozen=True)
class GemmEpilogue:
    """What GEMM1's epilogue computes: the activation and its parameters, the layout.

    Built from a :class:`moe_route.activations.Activation` by
    :func:`moe_route.grouped_gemm.epilogue_for`; every field is a constexpr of the kernels
    (and part of their launch key)."""

    #: element-wise kind's code (:data:`moe_route.activations.KIND_CODES`).
    act: int = 0
    gated: bool = False
    interleaved: bool = False
    #: silu's slope: ``x · sigmoid(alpha · x)``.
    alpha: float = 1.0
    #: clamp of gate (from above) and up (both sides) of a gated activation; ``0.0``: none.
    limit: float = 0.0
    #: added to the clamped up.
    up_offset: float = 0.0


IDENTITY = GemmEpilogue()


# --------------------------------------------------------------------------- shared pieces
@triton.jit
def _swizzle(tile, M_TILES, n_tiles, GROUP_M: tl.constexpr):
    """``(m_tile, n_tile)`` of flat tile index ``tile``: ``GROUP_M`` m-tiles at a time sweep
    every n-tile, so that consecutive tiles reuse the same weight columns in L2."""
    in_group = GROUP_M * n_tiles
    first_m = (tile // in_group) * GROUP_M
    group_size = tl.minimum(M_TILES - first_m, GROUP_M)
    m_tile = first_m + (tile % in_group) % group_size
    n_tile = (tile % in_group) // group_size
    return m_tile, n_tile


@triton.jit
def _program_tile(M_TILES, N_OUT, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    return _swizzle(tl.program_id(0), M_TILES, tl.cdiv(N_OUT, BLOCK_N), GROUP_M)


@triton.jit
def _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M: tl.constexpr):
    """True for the many programs past every m-tile, known from ``offset[E]`` alone: at most
    ``cdiv(routed, BM) + min(E, routed)`` routed m-tiles, then the dropped rows' tiles."""
    routed = tl.load(offsets_ptr + E)
    most = tl.cdiv(routed, BLOCK_M) + tl.minimum(routed, E) + tl.cdiv(M_ROWS - routed, BLOCK_M)
    return m_tile >= most


@triton.jit
def _expert_ends(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """The first m-tile after each expert (``E_POW2`` lanes; the lanes past ``E`` hold the
    number of routed m-tiles): a prefix sum of the experts' tile counts, in registers."""
    ex = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
    hi = tl.load(offsets_ptr + ex + 1, mask=ex < E, other=0)
    return tl.cumsum(((hi - lo + BLOCK_M - 1) // BLOCK_M).to(tl.int32), 0)


@triton.jit
def _expert_at(ends, at, span, E, E_POW2: tl.constexpr):
    """``(e, start)``: the expert whose tiles hold flat index ``at`` where each m-tile spans
    ``span`` consecutive indices, and its first m-tile (``ends`` from :func:`_expert_ends`).

    The experts whose tiles all come before ``at`` are a prefix (``ends`` never decreases), of
    length ``e``; the last of them ends where ``at``'s expert starts. One reduction finds both:
    the largest ``(end, index + 1)`` pair of that prefix, packed (``index + 1 < E_POW2``)."""
    ex = tl.arange(0, E_POW2)
    before = (ends * span <= at) & (ex < E)
    key = tl.max(tl.where(before, ends.to(tl.int64) * E_POW2 + ex + 1, 0), axis=0)
    return (key % E_POW2).to(tl.int32), key // E_POW2


@triton.jit
def _find_expert(offsets_ptr, ends, m_tile, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """``(e, first_row, row_end)`` of m-tile ``m_tile`` from :func:`_expert_ends`; ``e == E``
    past the routed tiles (``first_row`` is then the first row of this dropped-row tile)."""
    e, start = _expert_at(ends, m_tile, 1, E, E_POW2)
    first_row = tl.load(offsets_ptr + e) + (m_tile - start) * BLOCK_M
    row_end = tl.load(offsets_ptr + tl.minimum(e + 1, E))
    return e, first_row, row_end


@triton.jit
def _expert_grouped_tile(offsets_ptr, ends, tile, n_tiles, E, BLOCK_M: tl.constexpr,
                         GROUP_M: tl.constexpr, E_POW2: tl.constexpr):  # fmt: skip
    """``(e, first_row, row_end, n_tile)`` of routed tile ``tile`` in the expert-grouped order:
    expert after expert (tiles ``[start_e * n_tiles, end_e * n_tiles)`` for the m-tiles
    ``[start_e, end_e)`` of :func:`_expert_ends`), each expert's ``m_e`` m-tiles cut into
    ``cdiv(m_e, GROUP_M)`` groups of near-equal size, each group sweeping every n-tile.

    A group never mixes experts, so the programs running at once read one expert's weight
    columns, each once per group. (:func:`_swizzle`'s fixed groups of ``GROUP_M`` consecutive
    m-tiles straddle experts wherever a count of rows is not a multiple of ``BLOCK_M``: the
    straddled experts' columns are then read once per group they are in.)"""
    e, start = _expert_at(ends, tile, n_tiles, E, E_POW2)
    start = start.to(tl.int32)
    lo = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    m_e = tl.cdiv(row_end - lo, BLOCK_M).to(tl.int32)  # >= 1: `tile` lies in it
    groups = tl.cdiv(m_e, GROUP_M)
    size = m_e // groups  # the first `extra` groups take one m-tile more
    extra = m_e % groups
    local = tile - start * n_tiles
    m_at = local // n_tiles  # an m-tile of the group `local` lies in
    wide = extra * (size + 1)
    g = tl.where(m_at < wide, m_at // (size + 1), extra + (m_at - wide) // size)
    g_size = size + (g < extra).to(tl.int32)
    first_m = g * size + tl.minimum(g, extra)
    in_group = local - first_m * n_tiles
    m = first_m + in_group % g_size
    return e, lo + m * BLOCK_M, row_end, in_group // g_size


@triton.jit
def _tile_expert(offsets_ptr, m_tile, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    ends = _expert_ends(offsets_ptr, E, BLOCK_M, E_POW2)
    return _find_expert(offsets_ptr, ends, m_tile, E, BLOCK_M, E_POW2)


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b``; ``"fma"`` (float64) multiplies on the CUDA cores."""
    if DOT_PRECISION == "fma":
        out = acc + tl.sum(a[:, :, None].to(acc.dtype) * b[None, :, :].to(acc.dtype), axis=1)
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _mainloop(a_ptr, a_desc, w_ptr, w_desc, e, first_row, a_rows, row_ok, w_rows, up_rows,
              col_ok, n0, N_UP, KD, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
              TWO: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
              W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
              ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr = 0):  # fmt: skip
    """``A[rows] @ W[e][w_rows].T`` (and, with ``TWO``, ``@ W[e][up_rows].T``) over ``Kd``.

    ``w_rows`` / ``up_rows``: the ``W[e]`` rows of the tile's columns, read where ``col_ok``
    (zeros elsewhere: those columns are never stored). A mask, not rows clamped into bounds:
    a clamp hides the rows' contiguity from Triton, and where ``W`` is n-contiguous (the
    backward's ``W.transpose(1, 2)``) every element then loads on its own (docs/decisions.md,
    "Transposed weights: mask, not clamp").

    With ``A_DESC`` / ``W_DESC`` the tiles come through TMA descriptors (Hopper): rows past the
    expert or the matrix are read (or zero-filled) but never stored. ``N_UP`` is the first up
    row for the descriptor path (concat layout).

    Zero-filling those rows would save no energy at the power limit (docs/decisions.md, "Zero
    rows save no energy").

    ``ONE_DOT`` (gated, ``W_DESC``, instead of ``TWO``): the gate and up rows of the tile come
    in one ``[2*BLOCK_N, BLOCK_K]`` TMA box and go through one MMA into one ``[BLOCK_M,
    2*BLOCK_N]`` accumulator, split after the loop: ``1``, concat rows through ``w_desc`` over
    ``W`` viewed ``[E, 2, N_UP, Kd]`` (box ``[1, 2, BLOCK_N, BLOCK_K]``); ``2``, interleaved rows
    ``2*n0 ...`` (box ``[1, 2*BLOCK_N, BLOCK_K]``).
    """
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    u_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    ACC_N: tl.constexpr = 2 * BLOCK_N if ONE_DOT else BLOCK_N
    acc = tl.zeros([BLOCK_M, ACC_N], dtype=ACC)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, KD, BLOCK_K):
        k_ok = k0 + ks < KD
        if A_DESC:
            a = a_desc.load([first_row.to(tl.int32), k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if ONE_DOT == 1:
            wg = tl.reshape(w_desc.load([e, 0, n0, k0]), [2 * BLOCK_N, BLOCK_K]).T
        elif ONE_DOT == 2:
            wg = tl.reshape(w_desc.load([e, 2 * n0, k0]), [2 * BLOCK_N, BLOCK_K]).T
        elif W_DESC and W_KMAJOR:
            wg = tl.reshape(w_desc.load([e, k0, n0]), [BLOCK_K, BLOCK_N])
        elif W_DESC:
            wg = tl.reshape(w_desc.load([e, n0, k0]), [BLOCK_N, BLOCK_K]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _mma(a, wg, acc, DOT_PRECISION)
        if TWO:
            if W_DESC and W_KMAJOR:
                wu = tl.reshape(w_desc.load([e, k0, N_UP + n0]), [BLOCK_K, BLOCK_N])
            elif W_DESC:
                wu = tl.reshape(w_desc.load([e, N_UP + n0, k0]), [BLOCK_N, BLOCK_K]).T
            elif EVEN_K:
                wu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = _mma(a, wu, acc_up, DOT_PRECISION)
            u_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
    if ONE_DOT == 1:  # columns: BLOCK_N gate, then BLOCK_N up
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    elif ONE_DOT == 2:  # columns: gate, up, gate, up, ...
        acc, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    return acc, acc_up


@triton.jit
def _gate_up_rows(cols, N_OUT, GATED: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``W1`` rows (and ``z`` columns) of the gate and up parts of output columns ``cols``."""
    if GATED:
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = 2 * cols + 1
        else:
            gate_rows = cols
            up_rows = cols + N_OUT
    else:
        gate_rows = cols
        up_rows = cols
    return gate_rows, up_rows


@triton.jit
def _a_rows(dest_to_src_ptr, rows, row_ok, T, GATHER: tl.constexpr):
    if GATHER:
        a_rows = (tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0) % T).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    return a_rows


# --------------------------------------------------------------------------- GEMM1 / GEMM2
@triton.jit
def _zero_rows(out_ptr, z_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om, stride_on, stride_zm,
               GATED: tl.constexpr, STORE_PRE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """A tile of the dropped rows ``[offset[E], M)``: zeros in ``out`` (and ``z``)."""
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M_ROWS) & (cols < N_OUT)[None, :]
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on, zeros,
             mask=mask)  # fmt: skip
    if STORE_PRE:  # all columns of z, gate and up, whatever the layout
        z_zero = z_ptr + rows[:, None].to(tl.int64) * stride_zm + cols[None, :]
        tl.store(z_zero, zeros, mask=mask)
        if GATED:
            tl.store(z_zero + N_OUT, zeros, mask=mask)


@triton.jit
def _gemm_tile(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr, dest_to_src_ptr, e,
    first_row, row_end, n_tile, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr, OUT_DESC: tl.constexpr, Z_DESC: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of expert ``e``'s rows ``[first_row, row_end)``:
    main loop, bias, pre-activation, activation, store.

    ``OUT_DESC`` / ``Z_DESC``: ``out`` / ``z`` (``[M, 2, N_OUT]`` when gated) stored through
    bounded-rows descriptors (:mod:`.tma`) whose bound is ``row_end``: asynchronous copies,
    which the persistent kernel's next tile overlaps, instead of masked stores."""
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    row_ok = rows < row_end
    gate_rows, up_rows = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
    a_rows = _a_rows(dest_to_src_ptr, rows, row_ok, T, GATHER)
    acc, acc_up = _mainloop(
        a_ptr, a_desc, w_ptr, w_desc, e, first_row, a_rows, row_ok, gate_rows, up_rows, col_ok,
        n_tile * BLOCK_N, N_OUT, KD, stride_am, stride_ak, stride_we, stride_wn, stride_wk,
        GATED and not ONE_DOT, A_DESC, W_DESC, W_KMAJOR, EVEN_K, DOT_PRECISION, ACC, BLOCK_M,
        BLOCK_N, BLOCK_K, ONE_DOT,
    )  # fmt: skip
    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc += tl.load(b_base + gate_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
        if GATED:
            acc_up += tl.load(b_base + up_rows * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    n0 = n_tile * BLOCK_N
    # TMA coordinates are 32-bit (the launcher takes descriptors for fewer than 2^30 rows)
    size = (row_end - first_row).to(tl.int32)
    first = first_row.to(tl.int32)
    if STORE_PRE:
        z_rows = z_ptr + rows[:, None].to(tl.int64) * stride_zm
        zg = acc.to(z_ptr.dtype.element_ty)
        if Z_DESC and GATED:
            store_rows_part(z_desc, first, size, 0, n0, zg, BLOCK_M, BLOCK_N)
        elif Z_DESC:
            store_rows(z_desc, first, size, n0, zg, BLOCK_M, BLOCK_N)
        else:
            tl.store(z_rows + gate_rows[None, :], zg, mask=mask)
        acc = zg.to(ACC)
        if GATED:
            zu = acc_up.to(z_ptr.dtype.element_ty)
            if Z_DESC:
                store_rows_part(z_desc, first, size, 1, n0, zu, BLOCK_M, BLOCK_N)
            else:
                tl.store(z_rows + up_rows[None, :], zu, mask=mask)
            acc_up = zu.to(ACC)
    if GATED:
        h = gated_forward(acc, acc_up, ACT, ALPHA, LIMIT, UP_OFFSET)
    else:
        h = plain_forward(acc, ACT)
    if OUT_DESC:
        store_rows(out_desc, first, size, n0, h, BLOCK_M, BLOCK_N)
    else:
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, bias_ptr, offsets_ptr, dest_to_src_ptr,
    E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    e, first_row, row_end = _tile_expert(offsets_ptr, m_tile, E, BLOCK_M, E_POW2)
    if e >= E:  # past the experts: the dropped rows [offset[E], M) are zeros, then done
        _zero_rows(out_ptr, z_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om, stride_on,
                   stride_zm, GATED, STORE_PRE, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    _gemm_tile(
        a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_ptr, z_ptr, bias_ptr, dest_to_src_ptr,
        e, first_row, row_end, n_tile, N_OUT, KD, T, stride_am, stride_ak, stride_we, stride_wn,
        stride_wk, stride_om, stride_on, stride_zm, stride_be, stride_bn, ACT, GATED, ALPHA,
        LIMIT, UP_OFFSET, INTERLEAVED, HAS_BIAS, GATHER, STORE_PRE, ACC, DOT_PRECISION, A_DESC,
        W_DESC, W_KMAJOR, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, 0, False, False,
    )  # fmt: skip


@triton.jit(do_not_specialize=_VARYING)
def _gemm_persistent_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr, offsets_ptr,
    dest_to_src_ptr,
    E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr, STORE_PRE: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr,
    W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, ONE_DOT: tl.constexpr, OUT_DESC: tl.constexpr,
    Z_DESC: tl.constexpr,
):  # fmt: skip
    """:func:`_gemm_kernel`'s work, done by a fixed number of programs (a few per SM).

    Program ``p`` of ``P`` takes tiles ``p, p + P, ...`` of the routed tiles, numbered in the
    expert-grouped order (:func:`_expert_grouped_tile`); the experts' tile ends are summed once per
    program, so the loop bound is exact (``routed m-tiles x n-tiles``, read from ``offsets``
    on the device: no host sync, the grid does not depend on the routing) and the loop body has
    no branch, for the compiler to flatten and software-pipeline across tiles. The dropped rows'
    zero tiles follow in a second loop, in reverse program order (the programs that got one
    tile fewer above take them first). ``M_TILES`` (the per-tile kernel's bound) is unused.
    ``ONE_DOT``: a gated ``W1``'s gate and up rows through one TMA box and one accumulator
    (see :func:`_mainloop` and the launcher's note).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ends = _expert_ends(offsets_ptr, E, BLOCK_M, E_POW2)
    routed_tiles = tl.max(ends, axis=0)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    for tile in tl.range(pid, routed_tiles * n_tiles, programs, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        e, first_row, row_end, n_tile = _expert_grouped_tile(
            offsets_ptr, ends, tile, n_tiles, E, BLOCK_M, GROUP_M, E_POW2
        )
        _gemm_tile(
            a_ptr, a_desc, w_ptr, w_desc, out_ptr, z_ptr, out_desc, z_desc, bias_ptr,
            dest_to_src_ptr, e, first_row, row_end, n_tile, N_OUT, KD, T, stride_am, stride_ak,
            stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm, stride_be,
            stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET, INTERLEAVED, HAS_BIAS, GATHER,
            STORE_PRE, ACC, DOT_PRECISION, A_DESC, W_DESC, W_KMAJOR, EVEN_K, BLOCK_M, BLOCK_N,
            BLOCK_K, ONE_DOT, OUT_DESC, Z_DESC,
        )  # fmt: skip
    routed = tl.load(offsets_ptr + E)
    zero_tiles = tl.cdiv(M_ROWS - routed, BLOCK_M) * n_tiles
    for tile in range(programs - 1 - pid, zero_tiles, programs):
        _zero_rows(out_ptr, z_ptr, routed + (tile // n_tiles) * BLOCK_M, tile % n_tiles, M_ROWS,
                   N_OUT, stride_om, stride_on, stride_zm, GATED, STORE_PRE, BLOCK_M,
                   BLOCK_N)  # fmt: skip


# --------------------------------------------------------------------------- activation bwd
@triton.jit(do_not_specialize=_VARYING)
def _gemm_act_bwd_kernel(
    a_ptr, a_desc, w_ptr, w_desc, wh_ptr, z_ptr, dz_ptr, partial_ptr, weights_ptr, offsets_ptr,
    dest_to_src_ptr, E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_wt, stride_wkk,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_PERMUTED: tl.constexpr, A_DESC: tl.constexpr,
    W_DESC: tl.constexpr, W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
):  # fmt: skip
    """``A_PERMUTED``: ``a`` holds ``dout``'s rows in the permuted order (``[M, H]``, through
    ``a_desc`` with ``A_DESC``), else ``dout [T, H]`` itself, rows gathered through the maps."""
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    e, first_row, row_end = _tile_expert(offsets_ptr, m_tile, E, BLOCK_M, E_POW2)
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    if e >= E:  # dropped rows: w·h and dz (all its columns) are zero
        _zero_rows(wh_ptr, dz_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om, stride_on,
                   stride_zm, GATED, True, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    row_ok = rows < row_end
    src = tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0)
    t = (src % T).to(tl.int64)
    a_rows = rows.to(tl.int64) if A_PERMUTED else t
    acc, _ = _mainloop(
        a_ptr, a_desc, w_ptr, w_desc, e, first_row, a_rows, row_ok, cols, cols, col_ok,
        n_tile * BLOCK_N, 0, KD, stride_am, stride_ak, stride_we,
        stride_wn, stride_wk, False, A_DESC, W_DESC, W_KMAJOR, EVEN_K, DOT_PRECISION, ACC,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    # acc = g = dout[t] @ W2[e] over the I-columns `cols`; z holds GEMM1's pre-activation.
    k = src // T
    wt = tl.load(weights_ptr + t * stride_wt + k * stride_wkk, mask=row_ok, other=0.0).to(ACC)
    # 64-bit bases of the tile's rows, 32-bit offsets inside it: [BLOCK_M, BLOCK_N] tensors of
    # 64-bit pointers cost 2 registers an element, and this epilogue holds several tiles.
    first = first_row.to(tl.int64)
    local = tl.arange(0, BLOCK_M)
    bases = (z_ptr + first * stride_zm, dz_ptr + first * stride_zm, wh_ptr + first * stride_om)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    if SPLIT_EPILOGUE:
        # Two column halves, one after the other: the whole-tile epilogue spills
        # (docs/decisions.md, "Activation backward: fused or split").
        half: tl.constexpr = BLOCK_N // 2
        acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, half]), [0, 2, 1]))
        part = _act_bwd_epilogue(
            acc_lo, n_tile * BLOCK_N + tl.arange(0, half), local,
            row_ok, wt, bases, N_OUT, stride_zm, stride_om, stride_on, ACT, GATED, ALPHA, LIMIT,
            UP_OFFSET, INTERLEAVED, ACC,
        )  # fmt: skip
        part += _act_bwd_epilogue(
            acc_hi, n_tile * BLOCK_N + half + tl.arange(0, half), local, row_ok, wt, bases,
            N_OUT, stride_zm, stride_om, stride_on, ACT, GATED, ALPHA, LIMIT, UP_OFFSET,
            INTERLEAVED, ACC,
        )  # fmt: skip
    else:
        part = _act_bwd_epilogue(
            acc, cols, local, row_ok, wt, bases, N_OUT, stride_zm, stride_om, stride_on, ACT,
            GATED, ALPHA, LIMIT, UP_OFFSET, INTERLEAVED, ACC,
        )  # fmt: skip
    # this tile's share of <dout[t] W2[e], h[d]>
    tl.store(partial_ptr + rows.to(tl.int64) * n_tiles + n_tile, part, mask=row_ok)


@triton.jit
def _act_bwd_epilogue(acc, cols, local, row_ok, wt, bases, N_OUT, stride_zm, stride_om,
                      stride_on, ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
                      LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr,
                      ACC: tl.constexpr):  # fmt: skip
    """For the columns ``cols`` of a tile of ``g``: ``w·h`` and ``dz`` stored, ``Σ_cols g·h``
    returned. ``bases``: ``z``, ``dz`` and ``w·h`` at the tile's first row; ``local`` the
    rows' offsets from it."""
    z_base, dz_base, wh_base = bases
    col_ok = cols < N_OUT
    gate_cols, up_cols = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
    mask = row_ok[:, None] & col_ok[None, :]
    z_rows = local[:, None] * stride_zm
    zg = tl.load(z_base + z_rows + gate_cols[None, :], mask=mask, other=0.0).to(ACC)
    if GATED:
        zu = tl.load(z_base + z_rows + up_cols[None, :], mask=mask, other=0.0).to(ACC)
        h = gated_forward(zg, zu, ACT, ALPHA, LIMIT, UP_OFFSET)
    else:
        zu = zg
        h = plain_forward(zg, ACT)
    h = h.to(wh_base.dtype.element_ty).to(ACC)  # the forward's h, bit for bit
    wh_offs = local[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(wh_base + wh_offs, (h * wt[:, None]).to(wh_base.dtype.element_ty), mask=mask)
    part = tl.sum(acc * h, axis=1)
    dh = acc * wt[:, None]
    if GATED:
        d_gate, d_up = gated_backward(zg, zu, dh, ACT, ALPHA, LIMIT, UP_OFFSET)
        tl.store(dz_base + z_rows + gate_cols[None, :], d_gate.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
        tl.store(dz_base + z_rows + up_cols[None, :], d_up.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
    else:
        d_x = plain_backward(zg, dh, ACT)
        tl.store(dz_base + z_rows + gate_cols[None, :], d_x.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
    return part


# --------------------------------------------------------------------------- fused finalize
@triton.jit
def _routed_slots(expert_for_src_ptr, t, mask, T, TOP_K: tl.constexpr):
    """Routed (not dropped) slots of each token ``t``: how many rows the finalize sums."""
    n = tl.zeros(t.shape, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        n += (tl.load(expert_for_src_ptr + j * T + t, mask=mask, other=-1) >= 0).to(tl.int32)
    return n


@triton.jit
def _store_final(final_ptr, bias_ptr, t, cols, row_mask, col_mask, acc, stride_ft, stride_fh,
                 stride_bt, stride_bh, HAS_BIAS: tl.constexpr):  # fmt: skip
    """``out[t, cols] = acc + bias[t, cols]``, rounded once (the standalone finalize's tail)."""
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + t[:, None] * stride_bt + cols[None, :] * stride_bh, mask=mask)
        acc += b.to(acc.dtype)
    ptrs = final_ptr + t[:, None] * stride_ft + cols[None, :] * stride_fh
    tl.store(ptrs, acc.to(final_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _gemm_finalize_kernel(
    a_ptr, a_desc, w_ptr, w_desc, y_ptr, bias_ptr, offsets_ptr, dest_to_src_ptr, weights_ptr,
    final_ptr, counter_ptr, src_to_dest_ptr, expert_for_src_ptr, final_bias_ptr,
    E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_be, stride_bn, stride_wt, stride_wkk, stride_ft, stride_fh, stride_fbt, stride_fbh,
    ORDERED: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL_BIAS: tl.constexpr,
    TOP_K: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, A_DESC: tl.constexpr,
    W_DESC: tl.constexpr, W_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    RED_M: tl.constexpr,
):  # fmt: skip
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    e, first_row, row_end = _tile_expert(offsets_ptr, m_tile, E, BLOCK_M, E_POW2)
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    if e >= E:
        if ORDERED:  # a token with no routed slot: out[t] = bias[t] (or 0), via its k=0 row
            src = tl.load(dest_to_src_ptr + rows, mask=rows < M_ROWS, other=T)
            t = (src % T).to(tl.int64)
            lone = (src < T) & (_routed_slots(expert_for_src_ptr, t, src < T, T, TOP_K) == 0)
            _store_final(final_ptr, final_bias_ptr, t, cols, lone, col_ok,
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC), stride_ft, stride_fh,
                         stride_fbt, stride_fbh, FINAL_BIAS)  # fmt: skip
        return
    row_ok = rows < row_end
    acc, _ = _mainloop(
        a_ptr, a_desc, w_ptr, w_desc, e, first_row, rows.to(tl.int64), row_ok, cols, cols, col_ok,
        n_tile * BLOCK_N, 0, KD, stride_am, stride_ak, stride_we, stride_wn, stride_wk, False,
        A_DESC, W_DESC, W_KMAJOR, EVEN_K, DOT_PRECISION, ACC, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc += tl.load(b_base + cols * stride_bn, mask=col_ok, other=0.0).to(ACC)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    src = tl.load(dest_to_src_ptr + rows, mask=row_ok, other=0)
    t = (src % T).to(tl.int64)
    if ORDERED:
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        # Every thread's stores of this tile are done before any row announces its arrival;
        # the counter's acq_rel then publishes them to, and orders them before, the last
        # arriver's reads (which go to L2: cache_modifier .cg, never a stale L1 line).
        tl.debug_barrier()
        n_tiles = tl.cdiv(N_OUT, BLOCK_N)
        arrived = tl.atomic_add(
            counter_ptr + t * n_tiles + n_tile, 1, mask=row_ok, sem="acq_rel", scope="gpu"
        )
        last = row_ok & (arrived == _routed_slots(expert_for_src_ptr, t, row_ok, T, TOP_K) - 1)
        n_last = tl.sum(last.to(tl.int32), axis=0)
        if n_last > 0:
            tl.debug_barrier()
            # About one row in K arrives last: compact those rows to the front (a sort of the
            # row positions, last rows first) and reduce them RED_M at a time, so the K-row
            # gather costs registers and instructions for those rows only.
            # Gathering over the whole tile spilled (docs/decisions.md, "Finalize path").
            pos = tl.arange(0, BLOCK_M)
            order = tl.sort(tl.where(last, pos, pos + BLOCK_M)) % BLOCK_M
            t_groups = tl.reshape(tl.gather(t, order, 0), [BLOCK_M // RED_M, RED_M])
            group = tl.arange(0, BLOCK_M // RED_M)
            for g in range(0, tl.cdiv(n_last, RED_M)):
                t_g = tl.sum(tl.where((group == g)[:, None], t_groups, 0), axis=0)
                ok_g = g * RED_M + tl.arange(0, RED_M) < n_last
                red = tl.zeros([RED_M, BLOCK_N], dtype=ACC)
                for j in range(TOP_K):  # the standalone kernel's sum, term by term
                    s_j = j * T + t_g
                    ok = ok_g & (tl.load(expert_for_src_ptr + s_j, mask=ok_g, other=-1) >= 0)
                    d_j = tl.load(src_to_dest_ptr + s_j, mask=ok, other=0).to(tl.int64)
                    w_j = tl.load(
                        weights_ptr + t_g * stride_wt + j * stride_wkk, mask=ok, other=0.0
                    )
                    yj_ptrs = y_ptr + d_j[:, None] * stride_ym + cols[None, :] * stride_yn
                    y_j = tl.load(yj_ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
                    red += tl.where(ok[:, None], w_j.to(ACC)[:, None] * y_j.to(ACC), 0.0)
                _store_final(final_ptr, final_bias_ptr, t_g, cols, ok_g, col_ok, red, stride_ft,
                             stride_fh, stride_fbt, stride_fbh, FINAL_BIAS)  # fmt: skip
    else:
        k = src // T
        w = tl.load(weights_ptr + t * stride_wt + k * stride_wkk, mask=row_ok, other=0.0)
        acc = acc * w.to(ACC)[:, None]
        tl.atomic_add(final_ptr + t[:, None] * stride_ft + cols[None, :] * stride_fh, acc,
                      mask=mask)  # fmt: skip


# --------------------------------------------------------------------------- launchers
_GEMM = ThinKernel(_gemm_kernel)
_GEMM_PERSISTENT = ThinKernel(_gemm_persistent_kernel)
_ACT_BWD = ThinKernel(_gemm_act_bwd_kernel)
_FINALIZE = ThinKernel(_gemm_finalize_kernel)


def _w_descriptor(w, bn, bk, use_tma):
    """``(w_desc, w_kmajor)`` for ``w [E, N, Kd]`` (n- or k-major), or ``(None, False)``."""
    if not use_tma or w.dtype not in TMA_DTYPES:
        return None, False
    if tma_ok(w):
        return descriptor(w, (1, bn, bk)), False
    # k-major storage (e.g. W2.transpose(1, 2) in the backward), seen through its transpose
    s_e, s_n, s_k = w.stride()
    if layout_ok(w, (s_e, s_k, s_n)):
        E, N, KD = w.shape
        return Descriptor(w, (E, KD, N), (s_e, s_k, s_n), (1, bk, bn)), True
    return None, False


def _gate_up_descriptor(w, n_out, bn, bk, interleaved):
    """``(w_desc, one_dot)`` reading a gated ``W1``'s gate and up rows of an n-tile in one TMA
    box (``_mainloop``'s ``ONE_DOT``), or ``(None, 0)``."""
    if w.dtype not in TMA_DTYPES or 2 * bn > 256:  # a TMA box side <= 256
        return None, 0
    if interleaved:
        return (descriptor(w, (1, 2 * bn, bk)), 2) if tma_ok(w) else (None, 0)
    # [E, 2, N_out, Kd]: gate rows, then up rows
    E, _, KD = w.shape
    s_e, s_n, s_k = w.stride()
    halves = (s_e, n_out * s_n, s_n, s_k)
    if not layout_ok(w, halves):
        return None, 0
    return Descriptor(w, (E, 2, n_out, KD), halves, (1, 2, bn, bk)), 1


def _a_descriptor(a, bm, bk, use_tma):
    if not use_tma or a.dtype not in TMA_DTYPES or not tma_ok(a):
        return None
    return descriptor(a, (bm, bk))


def _store_descriptors(out, z, epilogue: GemmEpilogue, cfg: GemmConfig, n_out: int,
                       stage_bytes: int):  # fmt: skip
    """``(out_desc, z_desc)`` for the persistent kernel's TMA stores, or ``(None, None)``
    where shared memory cannot hold the copies' staging beside the main loop's
    ``num_stages`` buffers (``stage_bytes`` each): one output tile, two when ``z``'s gate and
    up halves are stored too (``scripts/kernel_resources.py``: 213080 B for 3 stages of
    128x256x64 or of gated 128x128x64 with ``z``, no spills; 4 stages do not fit an H100).
    Only 16-bit tensors TMA can address, ``z`` not in the interleaved gate/up layout, fewer
    than 2^30 rows (32-bit coordinates)."""
    tile = cfg.block_m * cfg.block_n * out.element_size()
    staging = 2 * tile if z is not None and epilogue.gated else tile
    if cfg.num_stages * stage_bytes + staging + _SMEM_RESERVED > _smem_per_block(out.device):
        return None, None
    if not (out.dtype in TMA_DTYPES and tma_ok(out) and out.shape[0] < 2**30):
        return None, None
    if z is None:
        return bounded_rows_descriptor(out, (cfg.block_m, cfg.block_n)), None
    if z.dtype not in TMA_DTYPES or (epilogue.gated and epilogue.interleaved):
        return None, None
    if epilogue.gated:  # [M, 2, N_OUT]: a partial column tile of the gate half stops at N_OUT
        if not layout_ok(z, (z.stride(0), n_out * z.stride(1), z.stride(1))):
            return None, None
        z_desc = bounded_rows_descriptor(z, (cfg.block_m, 1, cfg.block_n), parts=2)
    elif tma_ok(z):
        z_desc = bounded_rows_descriptor(z, (cfg.block_m, cfg.block_n))
    else:
        return None, None
    return bounded_rows_descriptor(out, (cfg.block_m, cfg.block_n)), z_desc


#: Shared memory a kernel takes beside its buffers (barriers, alignment).
_SMEM_RESERVED = 1 << 10


def _smem_per_block(device: torch.device) -> int:
    """Shared memory one block may take on ``device`` (opt-in maximum; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return shared_memory_optin(cuda_index(device))


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    if dtype == torch.float64:
        return "fma"
    return "tf32" if allow_tf32 or dtype != torch.float32 else "ieee"


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _m_tiles(M: int, E: int, bm: int) -> int:
    # Σ_e cdiv(rows_e, bm) + cdiv(dropped, bm) <= cdiv(M, bm) + E + 1, whatever the routing.
    return cdiv(M, bm) + E + 1


#: The persistent kernel's stand-in SM count off CUDA (the interpreter): small, so that the
#: programs' tile loops wrap several times in the CPU tests.
CPU_SMS = 3


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); :data:`CPU_SMS` off CUDA."""
    if device.type != "cuda":
        return CPU_SMS
    return _cuda_sms(cuda_index(device))


#: ``GemmLaunch._descriptors``'s answer without TMA.
_NO_DESCRIPTORS = (None, None, False, 0, None, None)


class GemmLaunch:
    """GEMM1 / GEMM2's launch prepared from the operands' layout: dtypes, strides, shapes
    but ``M``, the config and epilogue, which optional operands there are. What a call of
    :func:`grouped_gemm_triton` works out before launching, kept by
    :func:`moe_route.grouped_gemm`'s call memo for every later call of that signature. The
    TMA descriptors (``cfg.use_tma``) depend on the addresses too: they are built per call.

    ``out`` / ``pre_activation``: given as tensors, or as ``None`` for a contiguous
    ``[M, N_out]`` output (what the callers allocate) and no pre-activation.
    """

    __slots__ = ("E", "cfg", "cx", "epilogue", "gather", "kd", "key", "n_out", "sms",
                 "static", "strides")  # fmt: skip

    def __init__(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None,
                 cfg: GemmConfig, epilogue: GemmEpilogue, bias: torch.Tensor | None,
                 gather: bool, pre_activation: torch.Tensor | None, allow_tf32: bool):  # fmt: skip
        E, n_w, kd = w.shape
        n_out = n_w // 2 if epilogue.gated else n_w
        self.E, self.kd, self.n_out, self.cfg, self.epilogue = E, kd, n_out, cfg, epilogue
        self.gather = gather
        out_dtype, so = (a.dtype, (n_out, 1)) if out is None else (out.dtype, out.stride())
        sz0 = so[0] if pre_activation is None else pre_activation.stride(0)
        # each stride tuple read once (a Tensor.stride() call per element costs more)
        sa, sw = a.stride(), w.stride()
        sb = bias.stride() if bias is not None else (0, 0)
        b_dtype = out_dtype if bias is None else bias.dtype
        store_pre = pre_activation is not None
        self.static = (
            cfg, epilogue, a.dtype, w.dtype, out_dtype, b_dtype, sa, sw, so, sz0,
            sb if bias is not None else None, gather, store_pre, allow_tf32, E, n_out, kd,
        )  # fmt: skip
        self.strides = (*sa, *sw, *so, sz0, *sb)
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, INTERLEAVED=epilogue.interleaved,
            HAS_BIAS=bias is not None, GATHER=gather, STORE_PRE=store_pre, ACC=_acc(a.dtype),
            DOT_PRECISION=_precision(a.dtype, allow_tf32), EVEN_K=kd % cfg.block_k == 0,
            E_POW2=next_pow2(E + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        self.sms = cfg.persistent * num_sms(a.device) if cfg.persistent else 0
        # without TMA nothing depends on the addresses: one key for every call
        self.key = None if cfg.use_tma else LaunchKey((*self.static, False, False, False, 0,
                                                       False, False))  # fmt: skip
        # (the key's last six fields: which descriptors a call has, as in __call__)

    def __call__(
        self, a, w, offsets, out, bias=None, dest_to_src=None, num_rows=None, pre_activation=None
    ) -> None:
        E, n_out, kd, cfg = self.E, self.n_out, self.kd, self.cfg
        M = a.shape[0] if num_rows is None else num_rows
        if M == 0 or n_out == 0:
            return
        bm = cfg.block_m
        key, descs = self.key, _NO_DESCRIPTORS
        if key is None:
            descs = self._descriptors(a, w, out, pre_activation)
            a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc = descs
            key = (*self.static, a_desc is not None, w_desc is not None, w_kmajor, one_dot,
                   out_desc is not None, z_desc is not None)  # fmt: skip
        a_desc, w_desc, _, _, out_desc, z_desc = descs
        m_tiles = _m_tiles(M, E, bm)
        tiles = m_tiles * cdiv(n_out, cfg.block_n)
        z = pre_activation if pre_activation is not None else out
        b = bias if bias is not None else out
        kernel, grid, extra = _GEMM, tiles, ()
        if cfg.persistent:
            kernel, grid = _GEMM_PERSISTENT, min(tiles, self.sms)
            extra = (out_desc if out_desc is not None else out,
                     z_desc if z_desc is not None else z)  # fmt: skip
        kernel.launch(
            key, (grid,),
            (
                a, a_desc if a_desc is not None else a, w, w_desc if w_desc is not None else w,
                out, z, *extra, b, offsets, dest_to_src if self.gather else offsets, E, M,
                m_tiles, n_out, kd, a.shape[0], *self.strides,
            ),
            lambda: self.constexprs(descs),
        )  # fmt: skip

    def _descriptors(self, a, w, out, pre_activation) -> tuple:
        """``(a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc)`` for this call's tensors."""
        cfg, epilogue, n_out = self.cfg, self.epilogue, self.n_out
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        a_desc = None if self.gather else _a_descriptor(a, bm, bk, cfg.use_tma)
        w_desc, w_kmajor, one_dot = None, False, 0
        if cfg.persistent and cfg.use_tma and epilogue.gated:
            # One accumulator of twice the width: two make ptxas serialise the wgmma
            # instructions (docs/decisions.md, "Gated GEMM1 accumulator").
            w_desc, one_dot = _gate_up_descriptor(w, n_out, bn, bk, epilogue.interleaved)
        if w_desc is None and not (epilogue.gated and epilogue.interleaved):
            w_desc, w_kmajor = _w_descriptor(w, bn, bk, cfg.use_tma)
        out_desc = z_desc = None
        if cfg.persistent and cfg.tma_store and cfg.use_tma:
            stage_bytes = (bm + (2 if epilogue.gated else 1) * bn) * bk * a.element_size()
            out_desc, z_desc = _store_descriptors(out, pre_activation, epilogue, cfg, n_out,
                                                  stage_bytes)  # fmt: skip
        return a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc

    def constexprs(self, descs: tuple) -> dict:
        a_desc, w_desc, w_kmajor, one_dot, out_desc, z_desc = descs
        cx = dict(self.cx, A_DESC=a_desc is not None, W_DESC=w_desc is not None,
                  W_KMAJOR=w_kmajor)  # fmt: skip
        cfg = self.cfg
        if cfg.persistent:
            # the automatic warp specialisation wants every load of the loop through TMA
            cx["WARP_SPECIALIZE"] = cfg.warp_specialize and cx["A_DESC"] and cx["W_DESC"]
            cx["ONE_DOT"] = one_dot
            cx["OUT_DESC"] = out_desc is not None
            cx["Z_DESC"] = z_desc is not None
        return cx


def grouped_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    *,
    epilogue: GemmEpilogue = IDENTITY,
    bias: torch.Tensor | None = None,
    dest_to_src: torch.Tensor | None = None,
    num_rows: int | None = None,
    pre_activation: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> None:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for the rows ``d`` of each expert ``e``.

    Args:
        a: ``[M, Kd]`` permuted rows, or ``x [T, Kd]`` read through ``dest_to_src`` (gather).
        w: ``[E, N, Kd]`` (``N = 2*N_out`` for gated activations), any strides.
        offsets: ``expert_first_token_offset [E+1]`` int64.
        out: ``[M, N_out]``.
        dest_to_src: ``expanded_dest_row_to_expanded_source_row``: ``a`` is then ``x`` and
            row ``d`` reads ``x[dest_to_src[d] mod T]`` (``x_perm`` never exists).
        num_rows: ``M = T*K`` (default ``a.shape[0]``).
        pre_activation: ``[M, N]`` contiguous rows; also write GEMM1's pre-activation there.

    ``cfg.persistent``: the persistent kernel on ``cfg.persistent * num_sms`` programs (at most
    the per-tile grid), the same output.
    """
    launch = GemmLaunch(a, w, out, cfg, epilogue, bias, dest_to_src is not None, pre_activation,
                        allow_tf32)  # fmt: skip
    launch(a, w, offsets, out, bias, dest_to_src, num_rows, pre_activation)


class ActBackwardLaunch:
    """The fused activation backward's launch (:func:`grouped_gemm_act_backward_triton`)
    prepared from its operands' layout (dtypes, strides, ``w2t``'s shape, the config and
    epilogue, whether ``dout`` comes permuted), kept among the backward launch sequence's
    prepared launches (:func:`.moe.prepared`). The TMA descriptors (``cfg.use_tma``) depend
    on the addresses too: they are built per call."""

    __slots__ = ("cfg", "cx", "key", "partial_dtype", "permuted", "shape", "static", "strides")

    def __init__(self, dout, w2t, z, topk_weights, wh, cfg: GemmConfig, *,
                 epilogue: GemmEpilogue, allow_tf32: bool = False,
                 permuted: bool = False):  # fmt: skip
        E, n_out, kd = self.shape = tuple(w2t.shape)
        self.cfg, self.permuted = cfg, permuted
        self.partial_dtype = torch.float64 if dout.dtype == torch.float64 else torch.float32
        sd, sw, sh, sz = dout.stride(), w2t.stride(), wh.stride(), z.stride()
        st = topk_weights.stride()
        self.static = (cfg, epilogue, dout.dtype, z.dtype, wh.dtype, topk_weights.dtype, sd, sw,
                       sh, sz[0], st, allow_tf32, E, n_out, kd, permuted)  # fmt: skip
        self.strides = (*sd, *sw, *sh, sz[0], *st)
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, INTERLEAVED=epilogue.interleaved, ACC=_acc(dout.dtype),
            DOT_PRECISION=_precision(dout.dtype, allow_tf32), A_PERMUTED=permuted,
            EVEN_K=kd % bk == 0, E_POW2=next_pow2(E + 1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=cfg.group_m, SPLIT_EPILOGUE=bm * bn >= 4096 and bn >= 32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        # without TMA nothing depends on the addresses: one key for every call
        self.key = None if cfg.use_tma else LaunchKey((*self.static, False, False, False))

    def __call__(self, dout, w2t, offsets, dest_to_src, z, topk_weights, wh, dz) -> torch.Tensor:
        E, n_out, kd = self.shape
        cfg = self.cfg
        M = z.shape[0]
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        partial = torch.empty(M, cdiv(n_out, bn), dtype=self.partial_dtype, device=dout.device)
        if M == 0 or n_out == 0:
            return partial
        key, w_desc, w_kmajor, a_desc = self.key, None, False, None
        if key is None:
            w_desc, w_kmajor = _w_descriptor(w2t, bn, bk, cfg.use_tma)
            a_desc = _a_descriptor(dout, bm, bk, cfg.use_tma) if self.permuted else None
            key = (*self.static, w_desc is not None, w_kmajor, a_desc is not None)
        m_tiles = _m_tiles(M, E, bm)
        _ACT_BWD.launch(
            key, (m_tiles * cdiv(n_out, bn),),
            (
                dout, a_desc if a_desc is not None else dout, w2t,
                w_desc if w_desc is not None else w2t, wh, z, dz, partial, topk_weights,
                offsets, dest_to_src, E, M, m_tiles, n_out, kd, topk_weights.shape[0],
                *self.strides,
            ),
            lambda: dict(self.cx, A_DESC=a_desc is not None, W_DESC=w_desc is not None,
                         W_KMAJOR=w_kmajor),
        )  # fmt: skip
        return partial


def grouped_gemm_act_backward_triton(
    dout: torch.Tensor,
    w2t: torch.Tensor,
    offsets: torch.Tensor,
    dest_to_src: torch.Tensor,
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    wh: torch.Tensor,
    dz: torch.Tensor,
    cfg: GemmConfig,
    *,
    epilogue: GemmEpilogue,
    allow_tf32: bool = False,
    permuted: bool = False,
) -> torch.Tensor:
    """GEMM2's backward with the activation's backward; see the module docstring.

    ``dout [T, H]`` (gathered; with ``permuted``, ``[M, H]`` already in the permuted order,
    read through TMA where ``cfg.use_tma``), ``w2t = W2.transpose(1, 2)`` (``[E, I, H]``),
    ``z`` GEMM1's pre-activation ``[M, 2I or I]``, ``dz`` laid out like ``z``; writes
    ``wh = w[t,k]·act(z)`` ``[M, I]`` and ``dz`` (zero in dropped rows). Returns the partial
    router-weight gradients ``[M, cdiv(I, BLOCK_N)]`` float32 (float64 for float64).
    """
    launch = ActBackwardLaunch(dout, w2t, z, topk_weights, wh, cfg, epilogue=epilogue,
                               allow_tf32=allow_tf32, permuted=permuted)  # fmt: skip
    return launch(dout, w2t, offsets, dest_to_src, z, topk_weights, wh, dz)


def grouped_gemm_finalize_triton(
    h: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    *,
    ordered: bool,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    allow_tf32: bool = False,
) -> None:
    """GEMM2 with the finalize in its epilogue, into ``out [T, H]``.

    ``ordered``: deterministic, ``out`` in the activations' dtype, ``bias`` ``[H]`` or
    ``[T, H]`` added once. Otherwise ``out`` is a float32 (float64) accumulator the caller has
    initialised with the bias or zeros, added into with atomics.
    """
    E, n_out, kd = w2.shape
    M = h.shape[0]
    T, K = topk_weights.shape
    if n_out == 0 or T == 0:
        return
    if M == 0:  # no rows at all: out = bias or zeros
        if ordered:
            out.copy_(bias.expand(out.shape) if bias is not None else torch.zeros_like(out))
        return
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_desc = _a_descriptor(h, bm, bk, cfg.use_tma)
    w_desc, w_kmajor = _w_descriptor(w2, bn, bk, cfg.use_tma)
    m_tiles = _m_tiles(M, E, bm)
    y = h.new_empty(M, n_out) if ordered else out  # the ordered epilogue's scratch rows
    counter = out
    if ordered:
        counter = torch.zeros(T, cdiv(n_out, bn), dtype=torch.int32, device=h.device)
    fb = bias if bias is not None else out
    sfbt, sfbh = (
        (0, 0) if bias is None else (0, bias.stride(0)) if bias.dim() == 1 else bias.stride()
    )
    b = b2 if b2 is not None else out
    key = (
        cfg, ordered, h.dtype, w2.dtype, out.dtype, b.dtype, fb.dtype, topk_weights.dtype,
        h.stride(), w2.stride(), out.stride(), b.stride() if b2 is not None else None,
        (sfbt, sfbh), topk_weights.stride(), a_desc is not None, w_desc is not None, w_kmajor,
        allow_tf32, E, n_out, kd, K,
    )  # fmt: skip
    _FINALIZE.launch(
        key, (m_tiles * cdiv(n_out, bn),),
        (
            h, a_desc if a_desc is not None else h, w2, w_desc if w_desc is not None else w2, y, b,
            offsets, dest_to_src, topk_weights, out, counter, src_to_dest, expert_for_src, fb, E,
            M, m_tiles, n_out, kd, T, h.stride(0), h.stride(1), w2.stride(0), w2.stride(1),
            w2.stride(2), y.stride(0), y.stride(1), b.stride(0) if b2 is not None else 0,
            b.stride(1) if b2 is not None else 0, topk_weights.stride(0), topk_weights.stride(1),
            out.stride(0), out.stride(1), sfbt, sfbh,
        ),
        lambda: dict(
            ORDERED=ordered, HAS_BIAS=b2 is not None, FINAL_BIAS=ordered and bias is not None,
            TOP_K=K if ordered else 1, ACC=_acc(h.dtype),
            DOT_PRECISION=_precision(h.dtype, allow_tf32), A_DESC=a_desc is not None,
            W_DESC=w_desc is not None, W_KMAJOR=w_kmajor, EVEN_K=kd % bk == 0,
            E_POW2=next_pow2(E + 1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=cfg.group_m, RED_M=min(bm, RED_ROWS), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
    )  # fmt: skip

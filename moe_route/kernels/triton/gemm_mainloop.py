"""What every grouped GEMM kernel shares: configs, tile-to-expert search, main loop, helpers.

Grouped GEMM over expert-grouped rows, one launch for all experts. Rows of expert ``e`` are
``[offset[e], offset[e+1])`` of the permuted order; they are cut into ``BLOCK_M``-row *m-tiles*,
numbered expert after expert. Each program finds the expert of its m-tile from
``expert_first_token_offset`` itself (:func:`_tile_expert`: a prefix sum of the experts' tile
counts, in registers), so nothing is launched or stored before the GEMM. The grid is an upper
bound that depends only on ``T*K`` and the tile sizes (``min(cdiv(T*K, BLOCK_M) + E + 1,
T*K)`` m-tiles), never on the routing: programs past the last real m-tile exit at once, and an
expert with no rows owns no m-tile. No host synchronisation, no per-expert launch. Program
``pid`` computes the ``[BLOCK_M, BLOCK_N]`` tile ``(m_tile, n_tile)``, m-tiles grouped
``GROUP_M`` at a time so that consecutive programs reuse the same weight columns in L2.

The main loop (:func:`_mainloop`) is shared; each kernel family owns one epilogue, in its own
module with its launcher:

* :mod:`.grouped_gemm` — GEMM1 and GEMM2 (bias, activation, pre-activation), per-tile and
  persistent (:class:`~.grouped_gemm.GemmLaunch`);
* :mod:`.gemm_act_backward` — GEMM2's backward with the activation's backward in its epilogue
  (:class:`~.gemm_act_backward.ActBackwardLaunch`);
* :mod:`.gemm_finalize` — GEMM2 with the finalize in its epilogue.

The quantised GEMM (:mod:`.quant`), the decode kernels (:mod:`.decode`), the weight gradients
(:mod:`.weight_grad`) and the row pass (:mod:`.act_backward`) use the helpers here too.

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

from ..._env import comm_sms
from . import cdiv, cuda_index, launch_key_part
from .tma import TMA_DTYPES, Descriptor, descriptor, layout_ok, tma_ok

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
    #: GEMM1 / GEMM2 (:func:`.grouped_gemm.grouped_gemm_triton`) only: programs per SM of the
    #: persistent kernel (0: one program per tile). The other kernels take the per-tile grid
    #: whatever this says.
    persistent: int = 0
    #: With ``persistent`` and every operand read through TMA: a warp-specialised loop.
    warp_specialize: bool = False
    #: With ``persistent`` and ``use_tma`` (GEMM1 / GEMM2): the output and the pre-activation
    #: stored through TMA (asynchronous, overlapping the next tile's main loop) where shared
    #: memory holds their staging beside the main loop's stages.
    tma_store: bool = False
    #: Quantised 16-row tiles (FP8): the weights as the product's first operand (the tokens
    #: the narrow side), so that SM90 runs FP8 MMAs on the codes as they are.
    swap_ab: bool = False


@launch_key_part
@dataclass(frozen=True)
class GemmEpilogue:
    """What GEMM1's epilogue computes: the activation and its parameters, the layout.

    Built from a :class:`moe_route.activations.Activation` by
    :func:`moe_route.plan.epilogue_for`; every field is a constexpr of the kernels
    (and part of their launch key)."""

    #: element-wise kind's code (:data:`moe_route.activations.KIND_CODES`).
    act: int = 0
    gated: bool = False
    interleaved: bool = False
    #: silu's slope: ``x · sigmoid(alpha · x)``.
    alpha: float = 1.0
    #: clamp of gate (from above) and up (both sides) of a gated activation; ``0.0``: none.
    limit: float = 0.0
    #: added to the clamped (and soft-capped) up.
    up_offset: float = 0.0
    #: silu's linear factor soft-capped, ``c·tanh(gate/c) · sigmoid(alpha·gate)``; ``0.0``: none.
    gate_softcap: float = 0.0
    #: up soft-capped, ``c·tanh(up/c)``, before ``up_offset``; ``0.0``: none.
    up_softcap: float = 0.0


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
def _expert_ends(offsets_ptr, E, ex, BLOCK_M: tl.constexpr):
    """The first m-tile after each expert (lanes ``ex = arange(E_POW2)``; the lanes past ``E``
    hold the number of routed m-tiles): a prefix sum of the experts' tile counts, in
    registers. The lanes come from the caller, whose language picks their layout (Gluon)."""
    lo = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
    hi = tl.load(offsets_ptr + ex + 1, mask=ex < E, other=0)
    return tl.cumsum(((hi - lo + BLOCK_M - 1) // BLOCK_M).to(tl.int32), 0)


@triton.jit
def _expert_at(ends, at, span, E, ex, E_POW2: tl.constexpr):
    """``(e, start)``: the expert whose tiles hold flat index ``at`` where each m-tile spans
    ``span`` consecutive indices, and its first m-tile (``ends`` from :func:`_expert_ends`).

    The experts whose tiles all come before ``at`` are a prefix (``ends`` never decreases), of
    length ``e``; the last of them ends where ``at``'s expert starts. One reduction finds both:
    the largest ``(end, index + 1)`` pair of that prefix, packed (``index + 1 < E_POW2``)."""
    before = (ends * span <= at) & (ex < E)
    key = tl.max(tl.where(before, ends.to(tl.int64) * E_POW2 + ex + 1, 0), axis=0)
    return (key % E_POW2).to(tl.int32), key // E_POW2


@triton.jit
def _find_expert(offsets_ptr, ends, m_tile, E, ex, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """``(e, first_row, row_end)`` of m-tile ``m_tile`` from :func:`_expert_ends`; ``e == E``
    past the routed tiles (``first_row`` is then the first row of this dropped-row tile)."""
    e, start = _expert_at(ends, m_tile, 1, E, ex, E_POW2)
    first_row = tl.load(offsets_ptr + e) + (m_tile - start) * BLOCK_M
    row_end = tl.load(offsets_ptr + tl.minimum(e + 1, E))
    return e, first_row, row_end


@triton.jit
def _expert_grouped_tile(offsets_ptr, ends, tile, n_tiles, E, ex, BLOCK_M: tl.constexpr,
                         GROUP_M: tl.constexpr, E_POW2: tl.constexpr):  # fmt: skip
    """``(e, first_row, row_end, n_tile)`` of routed tile ``tile`` in the expert-grouped order:
    expert after expert (tiles ``[start_e * n_tiles, end_e * n_tiles)`` for the m-tiles
    ``[start_e, end_e)`` of :func:`_expert_ends`), each expert's ``m_e`` m-tiles cut into
    ``cdiv(m_e, GROUP_M)`` groups of near-equal size, each group sweeping every n-tile.

    A group never mixes experts, so the programs running at once read one expert's weight
    columns, each once per group. (:func:`_swizzle`'s fixed groups of ``GROUP_M`` consecutive
    m-tiles straddle experts wherever a count of rows is not a multiple of ``BLOCK_M``: the
    straddled experts' columns are then read once per group they are in.)"""
    e, start = _expert_at(ends, tile, n_tiles, E, ex, E_POW2)
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
    return _tile_expert_lanes(offsets_ptr, m_tile, E, tl.arange(0, E_POW2), BLOCK_M, E_POW2)


@triton.jit
def _tile_expert_lanes(offsets_ptr, m_tile, E, ex, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """:func:`_tile_expert` on the caller's lanes ``ex = arange(E_POW2)``."""
    ends = _expert_ends(offsets_ptr, E, ex, BLOCK_M)
    return _find_expert(offsets_ptr, ends, m_tile, E, ex, BLOCK_M, E_POW2)


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


# --------------------------------------------------------------------------- host helpers
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


def _gate_up_descriptor(w, n_out, bn, bk, interleaved, dtypes=TMA_DTYPES):
    """``(w_desc, one_dot)`` reading a gated ``W1``'s gate and up rows of an n-tile in one TMA
    box (``_mainloop``'s ``ONE_DOT``), or ``(None, 0)``; ``w`` of one of ``dtypes``."""
    if w.dtype not in dtypes or 2 * bn > 256:  # a TMA box side <= 256
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


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    if dtype == torch.float64:
        return "fma"
    return "tf32" if allow_tf32 or dtype != torch.float32 else "ieee"


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _m_tiles(M: int, E: int, bm: int) -> int:
    # Σ_e cdiv(rows_e, bm) + cdiv(dropped, bm) <= cdiv(M, bm) + E + 1, whatever the routing;
    # and every m-tile holds a row, so there are at most M of them. The second bound matters
    # at decode sizes: at M = 8 rows over 256 experts the first launches 258 m-tiles per
    # n-tile, 250 of them programs that exit at once but are scheduled all the same
    # (docs/decisions.md, "Grid bound at decode sizes").
    return min(cdiv(M, bm) + E + 1, M)


#: The persistent kernel's stand-in SM count off CUDA (the interpreter): small, so that the
#: programs' tile loops wrap several times in the CPU tests.
CPU_SMS = 3


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` the persistent kernels spread over (cached per
    device) less ``MOE_ROUTE_COMM_SMS`` (:func:`moe_route._env.comm_sms`); :data:`CPU_SMS` off
    CUDA."""
    if device.type != "cuda":
        return CPU_SMS
    return max(_cuda_sms(cuda_index(device)) - comm_sms(), 1)

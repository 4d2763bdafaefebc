"""The weight gradients: reductions over an expert's rows.

For every expert (:func:`expert_weight_grad_triton`) ``e`` with rows
``[offset[e], offset[e+1])`` of the permuted order,

    dW[e] = Σ_d A[d]^T B[d]   ([N, Kd])        db[e] = Σ_d A[d]   ([N])

Program ``(tile, e)`` owns one ``[BLOCK_N, BLOCK_K]`` tile of ``dW[e]`` and walks the expert's
rows ``BLOCK_R`` at a time in ascending order, accumulating ``A^T B`` in float32 (float64 for
float64 inputs) and rounding once. Every output element has one owner and a fixed summation
order: no atomics, the same bits on every run; an expert with no rows gets exact zeros.
``A`` and ``B`` rows can be read through the maps (``row = dest_to_src[d] mod T``) so that
neither ``dout`` nor ``x`` is permuted in memory (at the smallest sizes, where an expand's
launch costs more than the gather; from a quarter of a row per expert the gather's reads cost
5-24 %, so ``WeightGradConfig.permuted`` has the launch sequence expand first), and ``A`` rows
can be scaled by the router weight of their slot for the bias gradient, the column sum of the
``A`` tiles taken by the programs of the first ``Kd`` tile. (``dW2 = Σ dout[t]^T (w h)``:
GEMM2's backward writes ``w·h``, so no MMA operand is rescaled here.) On Hopper the operand
that is not gathered is loaded through TMA.

On Hopper with 16-bit operands the launch sequence permutes the gathered operand into a buffer
first (one expand, ~1 % of the GEMM's time) and :func:`_expert_weight_grad_tma_kernel` reads
both operands through TMA: the rows of an expert are walked in whole ``BLOCK_R`` steps through
descriptors whose bounds end at the expert's last row (:mod:`.tma`), so
the partial last step reads zeros past it and no row of another expert enters a sum; every
step is the same software-pipelined code, the MMA reading shared memory directly.

The router-weight gradient, the other reduction of the backward, is in :mod:`.router_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import INTERPRETING, LaunchKey, ThinKernel, cdiv, launch_key_part
from .gemm_mainloop import _acc, _mma, _precision, num_sms
from .tma import TMA_DTYPES, bounded_rows_descriptor, descriptor, load_rows, tma_ok


@launch_key_part
@dataclass(frozen=True)
class WeightGradConfig:
    """Tiles of the weight-gradient kernels (chosen by :mod:`moe_route.tuning`)."""

    #: rows of the expert reduced per step
    block_r: int
    #: the output tile, ``[block_n, block_k]`` of ``dW[e]``
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: both operands through TMA (SM90+, 16-bit, aligned, neither gathered): the launch
    #: sequence permutes a gathered operand into a buffer first
    use_tma: bool = False
    #: the TMA kernel only: programs per SM walking the tiles (0: one program per tile)
    persistent: int = 0
    #: the TMA kernel only: consecutive tiles step along ``Kd`` (else along ``N``)
    k_fastest: bool = True
    #: the TMA kernel only: one loop over all (tile, row step) pairs of a program, the next
    #: tile's loads overlapping the current tile's last steps (else a loop per tile)
    flat: bool = False
    #: the TMA kernel only: ``dW`` written through a TMA store where it allows one (else
    #: through pointer stores marked evict-first, as the pointer kernel writes it)
    tma_store: bool = True
    #: the pointer kernel: the launch sequence permutes a gathered operand into a buffer first
    #: (an expand), as for the TMA kernel, instead of the kernel gathering its rows through
    #: the maps
    permuted: bool = False


@triton.jit
def _scaled_col_sum(col_sum, a, r, r_ok, dest_to_src_ptr, scale_ptr, T, stride_st, stride_sk,
                    A_SCALE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``col_sum + Σ_rows s_r a[r]`` (``s_r`` the router weight of row ``r``'s slot, else 1)."""
    if A_SCALE:
        src = tl.load(dest_to_src_ptr + r, mask=r_ok, other=0)
        t = (src % T).to(tl.int64)
        w = tl.load(scale_ptr + t * stride_st + (src // T) * stride_sk, mask=r_ok, other=0)
        col_sum += tl.sum(a.to(ACC) * w.to(ACC)[:, None], axis=0)
    else:
        col_sum += tl.sum(tl.where(r_ok[:, None], a.to(ACC), 0.0), axis=0)
    return col_sum


@triton.jit
def _store_dw(dw_ptr, dw_desc, db_ptr, acc, col_sum, e, n0, k0, pid_k, N, KD, stride_we,
              stride_wn, stride_wk, stride_dbe, stride_dbn, HAS_DBIAS: tl.constexpr,
              DW_DESC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The tile of ``dW[e]`` (through ``dw_desc`` with ``DW_DESC``: an asynchronous store, the
    program moves on to its next tile meanwhile) and, from the first ``Kd`` tile, ``db[e]``.

    The pointer stores are marked evict-first: ``dW`` is written once and not read here, and
    its lines then leave L2 before the operand rows that the next tiles read again."""
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    if DW_DESC:
        dw_desc.store([e, n0, k0], acc.to(dw_desc.dtype).reshape(1, BLOCK_N, BLOCK_K))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < KD
        dw_ptrs = (
            dw_ptr + e.to(tl.int64) * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk
        )
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :],
                 eviction_policy="evict_first")  # fmt: skip
    if HAS_DBIAS:  # noqa: SIM102 (a constexpr test, then a run-time one)
        if pid_k == 0:
            db_ptrs = db_ptr + e.to(tl.int64) * stride_dbe + ns * stride_dbn
            tl.store(db_ptrs, col_sum.to(db_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["T"])
def _expert_weight_grad_kernel(
    a_ptr, b_ptr, dw_ptr, db_ptr, offsets_ptr, dest_to_src_ptr, scale_ptr, N, KD, T,
    stride_am, stride_an, stride_bm, stride_bk, stride_we, stride_wn, stride_wk, stride_dbe,
    stride_dbn, stride_st, stride_sk,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, A_SCALE: tl.constexpr,
    HAS_DBIAS: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program ``(n-tile x k-tile, e)``: one tile of ``dW[e]``, rows through pointers (gathered
    through the maps where asked)."""
    k_tiles = tl.cdiv(KD, BLOCK_K)
    pid_n = tl.program_id(0) // k_tiles
    pid_k = tl.program_id(0) % k_tiles
    e = tl.program_id(1)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < KD
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=ACC)
    col_sum = tl.zeros([BLOCK_N], dtype=ACC)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < hi
        if A_GATHER or B_GATHER:
            t = (tl.load(dest_to_src_ptr + r, mask=r_ok, other=0) % T).to(tl.int64)
        a_rows = t if A_GATHER else r.to(tl.int64)
        b_rows = t if B_GATHER else r.to(tl.int64)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ns[None, :] * stride_an,
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if HAS_DBIAS:
            col_sum = _scaled_col_sum(col_sum, a, r, r_ok, dest_to_src_ptr, scale_ptr, T,
                                      stride_st, stride_sk, A_SCALE, ACC)  # fmt: skip
        b = tl.load(
            b_ptr + b_rows[:, None] * stride_bm + ks[None, :] * stride_bk,
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = _mma(tl.trans(a), b, acc, DOT_PRECISION)
    _store_dw(dw_ptr, dw_ptr, db_ptr, acc, col_sum, e, pid_n * BLOCK_N, pid_k * BLOCK_K, pid_k, N,
              KD, stride_we, stride_wn, stride_wk, stride_dbe, stride_dbn, HAS_DBIAS, False,
              BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _tiles_of(end, pid, programs):
    """How many of the tiles ``pid, pid + P, ...`` lie below ``end`` (``P = programs``)."""
    return tl.cdiv(tl.maximum(end - pid, 0), programs)


@triton.jit
def _program_steps(offsets_ptr, pid, programs, E, per_expert, BLOCK_R: tl.constexpr,
                   BLOCK_E: tl.constexpr):  # fmt: skip
    """Row steps of every tile program ``pid`` owns: an expert's tiles take
    ``cdiv(rows, BLOCK_R)`` steps each, one at least (an empty expert's tiles store zeros)."""
    total = 0
    for e0 in range(0, E, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        ok = es < E
        lo = tl.load(offsets_ptr + es, mask=ok, other=0)
        hi = tl.load(offsets_ptr + es + 1, mask=ok, other=0)
        steps = tl.maximum(tl.cdiv(hi - lo, BLOCK_R), 1).to(tl.int32)
        first = es * per_expert
        mine = _tiles_of(first + per_expert, pid, programs) - _tiles_of(first, pid, programs)
        total += tl.sum(tl.where(ok, mine * steps, 0))
    return total


@triton.jit
def _read_offset(ptr, ASM: tl.constexpr):
    """``*ptr`` (an int64 offset). ``ASM``: through inline PTX, which the software pipeliner
    does not see as a load; with a ``tl.load`` there, Triton 3.5 and 3.6 leave the flat loop
    below unpipelined (sm_90 TTGIR: each TMA load waited on in its own iteration)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=tl.int64, is_pure=True, pack=1)  # fmt: skip
    else:
        return tl.load(ptr)


@triton.jit
def _tile_of(tile, per_expert, n_tiles, k_tiles, K_FASTEST: tl.constexpr):
    """``(e, n-tile, k-tile)`` of tile ``tile``: consecutive tiles step along ``Kd``
    (``K_FASTEST``) or along ``N``."""
    e = tile // per_expert
    if K_FASTEST:
        pid_n = (tile % per_expert) // k_tiles
        pid_k = tile % k_tiles
    else:
        pid_k = (tile % per_expert) // n_tiles
        pid_n = tile % n_tiles
    return e, pid_n, pid_k


@triton.jit
def _row_step(a_desc, b_desc, acc, col_sum, lo, size, i, n0, k0, dest_to_src_ptr, scale_ptr, T,
              stride_st, stride_sk, A_SCALE: tl.constexpr, HAS_DBIAS: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc += A^T B`` (and the bias gradient's column sum) over rows ``lo + i ..`` of the
    expert's rows ``[lo, lo + size)``."""
    a = load_rows(a_desc, lo, size, i, n0, BLOCK_R, BLOCK_N)
    b = load_rows(b_desc, lo, size, i, k0, BLOCK_R, BLOCK_K)
    if HAS_DBIAS:
        r = lo + i + tl.arange(0, BLOCK_R)
        col_sum = _scaled_col_sum(col_sum, a, r, r < lo + size, dest_to_src_ptr, scale_ptr, T,
                                  stride_st, stride_sk, A_SCALE, tl.float32)  # fmt: skip
    return tl.dot(a.T, b, acc), col_sum


@triton.jit(do_not_specialize=["E", "T"])
def _expert_weight_grad_tma_kernel(
    a_desc, b_desc, dw_desc, dw_ptr, db_ptr, offsets_ptr, dest_to_src_ptr, scale_ptr, E, T,
    stride_we, stride_wn, stride_wk, stride_dbe, stride_dbn, stride_st, stride_sk,
    N: tl.constexpr, KD: tl.constexpr, A_SCALE: tl.constexpr, HAS_DBIAS: tl.constexpr,
    DW_DESC: tl.constexpr, K_FASTEST: tl.constexpr, FLAT: tl.constexpr, ASM_OFFSETS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Tiles ``pid, pid + P, ...`` of ``E x n-tiles x k-tiles`` (``P`` programs; one tile each
    when ``P`` is the tile count), each ``[BLOCK_N, BLOCK_K]`` of ``dW[e]``: the expert's rows
    in ``BLOCK_R`` steps through bounded descriptors, whose bounds check at the expert's last
    row zero-fills the partial last step, so every step is the same software-pipelined code.

    Two loop shapes (``FLAT``):

    - a loop over the tiles, each running a loop over its row steps: every tile starts with
      an empty pipeline, which long reductions (Mixtral's ~1024 rows per expert) amortise;
    - one flat loop over every (tile, row step) pair of the program, the tile's store inside
      it after its last step, so the pipeline loads the next tile's first steps while the
      current tile's last ones multiply (short reductions: 128-512 rows per expert). The step
      count comes first (:func:`_program_steps`). The loop's state advances at the top of the
      body, the offsets are read through :func:`_read_offset`, and the store's condition tests
      ``size``, not the loop-carried step count: otherwise the pipeliner keeps the loop in one
      stage (sm_90 TTGIR, Triton 3.5).

    ``N`` and ``KD`` (the weight's shape, fixed for a model; already part of the launch key)
    are compile-time constants, so that the tile index's division into ``(e, n-tile, k-tile)``,
    redone at every row step of the flat loop, is a multiply and shift rather than an integer
    division: ~45 fewer instructions per step, where a program issues one instruction every
    ~4 cycles (docs/decisions.md, "Weight-gradient tiles").

    Consecutive tiles step along ``Kd`` (``K_FASTEST``) or along ``N`` (the tuning picks:
    along the dimension with fewer tiles, the programs running at once share the other
    operand's slices in L2; along ``Kd``, ``dW`` is written in order)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(KD, BLOCK_K)
    per_expert = n_tiles * k_tiles
    if FLAT:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        total = _program_steps(offsets_ptr, pid, programs, E, per_expert, BLOCK_R, BLOCK_E)
        tile = pid - programs
        step = 0  # steps of the current tile so far, this one included
        steps = 0  # steps the current tile takes
        for _ in range(total):
            new_tile = step == steps
            tile = tl.where(new_tile, tile + programs, tile)
            step = tl.where(new_tile, 1, step + 1)
            e, pid_n, pid_k = _tile_of(tile, per_expert, n_tiles, k_tiles, K_FASTEST)
            # The pipeliner's prologue works out the next step's tile ahead, even past the
            # program's last step, and the inline-PTX reads are not predicated: the expert
            # they read is clamped into ``offsets`` (a real step's is below E already).
            e_read = tl.minimum(e, E - 1)
            # int32 rows: TMA coordinates are 32-bit (M = T*K < 2^31 rows)
            lo = _read_offset(offsets_ptr + e_read, ASM_OFFSETS).to(tl.int32)
            size = _read_offset(offsets_ptr + e_read + 1, ASM_OFFSETS).to(tl.int32) - lo
            steps = tl.maximum(tl.cdiv(size, BLOCK_R), 1)
            i = (step - 1) * BLOCK_R
            acc, col_sum = _row_step(a_desc, b_desc, acc, col_sum, lo, size, i,
                                     pid_n * BLOCK_N, pid_k * BLOCK_K, dest_to_src_ptr,
                                     scale_ptr, T, stride_st, stride_sk, A_SCALE, HAS_DBIAS,
                                     BLOCK_R, BLOCK_N, BLOCK_K)  # fmt: skip
            if i + BLOCK_R >= size:  # the tile's last step (step == steps)
                _store_dw(dw_ptr, dw_desc, db_ptr, acc, col_sum, e, pid_n * BLOCK_N,
                          pid_k * BLOCK_K, pid_k, N, KD, stride_we, stride_wn, stride_wk,
                          stride_dbe, stride_dbn, HAS_DBIAS, DW_DESC, BLOCK_N,
                          BLOCK_K)  # fmt: skip
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        for tile in range(pid, E * per_expert, programs):
            e, pid_n, pid_k = _tile_of(tile, per_expert, n_tiles, k_tiles, K_FASTEST)
            lo = tl.load(offsets_ptr + e).to(tl.int32)
            size = tl.load(offsets_ptr + e + 1).to(tl.int32) - lo
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
            for i in range(0, size, BLOCK_R):
                acc, col_sum = _row_step(a_desc, b_desc, acc, col_sum, lo, size, i,
                                         pid_n * BLOCK_N, pid_k * BLOCK_K, dest_to_src_ptr,
                                         scale_ptr, T, stride_st, stride_sk, A_SCALE,
                                         HAS_DBIAS, BLOCK_R, BLOCK_N, BLOCK_K)  # fmt: skip
            _store_dw(dw_ptr, dw_desc, db_ptr, acc, col_sum, e, pid_n * BLOCK_N,
                      pid_k * BLOCK_K, pid_k, N, KD, stride_we, stride_wn, stride_wk,
                      stride_dbe, stride_dbn, HAS_DBIAS, DW_DESC, BLOCK_N,
                      BLOCK_K)  # fmt: skip


def tma_operands_ok(*tensors: torch.Tensor) -> bool:
    """Whether :func:`_expert_weight_grad_tma_kernel` can read these operands (16-bit, unit
    column stride, 16-byte aligned rows)."""
    return all(t.dtype in TMA_DTYPES and tma_ok(t) for t in tensors)


class WeightGradLaunch:
    """The weight gradient's launch prepared from its operands' layout (dtypes, strides,
    which operands are gathered, scaled, whether there is a bias gradient), ``dw``'s shape and
    the config: what a call of :func:`expert_weight_grad_triton` works out before launching,
    kept among the backward launch sequence's prepared launches (:func:`.moe.prepared`).
    Which kernel runs is asked per call (the TMA kernel needs 16-byte aligned operands)."""

    __slots__ = ("config", "cx", "db_strides", "gather", "key", "scale_strides", "shape",
                 "strides", "tma", "tma_cx", "tma_key")  # fmt: skip

    def __init__(self, a, b, dw, config: WeightGradConfig, *, db=None, a_gather=False,
                 b_gather=False, db_scale=None, allow_tf32=False):  # fmt: skip
        _, N, KD = self.shape = dw.shape
        c = self.config = config
        self.gather = (a_gather, b_gather)
        scale = db_scale if db_scale is not None else dw
        dbt = db if db is not None else dw
        self.db_strides = (db.stride(0), db.stride(1)) if db is not None else (0, 0)
        self.scale_strides = (scale.stride(0), scale.stride(1)) if db_scale is not None else (0, 0)
        self.tma = c.use_tma and not (a_gather or b_gather)
        sa, sb, sw = a.stride(), b.stride(), dw.stride()
        has_db, a_scale = db is not None, db_scale is not None
        self.strides = (*sa, *sb, *sw)
        # what both kernels' keys hold: the operands' dtypes and strides, the config
        layouts = (c, a.dtype, b.dtype, dw.dtype, dbt.dtype, scale.dtype, sa, sb, sw,
                   dbt.stride(), scale.stride())  # fmt: skip
        self.key = LaunchKey((*layouts, a_gather, b_gather, a_scale, has_db, allow_tf32, N, KD))
        self.cx = dict(
            A_GATHER=a_gather, B_GATHER=b_gather, A_SCALE=a_scale, HAS_DBIAS=has_db,
            ACC=_acc(a.dtype), DOT_PRECISION=_precision(a.dtype, allow_tf32), BLOCK_R=c.block_r,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
            num_stages=c.num_stages,
        )  # fmt: skip
        self.tma_key = self.tma_cx = None
        if self.tma:
            dw_tma = c.tma_store and tma_operands_ok(dw)
            self.tma_key = LaunchKey((*layouts, has_db, a_scale, N, KD, dw_tma))
            self.tma_cx = dict(
                N=N, KD=KD, A_SCALE=a_scale, HAS_DBIAS=has_db, DW_DESC=dw_tma,
                K_FASTEST=c.k_fastest, FLAT=c.flat, ASM_OFFSETS=not INTERPRETING,
                BLOCK_R=c.block_r, BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_E=_BLOCK_E,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip

    def __call__(self, a, b, offsets, dw, db=None, dest_to_src=None, db_scale=None,
                 num_rows: int = 0) -> None:  # fmt: skip
        E, N, KD = self.shape
        if N == 0 or KD == 0:
            return
        a_gather, b_gather = self.gather
        T = a.shape[0] if a_gather else b.shape[0] if b_gather else max(num_rows, 1)
        if db_scale is not None:
            T = db_scale.shape[0]
        idx = dest_to_src if dest_to_src is not None else offsets
        scale = db_scale if db_scale is not None else dw
        dbt = db if db is not None else dw
        c = self.config
        if self.tma and a.shape[0] and b.shape[0] and tma_operands_ok(a, b):
            sw = dw.stride()
            programs = tiles = E * cdiv(N, c.block_n) * cdiv(KD, c.block_k)
            if c.persistent:
                programs = min(tiles, c.persistent * num_sms(a.device))
            dw_desc = descriptor(dw, (1, c.block_n, c.block_k)) if self.tma_cx["DW_DESC"] else dw
            _WEIGHT_GRAD_TMA.launch(
                self.tma_key, (programs,),
                (
                    bounded_rows_descriptor(a, (c.block_r, c.block_n)),
                    bounded_rows_descriptor(b, (c.block_r, c.block_k)), dw_desc, dw, dbt,
                    offsets, idx, scale, E, max(T, 1), *sw, *self.db_strides,
                    *self.scale_strides,
                ),
                self.tma_constexprs,
            )  # fmt: skip
            return
        _WEIGHT_GRAD.launch(
            self.key, (cdiv(N, c.block_n) * cdiv(KD, c.block_k), E),
            (a, b, dw, dbt, offsets, idx, scale, N, KD, max(T, 1), *self.strides,
             *self.db_strides, *self.scale_strides),
            self.constexprs,
        )  # fmt: skip

    def constexprs(self) -> dict:
        return dict(self.cx)

    def tma_constexprs(self) -> dict:
        return dict(self.tma_cx)


def expert_weight_grad_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    dw: torch.Tensor,
    config: WeightGradConfig,
    *,
    db: torch.Tensor | None = None,
    dest_to_src: torch.Tensor | None = None,
    a_gather: bool = False,
    b_gather: bool = False,
    db_scale: torch.Tensor | None = None,
    num_rows: int,
    allow_tf32: bool = False,
) -> None:
    """``dw[e] = Σ_d A[d]^T B[d]`` and ``db[e] = Σ_d s_d A[d]`` over the rows of each expert.

    Args:
        a: ``[M, N]`` permuted rows, or ``[T, N]`` token rows with ``a_gather``.
        b: ``[M, Kd]`` permuted rows, or ``[T, Kd]`` token rows with ``b_gather``.
        offsets: ``expert_first_token_offset [E+1]``.
        dw: ``[E, N, Kd]`` output, any strides (e.g. ``torch.empty_like(weight)``).
        config: the tiles (:func:`moe_route.tuning.weight_grad_config`). ``use_tma`` takes
            the TMA kernel where neither operand is gathered and both pass
            :func:`tma_operands_ok` (the launch sequence permutes them first), else the pointer
            kernel with the same tiles.
        db: optional ``[E, N]`` bias-gradient output.
        dest_to_src: ``expanded_dest_row_to_expanded_source_row``, for gathers and scaling.
        db_scale: ``topk_weights [T, K]``: ``s_d`` is the router weight of row ``d``'s slot
            (``1`` without it). ``dW2`` takes ``B = w·h`` from GEMM2's backward instead of
            scaling an MMA operand.
        num_rows: ``M = T*K``.
    """
    launch = WeightGradLaunch(a, b, dw, config, db=db, a_gather=a_gather, b_gather=b_gather,
                              db_scale=db_scale, allow_tf32=allow_tf32)  # fmt: skip
    launch(a, b, offsets, dw, db, dest_to_src, db_scale, num_rows)


#: Experts counted at once by the TMA kernel's step count (:func:`_program_steps`).
_BLOCK_E = 256

_WEIGHT_GRAD = ThinKernel(_expert_weight_grad_kernel)
_WEIGHT_GRAD_TMA = ThinKernel(_expert_weight_grad_tma_kernel)

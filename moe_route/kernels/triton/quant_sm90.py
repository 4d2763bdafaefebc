"""The FP8 grouped GEMM on Hopper, warp-specialised (Gluon): GEMM1 and GEMM2 on block-scaled or
per-channel FP8 experts, with the same contract as :mod:`.quant`'s FP8 kernel.

Why a second kernel: every ``BLOCK_K = 128`` block's tensor-core product must be scaled and
added to a float32 accumulator on the CUDA cores (Hopper's FP8 MMA accumulates with reduced
precision). :mod:`.quant`'s Triton kernel waits for each block's MMA and then scales it while
the tensor cores idle, all warps in step at the pipeline's barriers. Here:

* a producer partition streams the operands through TMA into a ring of ``STAGES``
  shared-memory slots (``full`` / ``empty`` mbarriers), never waiting on the math;
* two math warpgroups (4 warps each, partitions of their own, so neither waits for the other)
  each own a ``[64, 128]`` float32 accumulator, one ``N = 128`` product per block. Each issues
  the product of block ``k`` asynchronously, then waits only for block ``k - 1``'s, frees its
  slot and scales it into the accumulator: block ``k``'s MMA runs under block ``k - 1``'s
  scaling.

Tiles: 128 token rows, 64 per warpgroup, and 128 output columns; the warpgroups share each
block's weight rows (32 KB of operands a block). GEMM2 (and a plain GEMM1) reads the tile's 128
weight rows once. A gated GEMM1 takes its columns in two passes over ``K``, 64 a pass: a pass's
slot holds the 64 gate rows and then their 64 up rows, so that one ``N = 128`` product (a
product 128 wide reads 96 bytes of shared memory per clock at the full FP8 rate, two 64 wide
ones 128, all the shared memory has) leaves gate and up of the same column in the same thread
(the accumulator's column ``c`` and ``c + 64`` share a thread). The first pass's activations wait
in shared memory until the second gives each row's maximum over the 128 columns, which the FP8
quantisation of GEMM2's input needs. ``A`` comes through TMA (GEMM2's permuted input) or, with
``GATHER`` (GEMM1), gathered from the token rows by the producer with ``cp.async``, once per
pass. Block scales of the weights are one number per block and scale block of rows (gated:
the gate rows' and the up rows', a pass's 64 of each lying in one 128-row scale block, so
block-scaled gated GEMM1s need ``I % 128 == 0``); per-channel weight scales multiply after the
loop.

The products, and the epilogue (:mod:`.activation`, :mod:`.fp8_codes`), are those of
:func:`.quant._quant_tile`; a block's scaling takes one multiply of the row's and the weight's
scale (two in :func:`.quant._fp8_mainloop`), so the kernels agree within float32 rounding.
docs/decisions.md, "FP8 prefill: a warp-specialised kernel" and "FP8 prefill: gated GEMM1 as
128 rows, gate and up in one product".
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import LaunchKey, ThinKernel, cdiv, next_pow2
from .activation import gated_forward, plain_forward
from .fp8_codes import fp8_codes, fp8_scale
from .gemm_mainloop import _beyond_tiles, _m_tiles, _program_tile, _tile_expert_lanes
from .tma import GluonDescriptor, layout_ok, tma_ok

#: Token rows and weight rows of one warpgroup's product.
WG_M = gl.constexpr(64)
WG_N = gl.constexpr(128)
#: The reduction block (the FP8 scale block).
BLOCK_K = gl.constexpr(128)
#: Output columns of a gated tile's pass (its gate and up rows: one 128-row product).
GATE_N = gl.constexpr(64)
#: Warps of the producer partition (its registers are a warpgroup's either way; four gather
#: the tile's 128 token rows with 8 copies a thread per block).
PRODUCER_WARPS = gl.constexpr(4)


@gluon.jit
def _producer(a_desc, a_ptr, d2s_ptr, w_desc, a_bufs, w_bufs, full, empty, a_row0, row_end, T,
              w_row0, n_up, n_kb, stride_am, GATED: gl.constexpr, GATHER: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    """Fills the ring's slots in turn, once the math has freed each, with a block of ``A``'s
    128 rows and of 128 weight rows (gated: the pass's 64 gate rows' box, then their up
    rows'): block ``kb`` of each pass, the ring counting on across the passes."""
    A_ROWS: gl.constexpr = 2 * WG_M
    W_BYTES: gl.constexpr = WG_N * BLOCK_K
    PASSES: gl.constexpr = 2 if GATED else 1
    if GATHER:
        gl.static_assert(GATED)
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
        r = a_row0 + gl.arange(0, A_ROWS, layout=gl.SliceLayout(1, lay))
        src = gl.load(d2s_ptr + r, mask=r < row_end, other=0) % T
        a_ptrs = (
            a_ptr
            + src.to(gl.int64)[:, None] * stride_am
            + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))[None, :]
        )
    a_row0 = a_row0.to(gl.int32)
    w_row0 = w_row0.to(gl.int32)
    for c in range(PASSES * n_kb):
        p = c // n_kb
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        bar = full.index(s)
        k = (c - p * n_kb) * BLOCK_K
        if GATHER:
            # rows of the token codes through cp.async: each of the producer's threads
            # arrives on the slot's barrier once its copies land (1 + 32 * PRODUCER_WARPS
            # arrivals in all, the expect-tx one included)
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            mbarrier.expect(bar, W_BYTES)
        else:
            mbarrier.expect(bar, A_ROWS * BLOCK_K + W_BYTES)
            tma.async_copy_global_to_shared(a_desc, [a_row0, k], bar, a_bufs.index(s))
        w_buf = w_bufs.index(s)
        if GATED:  # the pass's 64 gate rows, then their 64 up rows
            r0 = w_row0 + p * GATE_N
            tma.async_copy_global_to_shared(w_desc, [r0, k], bar, w_buf.slice(0, GATE_N))
            tma.async_copy_global_to_shared(w_desc, [r0 + n_up, k], bar,
                                            w_buf.slice(GATE_N, GATE_N))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(w_desc, [w_row0, k], bar, w_buf)


@gluon.jit
def _issue(a_bufs, w_bufs, full, c, into, a_off: gl.constexpr, GATHER: gl.constexpr,
           STAGES: gl.constexpr):  # fmt: skip
    """Once the ring's block ``c`` is in its slot, issue its product asynchronously into the
    registers of ``into``, which hold nothing live."""
    s = c % STAGES
    mbarrier.wait(full.index(s), (c // STAGES) & 1)
    if GATHER:  # cp.async wrote the token rows through the generic proxy
        fence_async_shared()
    a = a_bufs.index(s).slice(a_off, WG_M)
    w = w_bufs.index(s).permute((1, 0))
    return warpgroup_mma(a, w, into, use_acc=False, is_async=True)


@gluon.jit
def _retire(empty, c, p, acc, a_s, w_s, NEWER: gl.constexpr, SN: gl.constexpr,
            COLS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Wait for the ring's block ``c``'s product (``NEWER`` blocks' stay in flight), free its
    slot, scale it into the accumulator. Returns the accumulator and the spent product."""
    p = warpgroup_mma_wait(num_outstanding=NEWER, deps=(p,))
    mbarrier.arrive(empty.index(c % STAGES))
    acc = _promote(acc, p, a_s, w_s, SN, COLS)
    # The spent product's registers take the next block's product: a wait on nothing new,
    # through which the accumulator passes, keeps LLVM from moving the scaling below that
    # product's issue (which would copy registers of a product in flight).
    acc, p = warpgroup_mma_wait(num_outstanding=NEWER, deps=(acc, p))
    return acc, p


@gluon.jit
def _scales(as_ptrs, ws_ptrs, row_ok, kb, stride_ask, stride_sk, ws_up, up_cols,
            SN: gl.constexpr, COLS: gl.constexpr):  # fmt: skip
    """Block ``kb``'s activation scales and the weight scale of the product: one number (its
    rows lie in one 128-row block) or, with ``COLS`` (a gated pass: gate rows, then up rows
    of another scale block), that of each column."""
    a_s = gl.load(as_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
    if SN == 1:  # per channel: the same for every block, applied after the loop
        w_s = 1.0
    elif COLS:
        w_g = gl.load(ws_ptrs + kb * stride_sk)
        w_u = gl.load(ws_ptrs + ws_up + kb * stride_sk)
        w_s = gl.where(up_cols, w_u, w_g)
    else:
        w_s = gl.load(ws_ptrs + kb * stride_sk)
    return a_s, w_s


@gluon.jit
def _promote(acc, part, a_s, w_s, SN: gl.constexpr, COLS: gl.constexpr):
    """``acc + part · a_s[:, None] · w_s`` (per channel, ``w_s`` comes after the loop)."""
    if SN == 1:  # (constexpr branches: w_s is a placeholder in one)
        acc = acc + part * a_s[:, None]
    elif COLS:
        acc = acc + part * (a_s[:, None] * w_s[None, :])
    else:
        acc = acc + part * (a_s * w_s)[:, None]
    return acc


@gluon.jit
def _mainloop(a_bufs, w_bufs, full, empty, as_ptrs, ws_ptrs, row_ok, c0, n_kb, stride_ask,
              stride_sk, ws_up, a_off: gl.constexpr, GATHER: gl.constexpr, SN: gl.constexpr,
              COLS: gl.constexpr, STAGES: gl.constexpr, mma: gl.constexpr):  # fmt: skip
    """``Σ_k (A_k W_k^T) · a_s · w_s`` of this warpgroup's ``[64, 128]`` product in float32,
    over the ring's blocks ``c0 ... c0 + n_kb - 1``.

    Block ``kb``'s product is issued into the registers of a product already scaled (the
    spare), so that no register of a product in flight is ever copied (ptxas would then
    serialise every wgmma): the loop takes the blocks two at a time, the two products'
    registers swapping roles."""
    up_cols = gl.arange(0, WG_N, layout=gl.SliceLayout(0, mma)) >= GATE_N
    zero = gl.zeros([WG_M, WG_N], gl.float32, mma)
    p = _issue(a_bufs, w_bufs, full, c0, zero, a_off, GATHER, STAGES)
    acc = zero
    a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, 0, stride_ask, stride_sk, ws_up, up_cols, SN,
                       COLS)  # fmt: skip
    spare = zero
    for kb in range(1, n_kb - 1, 2):
        q = _issue(a_bufs, w_bufs, full, c0 + kb, spare, a_off, GATHER, STAGES)
        acc, spare = _retire(empty, c0 + kb - 1, p, acc, a_s, w_s, 1, SN, COLS, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, kb, stride_ask, stride_sk, ws_up,
                           up_cols, SN, COLS)  # fmt: skip
        p = _issue(a_bufs, w_bufs, full, c0 + kb + 1, spare, a_off, GATHER, STAGES)
        acc, spare = _retire(empty, c0 + kb, q, acc, a_s, w_s, 1, SN, COLS, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, kb + 1, stride_ask, stride_sk, ws_up,
                           up_cols, SN, COLS)  # fmt: skip
    last = n_kb - 1
    if last % 2 == 1:  # blocks 0 ... last - 1 retired but the one in flight, then last
        q = _issue(a_bufs, w_bufs, full, c0 + last, spare, a_off, GATHER, STAGES)
        acc, _ = _retire(empty, c0 + last - 1, p, acc, a_s, w_s, 1, SN, COLS, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, last, stride_ask, stride_sk, ws_up,
                           up_cols, SN, COLS)  # fmt: skip
        acc, _ = _retire(empty, c0 + last, q, acc, a_s, w_s, 0, SN, COLS, STAGES)
    else:
        acc, _ = _retire(empty, c0 + last, p, acc, a_s, w_s, 0, SN, COLS, STAGES)
    return acc


@gluon.jit
def _math(a_bufs, w_bufs, full, empty, h_smem, as_ptr, ws_ptr, out_ptr, os_ptr, bias_ptr,
          d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb, N_OUT, T, stride_asm, stride_ask,
          stride_se, stride_sn, stride_sk, stride_om, stride_osm, stride_be, stride_bn,
          ACT: gl.constexpr, GATED: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
          UP_OFFSET: gl.constexpr, GATE_SOFTCAP: gl.constexpr, UP_SOFTCAP: gl.constexpr,
          HAS_BIAS: gl.constexpr, GATHER: gl.constexpr, SN: gl.constexpr,
          OUT_FP8: gl.constexpr, UE8M0: gl.constexpr, STAGES: gl.constexpr,
          WG: gl.constexpr):  # fmt: skip
    """Math warpgroup ``WG`` (token rows ``64 WG ...`` of the tile): its main loop (the module
    doc) and epilogue; gated, one pass of both per 64 output columns."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, WG_N, 32])  # fmt: skip
    a_off: gl.constexpr = WG * WG_M
    rows = first_row + a_off + gl.arange(0, WG_M, layout=gl.SliceLayout(1, mma))
    row_ok = rows < row_end
    if GATHER:
        a_rows = (gl.load(d2s_ptr + rows, mask=row_ok, other=0) % T).to(gl.int64) * stride_asm
    else:
        a_rows = rows.to(gl.int64) * stride_asm
    ws_base = ws_ptr + e.to(gl.int64) * stride_se
    COLS: gl.constexpr = GATED and SN != 1
    PASSES: gl.constexpr = 2 if GATED else 1
    PN: gl.constexpr = GATE_N if GATED else WG_N
    if GATED:
        out_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GATE_N, 32]
        )
    else:
        out_l: gl.constexpr = mma
    row_l: gl.constexpr = gl.SliceLayout(1, out_l)
    o_rows = first_row + a_off + gl.arange(0, WG_M, layout=row_l)
    o_row_ok = o_rows < row_end
    amax = gl.zeros([WG_M], gl.float32, row_l)
    for ps in gl.static_range(PASSES):
        # gated: the pass's gate rows n0 + 64 ps ... and their up rows, N_OUT further
        w_row0 = n0 + ps * GATE_N
        acc = _mainloop(a_bufs, w_bufs, full, empty, as_ptr + a_rows,
                        ws_base + (w_row0 // SN).to(gl.int64) * stride_sn, row_ok, ps * n_kb,
                        n_kb, stride_ask, stride_sk, (N_OUT // SN) * stride_sn, a_off, GATHER,
                        SN, COLS, STAGES, mma)  # fmt: skip
        if SN == 1:  # per channel: the rows' scales
            j = gl.arange(0, WG_N, layout=gl.SliceLayout(0, mma))
            if GATED:
                wr = w_row0 + j % GATE_N + (j // GATE_N) * N_OUT
                c_ok = w_row0 + j % GATE_N < N_OUT
            else:
                wr = w_row0 + j
                c_ok = wr < N_OUT
            col_s = gl.load(ws_base + wr.to(gl.int64) * stride_sn, mask=c_ok, other=0.0)
            acc = acc * col_s[None, :]
        # epilogue: bias, activation, store (FP8: codes and one scale per row per 128 columns)
        if GATED:  # columns 0-63 the gate, 64-127 the up products: the same threads hold both
            gate, up = gl.split(gl.permute(gl.reshape(acc, [WG_M, 2, GATE_N]), (0, 2, 1)))
            acc = gl.convert_layout(gate, out_l)
            acc_up = gl.convert_layout(up, out_l)
        else:
            acc_up = acc
        cols = w_row0 + gl.arange(0, PN, layout=gl.SliceLayout(0, out_l))
        col_ok = cols < N_OUT
        if HAS_BIAS:
            b_base = bias_ptr + e.to(gl.int64) * stride_be
            acc += gl.load(b_base + cols * stride_bn, mask=col_ok,
                           other=0.0).to(gl.float32)[None, :]  # fmt: skip
            if GATED:
                acc_up += gl.load(b_base + (cols + N_OUT) * stride_bn, mask=col_ok,
                                  other=0.0).to(gl.float32)[None, :]  # fmt: skip
        if GATED:
            h = gated_forward(acc, acc_up, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP,
                              UP_SOFTCAP)  # fmt: skip
        else:
            h = plain_forward(acc, ACT)
        mask = o_row_ok[:, None] & col_ok[None, :]
        out_ptrs = out_ptr + o_rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        if OUT_FP8:
            amax = gl.maximum(amax, gl.max(gl.where(mask, gl.abs(h), 0.0), axis=1))
            if ps + 1 < PASSES:  # the row's other columns come in the next pass
                h_smem.slice(a_off, WG_M).store(h)
            else:
                sc = fp8_scale(amax, UE8M0)
                gl.store(out_ptrs, fp8_codes(h, sc[:, None], False), mask=mask)
                if GATED:
                    h0 = h_smem.slice(a_off, WG_M).load(out_l)
                    cols0 = cols - GATE_N
                    gl.store(out_ptrs - GATE_N, fp8_codes(h0, sc[:, None], False),
                             mask=o_row_ok[:, None] & (cols0 < N_OUT)[None, :])  # fmt: skip
                gl.store(os_ptr + o_rows.to(gl.int64) * stride_osm + n_tile, sc, mask=o_row_ok)
        else:
            gl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _math_worker(a_bufs, w_bufs, full, empty, h_smem, as_ptr, ws_ptr, out_ptr,
                 os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb, N_OUT, T,
                 stride_asm, stride_ask, stride_se, stride_sn, stride_sk, stride_om, stride_osm,
                 stride_be, stride_bn, ACT: gl.constexpr, GATED: gl.constexpr,
                 ALPHA: gl.constexpr, LIMIT: gl.constexpr, UP_OFFSET: gl.constexpr,
                 GATE_SOFTCAP: gl.constexpr, UP_SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr,
                 GATHER: gl.constexpr, SN: gl.constexpr, OUT_FP8: gl.constexpr,
                 UE8M0: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The second math warpgroup (a worker partition)."""
    _math(a_bufs, w_bufs, full, empty, h_smem, as_ptr, ws_ptr, out_ptr, os_ptr,
          bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb, N_OUT, T, stride_asm,
          stride_ask, stride_se, stride_sn, stride_sk, stride_om, stride_osm, stride_be,
          stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP, HAS_BIAS,
          GATHER, SN, OUT_FP8, UE8M0, STAGES, 1)  # fmt: skip


@gluon.jit(do_not_specialize=["M_ROWS", "M_TILES", "T"])
def _fp8_sm90_kernel(
    a_desc, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, bias_ptr, offsets_ptr, d2s_ptr,
    E, M_ROWS, M_TILES, N_OUT, N_W, KD, T,
    stride_am, stride_asm, stride_ask, stride_se, stride_sn, stride_sk, stride_om, stride_osm,
    stride_be, stride_bn,
    ACT: gl.constexpr, GATED: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
    UP_OFFSET: gl.constexpr, GATE_SOFTCAP: gl.constexpr, UP_SOFTCAP: gl.constexpr,
    HAS_BIAS: gl.constexpr, GATHER: gl.constexpr, SN: gl.constexpr, OUT_FP8: gl.constexpr,
    UE8M0: gl.constexpr, E_POW2: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
):  # fmt: skip
    """One ``[128, 128]`` output tile per program of expert ``e``'s rows, as
    :func:`.quant._quant_gemm_kernel` computes it; the dropped rows' tiles are written as
    zeros (codes and scales)."""
    BLOCK_M: gl.constexpr = 2 * WG_M
    BLOCK_N: gl.constexpr = WG_N
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ex = gl.arange(0, E_POW2, layout=lanes)
    e, first_row, row_end = _tile_expert_lanes(offsets_ptr, m_tile, E, ex, BLOCK_M, E_POW2)
    n0 = n_tile * BLOCK_N
    if e >= E:  # past the experts: the dropped rows [offset[E], M) are zeros
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        r = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
        c = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
        ok = (r < M_ROWS)[:, None] & (c < N_OUT)[None, :]
        gl.store(
            out_ptr + r.to(gl.int64)[:, None] * stride_om + c[None, :],
            gl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty, lay),
            mask=ok,
        )
        if OUT_FP8:
            c_tiles = gl.cdiv(N_OUT, WG_N)
            gl.store(os_ptr + r.to(gl.int64)[:, None] * stride_osm + (n0 // WG_N)
                     + gl.arange(0, BLOCK_N // WG_N, layout=gl.SliceLayout(0, lay))[None, :],
                     gl.zeros([BLOCK_M, BLOCK_N // WG_N], gl.float32, lay),
                     mask=(r < M_ROWS)[:, None] & (n0 // WG_N < c_tiles))  # fmt: skip
        return
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K],
                                                                  gl.float8e4nv)  # fmt: skip
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_N, BLOCK_K],
                                                                  gl.float8e4nv)  # fmt: skip
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, WG_N, BLOCK_K], w_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # gated with FP8 codes: the first pass's activations, until the row's scale is known
    H_ROWS: gl.constexpr = 2 * WG_M if GATED and OUT_FP8 else 1
    h_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    h_smem = gl.allocate_shared_memory(gl.float32, [H_ROWS, GATE_N], h_layout)
    # a slot fills with the producer's expect-tx arrive and, gathering, one cp.async arrive per
    # producer thread
    FULL_ARRIVALS: gl.constexpr = 1 + 32 * PRODUCER_WARPS if GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=FULL_ARRIVALS)
        mbarrier.init(empty.index(i), count=2)  # both math warpgroups
    n_kb = gl.cdiv(KD, BLOCK_K)
    w_row0 = e * N_W + n0
    gl.warp_specialize(
        [
            (_math, (a_bufs, w_bufs, full, empty, h_smem, as_ptr, ws_ptr,
                     out_ptr, os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb,
                     N_OUT, T, stride_asm, stride_ask, stride_se, stride_sn, stride_sk, stride_om,
                     stride_osm, stride_be, stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET,
                     GATE_SOFTCAP, UP_SOFTCAP, HAS_BIAS, GATHER, SN, OUT_FP8, UE8M0, STAGES, 0)),
            (_math_worker, (a_bufs, w_bufs, full, empty, h_smem, as_ptr,
                            ws_ptr, out_ptr, os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end,
                            n0, n_tile, n_kb, N_OUT, T, stride_asm, stride_ask, stride_se,
                            stride_sn, stride_sk, stride_om, stride_osm, stride_be, stride_bn,
                            ACT, GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP,
                            HAS_BIAS, GATHER, SN, OUT_FP8, UE8M0, STAGES)),
            (_producer, (a_desc, a_ptr, d2s_ptr, w_desc, a_bufs, w_bufs, full, empty, first_row,
                         row_end, T, w_row0, N_OUT, n_kb, stride_am, GATED, GATHER, STAGES)),
        ],
        [4, PRODUCER_WARPS],
        [232, 40],
    )  # fmt: skip


_FP8_SM90 = ThinKernel(_fp8_sm90_kernel)


# --------------------------------------------------------------------------- launch
class Fp8Sm90Launch:
    """:func:`_fp8_sm90_kernel`'s launch for one :class:`.quant.QuantGemmLaunch` (which
    builds it where :meth:`serves` says the layout allows and falls back to its own kernel
    for a call whose operands TMA cannot address).

    ``W`` is read as its 2-D view ``[E * N, K]`` (boxes of 128 rows, gated 64), ``A``
    through a ``[128, 128]`` box or gathered; descriptors are built per call (they hold
    addresses) and encoded once per address by the thin launch."""

    __slots__ = ("E", "cx", "gather", "kd", "key", "n_out", "n_w", "strides")

    @staticmethod
    def serves(w, epilogue, n_out: int, block_n_scale: int) -> bool:
        """Whether the kernel computes this GEMM (the launch's other conditions: FP8, SM90)."""
        E, n_w, _ = w.shape
        if block_n_scale not in (1, BLOCK_K.value) or E * n_w >= 2**31:
            return False
        # gated: a pass's gate rows and up rows through separate boxes, each box's rows in one
        # scale block
        if not epilogue.gated:
            return True
        return not epilogue.interleaved and (block_n_scale == 1 or n_out % WG_N.value == 0)

    def __init__(self, a, a_scale, w, w_scale, kd, epilogue, bias, gather, out_dtype, out_fp8,
                 block_n_scale, ue8m0, group_m):  # fmt: skip
        E, n_w, _ = w.shape
        self.E, self.kd, self.n_w, self.gather = E, kd, n_w, gather
        self.n_out = n_w // 2 if epilogue.gated else n_w
        ss = w_scale.stride()
        s_w = (ss[0], ss[1], 0) if w_scale.dim() == 2 else ss
        sa_s = (a_scale.stride(0), 0 if a_scale.shape[1] == 1 else a_scale.stride(1))
        sb = bias.stride() if bias is not None else (0, 0)
        sos = cdiv(self.n_out, WG_N.value) if out_fp8 else 0
        self.strides = (a.stride(0), *sa_s, *s_w, self.n_out, sos, *sb)
        self.key = LaunchKey(("sm90", epilogue, bias.dtype if bias is not None else None,
                              out_dtype, self.strides, gather, out_fp8, block_n_scale, ue8m0, E,
                              self.n_out, kd, group_m))  # fmt: skip
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, GATE_SOFTCAP=epilogue.gate_softcap,
            UP_SOFTCAP=epilogue.up_softcap, HAS_BIAS=bias is not None, GATHER=gather,
            SN=block_n_scale, OUT_FP8=out_fp8, UE8M0=ue8m0, E_POW2=next_pow2(E + 1),
            STAGES=4, GROUP_M=group_m, num_warps=4,
        )  # fmt: skip

    def descriptors(self, a, w):
        """``(a_desc, w_desc)`` of this call, or None where TMA cannot address an operand."""
        E, n_w, K = w.shape
        s_e, s_n, s_k = w.stride()
        if s_k != 1 or (E > 1 and s_e != n_w * s_n) or not layout_ok(w, (s_n, 1)):
            return None
        gated = self.cx["GATED"]
        box = GATE_N.value if gated else WG_N.value
        w_desc = GluonDescriptor(w, (E * n_w, K), (s_n, 1), (box, BLOCK_K.value))
        if self.gather:  # cp.async copies 16-byte pieces of whole 128-column blocks, unmasked
            whole = self.kd % BLOCK_K.value == 0 and a.stride(1) == 1
            aligned = a.stride(0) % 16 == 0 and a.data_ptr() % 16 == 0
            return (a, w_desc) if whole and aligned else None
        if not tma_ok(a) or a.shape[0] >= 2**31:
            return None
        a_box = (2 * WG_M.value, BLOCK_K.value)
        return GluonDescriptor(a, a.shape, a.stride(), a_box), w_desc

    def __call__(self, descs, a, a_scale, w_scale, offsets, out, out_scale, bias, dest_to_src,
                 M) -> None:  # fmt: skip
        a_desc, w_desc = descs
        bm = 2 * WG_M.value
        m_tiles = _m_tiles(M, self.E, bm)
        grid = m_tiles * cdiv(self.n_out, WG_N.value)
        o_s = out_scale if out_scale is not None else out
        b = bias if bias is not None else out
        d2s = dest_to_src if self.gather else offsets
        _FP8_SM90.launch(
            self.key, (grid,),
            (a_desc, a, a_scale, w_desc, w_scale, out, o_s, b, offsets, d2s, self.E, M, m_tiles,
             self.n_out, self.n_w, self.kd, a.shape[0], *self.strides),
            lambda: self.cx,
        )  # fmt: skip

"""The FP8 grouped GEMM on Hopper, warp-specialised (Gluon): GEMM1 and GEMM2 on block-scaled or
per-channel FP8 experts, with the same contract as :mod:`.quant`'s FP8 kernel.

Why a second kernel: every ``BLOCK_K = 128`` block's tensor-core product must be scaled and
added to a float32 accumulator on the CUDA cores (Hopper's FP8 MMA accumulates with reduced
precision). :mod:`.quant`'s Triton kernel waits for each block's MMA and then scales it while
the tensor cores idle, all warps in step at the pipeline's barriers. Here:

* one producer warp streams the operands through TMA into a ring of ``STAGES`` shared-memory
  slots (``full`` / ``empty`` mbarriers), never waiting on the math;
* two math warpgroups (4 warps each, partitions of their own, so neither waits for the other)
  each own a ``[64, 128]`` float32 accumulator, one ``N = 128`` product per block. Each issues
  the product of block ``k`` asynchronously, then waits only for block ``k - 1``'s, frees its
  slot and scales it into the accumulator: block ``k``'s MMA runs under block ``k - 1``'s
  scaling.

Tiles: a gated GEMM1 splits a program's ``2 x 128`` weight rows between the warpgroups over the
same 64 token rows: one takes the gate rows of the tile's 128 output columns, the other their up
rows (a product 128 wide reads 96 bytes of shared memory per clock at the full FP8 rate, two 64
wide ones 128, all the shared memory has). After the loop they swap halves through shared memory,
so that each holds gate and up of 64 columns; the epilogue's FP8 quantisation of GEMM2's input
needs each row's maximum over the 128, which they swap too. GEMM2 (and a plain GEMM1) splits 128
token rows and shares 128 weight rows. ``A`` comes through TMA (GEMM2's permuted input) or, with
``GATHER`` (GEMM1), gathered from the token rows by the producer with ``cp.async``. Block scales
of the weights are one number per product and block (its rows lie in one 128-row scale block:
block-scaled gated GEMM1s need ``I % 128 == 0``); per-channel weight scales multiply after the
loop.

The products, and the epilogue (:mod:`.activation`, :mod:`.fp8_codes`), are those of
:func:`.quant._quant_tile`; a block's scaling takes one multiply of the row's and the weight's
scale (two in :func:`.quant._fp8_mainloop`), so the kernels agree within float32 rounding.
docs/decisions.md, "FP8 prefill: a warp-specialised kernel".
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
#: Warps of the producer partition.
PRODUCER_WARPS = gl.constexpr(1)


@gluon.jit
def _producer(a_desc, a_ptr, d2s_ptr, w_desc, a_bufs, w_bufs, full, empty, a_row0, row_end, T,
              w_row0, n_up, n_kb, stride_am, GATED: gl.constexpr, GATHER: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    """One warp: fills slot ``kb % STAGES`` with block ``kb`` of ``A`` (``A_ROWS`` rows) and
    ``W`` (``W_ROWS`` rows: gated, the gate rows' box then the up rows') once the math has
    freed it."""
    A_ROWS: gl.constexpr = WG_M if GATED else 2 * WG_M
    W_BYTES: gl.constexpr = (2 * WG_N if GATED else WG_N) * BLOCK_K
    if GATHER:
        gl.static_assert(GATED)
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0])
        r = a_row0 + gl.arange(0, A_ROWS, layout=gl.SliceLayout(1, lay))
        src = gl.load(d2s_ptr + r, mask=r < row_end, other=0) % T
        a_ptrs = (
            a_ptr
            + src.to(gl.int64)[:, None] * stride_am
            + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, lay))[None, :]
        )
    a_row0 = a_row0.to(gl.int32)
    w_row0 = w_row0.to(gl.int32)
    for kb in range(n_kb):
        s = kb % STAGES
        mbarrier.wait(empty.index(s), ((kb // STAGES) & 1) ^ 1)
        bar = full.index(s)
        k = kb * BLOCK_K
        if GATHER:
            # rows of the token codes through cp.async: each of the warp's threads arrives
            # on the slot's barrier once its copies land (one of the barrier's 33 arrivals)
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            mbarrier.expect(bar, W_BYTES)
        else:
            mbarrier.expect(bar, A_ROWS * BLOCK_K + W_BYTES)
            tma.async_copy_global_to_shared(a_desc, [a_row0, k], bar, a_bufs.index(s))
        w_buf = w_bufs.index(s)
        if GATED:  # warpgroup 0's gate rows, warpgroup 1's up rows
            tma.async_copy_global_to_shared(w_desc, [w_row0, k], bar, w_buf.slice(0, WG_N))
            tma.async_copy_global_to_shared(w_desc, [w_row0 + n_up, k], bar,
                                            w_buf.slice(WG_N, WG_N))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(w_desc, [w_row0, k], bar, w_buf)


@gluon.jit
def _issue(a_bufs, w_bufs, full, kb, into, a_off: gl.constexpr, w_off: gl.constexpr,
           GATED: gl.constexpr, GATHER: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Once block ``kb`` is in its slot, issue its product asynchronously into the registers
    of ``into``, which hold nothing live."""
    s = kb % STAGES
    mbarrier.wait(full.index(s), (kb // STAGES) & 1)
    if GATHER:  # cp.async wrote the token rows through the generic proxy
        fence_async_shared()
    a = a_bufs.index(s)
    if not GATED:
        a = a.slice(a_off, WG_M)
    w = w_bufs.index(s).slice(w_off, WG_N).permute((1, 0))
    return warpgroup_mma(a, w, into, use_acc=False, is_async=True)


@gluon.jit
def _retire(empty, kb, p, acc, a_s, w_s, NEWER: gl.constexpr, SN: gl.constexpr,
            STAGES: gl.constexpr):  # fmt: skip
    """Wait for block ``kb``'s product (``NEWER`` blocks' stay in flight), free its slot,
    scale it into the accumulator. Returns the accumulator and the spent product."""
    p = warpgroup_mma_wait(num_outstanding=NEWER, deps=(p,))
    mbarrier.arrive(empty.index(kb % STAGES))
    acc = _promote(acc, p, a_s, w_s, SN)
    # The spent product's registers take the next block's product: a wait on nothing new,
    # through which the accumulator passes, keeps LLVM from moving the scaling below that
    # product's issue (which would copy registers of a product in flight).
    acc, p = warpgroup_mma_wait(num_outstanding=NEWER, deps=(acc, p))
    return acc, p


@gluon.jit
def _scales(as_ptrs, ws_ptrs, row_ok, kb, stride_ask, stride_sk, SN: gl.constexpr):
    """Block ``kb``'s activation scales and the weight scale of the product (one number: its
    rows lie in one 128-row block)."""
    a_s = gl.load(as_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
    if SN == 1:  # noqa: SIM108 (per channel: the same for every block, applied after the loop)
        w_s = 1.0
    else:
        w_s = gl.load(ws_ptrs + kb * stride_sk)
    return a_s, w_s


@gluon.jit
def _promote(acc, part, a_s, w_s, SN: gl.constexpr):
    """``acc + part · a_s[:, None] · w_s`` (per channel, ``w_s`` comes after the loop)."""
    if SN == 1:  # noqa: SIM108 (constexpr branches: w_s is a placeholder in one)
        acc = acc + part * a_s[:, None]
    else:
        acc = acc + part * (a_s * w_s)[:, None]
    return acc


@gluon.jit
def _mainloop(a_bufs, w_bufs, full, empty, as_ptrs, ws_ptrs, row_ok, n_kb, stride_ask,
              stride_sk, a_off: gl.constexpr, w_off: gl.constexpr, GATED: gl.constexpr,
              GATHER: gl.constexpr, SN: gl.constexpr, STAGES: gl.constexpr,
              mma: gl.constexpr):  # fmt: skip
    """``Σ_k (A_k W_k^T) · a_s · w_s`` of this warpgroup's ``[64, 128]`` product in float32.

    Block ``kb``'s product is issued into the registers of a product already scaled (the
    spare), so that no register of a product in flight is ever copied (ptxas would then
    serialise every wgmma): the loop takes the blocks two at a time, the two products'
    registers swapping roles."""
    zero = gl.zeros([WG_M, WG_N], gl.float32, mma)
    p = _issue(a_bufs, w_bufs, full, 0, zero, a_off, w_off, GATED, GATHER, STAGES)
    acc = zero
    a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, 0, stride_ask, stride_sk, SN)
    spare = zero
    for kb in range(1, n_kb - 1, 2):
        q = _issue(a_bufs, w_bufs, full, kb, spare, a_off, w_off, GATED, GATHER, STAGES)
        acc, spare = _retire(empty, kb - 1, p, acc, a_s, w_s, 1, SN, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, kb, stride_ask, stride_sk, SN)
        p = _issue(a_bufs, w_bufs, full, kb + 1, spare, a_off, w_off, GATED, GATHER, STAGES)
        acc, spare = _retire(empty, kb, q, acc, a_s, w_s, 1, SN, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, kb + 1, stride_ask, stride_sk, SN)
    last = n_kb - 1
    if last % 2 == 1:  # blocks 0 ... last - 1 retired but the one in flight, then last
        q = _issue(a_bufs, w_bufs, full, last, spare, a_off, w_off, GATED, GATHER, STAGES)
        acc, _ = _retire(empty, last - 1, p, acc, a_s, w_s, 1, SN, STAGES)
        a_s, w_s = _scales(as_ptrs, ws_ptrs, row_ok, last, stride_ask, stride_sk, SN)
        acc, _ = _retire(empty, last, q, acc, a_s, w_s, 0, SN, STAGES)
    else:
        acc, _ = _retire(empty, last, p, acc, a_s, w_s, 0, SN, STAGES)
    return acc


@gluon.jit
def _exchange(acc, x_smem, xbar, WG: gl.constexpr, mma64: gl.constexpr):
    """Gated: warpgroup 0 holds the gate and warpgroup 1 the up products of 128 columns; each
    then takes both of 64 of them (its half), through shared memory."""
    x_smem.slice(WG * WG_M, WG_M).store(acc)
    gl.thread_barrier()
    mbarrier.arrive(xbar)
    mbarrier.wait(xbar, 0)
    half = x_smem.slice(WG * (WG_N // 2), WG_N // 2, dim=1)
    gate = half.slice(0, WG_M).load(mma64)
    up = half.slice(WG_M, WG_M).load(mma64)
    return gate, up


@gluon.jit
def _math(a_bufs, w_bufs, full, empty, xbar, x_smem, amax_smem, as_ptr, ws_ptr, out_ptr, os_ptr,
          bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb, N_OUT, T, stride_asm,
          stride_ask, stride_se, stride_sn, stride_sk, stride_om, stride_osm, stride_be,
          stride_bn, ACT: gl.constexpr, GATED: gl.constexpr, ALPHA: gl.constexpr,
          LIMIT: gl.constexpr, UP_OFFSET: gl.constexpr, GATE_SOFTCAP: gl.constexpr,
          UP_SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr, GATHER: gl.constexpr,
          SN: gl.constexpr, OUT_FP8: gl.constexpr, UE8M0: gl.constexpr, STAGES: gl.constexpr,
          WG: gl.constexpr):  # fmt: skip
    """Math warpgroup ``WG``: its main loop (the module doc) and epilogue."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, WG_N, 32])  # fmt: skip
    a_off: gl.constexpr = 0 if GATED else WG * WG_M
    rows = first_row + a_off + gl.arange(0, WG_M, layout=gl.SliceLayout(1, mma))
    row_ok = rows < row_end
    if GATHER:
        a_rows = (gl.load(d2s_ptr + rows, mask=row_ok, other=0) % T).to(gl.int64) * stride_asm
    else:
        a_rows = rows.to(gl.int64) * stride_asm
    # this warpgroup's W rows: gated, the gate (0) or up (1) rows of the tile's 128 columns
    w_row0 = n0 + WG * N_OUT if GATED else n0
    w_off: gl.constexpr = WG * WG_N if GATED else 0  # and where they lie in the slot's W tile
    ws_base = ws_ptr + e.to(gl.int64) * stride_se
    acc = _mainloop(a_bufs, w_bufs, full, empty, as_ptr + a_rows,
                    ws_base + (w_row0 // SN).to(gl.int64) * stride_sn, row_ok, n_kb, stride_ask,
                    stride_sk, a_off, w_off, GATED, GATHER, SN, STAGES, mma)  # fmt: skip
    if SN == 1:  # per channel: the rows' scales
        j = gl.arange(0, WG_N, layout=gl.SliceLayout(0, mma))
        col_s = gl.load(ws_base + (w_row0 + j).to(gl.int64) * stride_sn, mask=n0 + j < N_OUT,
                        other=0.0)  # fmt: skip
        acc = acc * col_s[None, :]

    # epilogue: bias, activation, store (FP8: codes and one scale per row per 128 columns)
    if GATED:  # 64 columns per warpgroup from here
        out_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WG_N // 2, 32]
        )
        acc, acc_up = _exchange(acc, x_smem, xbar, WG, out_l)
        c0 = n0 + WG * (WG_N // 2)
        PN: gl.constexpr = WG_N // 2
    else:
        out_l: gl.constexpr = mma
        acc_up = acc
        c0 = n0
        PN: gl.constexpr = WG_N
    row_l: gl.constexpr = gl.SliceLayout(1, out_l)
    rows = first_row + a_off + gl.arange(0, WG_M, layout=row_l)
    row_ok = rows < row_end
    cols = c0 + gl.arange(0, PN, layout=gl.SliceLayout(0, out_l))
    col_ok = cols < N_OUT
    if HAS_BIAS:
        b_base = bias_ptr + e.to(gl.int64) * stride_be
        acc += gl.load(b_base + cols * stride_bn, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        if GATED:
            acc_up += gl.load(b_base + (cols + N_OUT) * stride_bn, mask=col_ok,
                              other=0.0).to(gl.float32)[None, :]  # fmt: skip
    if GATED:
        h = gated_forward(acc, acc_up, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
    else:
        h = plain_forward(acc, ACT)
    mask = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
    if OUT_FP8:
        amax = gl.max(gl.where(mask, gl.abs(h), 0.0), axis=1)
        if GATED:  # the row's other 64 columns are the other warpgroup's
            amax_smem.slice(WG * WG_M, WG_M).store(amax)
            gl.thread_barrier()
            mbarrier.arrive(xbar)
            mbarrier.wait(xbar, 1)
            amax = gl.maximum(amax, amax_smem.slice((1 - WG) * WG_M, WG_M).load(row_l))
        sc = fp8_scale(amax, UE8M0)
        gl.store(out_ptrs, fp8_codes(h, sc[:, None], False), mask=mask)
        if WG == 0 or not GATED:
            gl.store(os_ptr + rows.to(gl.int64) * stride_osm + n_tile, sc, mask=row_ok)
    else:
        gl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _math_worker(a_bufs, w_bufs, full, empty, xbar, x_smem, amax_smem, as_ptr, ws_ptr, out_ptr,
                 os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb, N_OUT, T,
                 stride_asm, stride_ask, stride_se, stride_sn, stride_sk, stride_om, stride_osm,
                 stride_be, stride_bn, ACT: gl.constexpr, GATED: gl.constexpr,
                 ALPHA: gl.constexpr, LIMIT: gl.constexpr, UP_OFFSET: gl.constexpr,
                 GATE_SOFTCAP: gl.constexpr, UP_SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr,
                 GATHER: gl.constexpr, SN: gl.constexpr, OUT_FP8: gl.constexpr,
                 UE8M0: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The second math warpgroup (a worker partition)."""
    _math(a_bufs, w_bufs, full, empty, xbar, x_smem, amax_smem, as_ptr, ws_ptr, out_ptr, os_ptr,
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
    """One ``[BLOCK_M, BLOCK_N]`` output tile per program (``128 x 128``, gated ``64 x 128``)
    of expert ``e``'s rows, as :func:`.quant._quant_gemm_kernel` computes it; the dropped
    rows' tiles are written as zeros (codes and scales)."""
    BLOCK_M: gl.constexpr = WG_M if GATED else 2 * WG_M
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
    W_ROWS: gl.constexpr = 2 * WG_N if GATED else WG_N
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K],
                                                                  gl.float8e4nv)  # fmt: skip
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([W_ROWS, BLOCK_K],
                                                                  gl.float8e4nv)  # fmt: skip
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W_ROWS, BLOCK_K], w_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    amax_smem = gl.allocate_shared_memory(gl.float32, [2 * WG_M],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))  # fmt: skip
    # gated: the gate and up products, swapped between the warpgroups after the loop
    X_ROWS: gl.constexpr = WG_M if GATED else 1
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(2, 1, 8, [1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [2 * X_ROWS, WG_N], x_layout)
    # a slot fills with the producer's expect-tx arrive and, gathering, one cp.async arrive per
    # producer thread
    FULL_ARRIVALS: gl.constexpr = 1 + 32 * PRODUCER_WARPS if GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=FULL_ARRIVALS)
        mbarrier.init(empty.index(i), count=2)  # both math warpgroups
    mbarrier.init(xbar, count=2)
    n_kb = gl.cdiv(KD, BLOCK_K)
    w_row0 = e * N_W + n0
    gl.warp_specialize(
        [
            (_math, (a_bufs, w_bufs, full, empty, xbar, x_smem, amax_smem, as_ptr, ws_ptr,
                     out_ptr, os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end, n0, n_tile, n_kb,
                     N_OUT, T, stride_asm, stride_ask, stride_se, stride_sn, stride_sk, stride_om,
                     stride_osm, stride_be, stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET,
                     GATE_SOFTCAP, UP_SOFTCAP, HAS_BIAS, GATHER, SN, OUT_FP8, UE8M0, STAGES, 0)),
            (_math_worker, (a_bufs, w_bufs, full, empty, xbar, x_smem, amax_smem, as_ptr,
                            ws_ptr, out_ptr, os_ptr, bias_ptr, d2s_ptr, e, first_row, row_end,
                            n0, n_tile, n_kb, N_OUT, T, stride_asm, stride_ask, stride_se,
                            stride_sn, stride_sk, stride_om, stride_osm, stride_be, stride_bn,
                            ACT, GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP,
                            HAS_BIAS, GATHER, SN, OUT_FP8, UE8M0, STAGES)),
            (_producer, (a_desc, a_ptr, d2s_ptr, w_desc, a_bufs, w_bufs, full, empty, first_row,
                         row_end, T, w_row0, N_OUT, n_kb, stride_am, GATED, GATHER, STAGES)),
        ],
        [4, PRODUCER_WARPS],
        [232, 56 if GATHER else 40],
    )  # fmt: skip


_FP8_SM90 = ThinKernel(_fp8_sm90_kernel)


# --------------------------------------------------------------------------- launch
class Fp8Sm90Launch:
    """:func:`_fp8_sm90_kernel`'s launch for one :class:`.quant.QuantGemmLaunch` (which
    builds it where :meth:`serves` says the layout allows and falls back to its own kernel
    for a call whose operands TMA cannot address).

    ``W`` is read as its 2-D view ``[E * N, K]`` (boxes of 128 rows), ``A``
    through a ``[BLOCK_M, 128]`` box or gathered; descriptors are built per call (they hold
    addresses) and encoded once per address by the thin launch."""

    __slots__ = ("E", "cx", "gather", "kd", "key", "n_out", "n_w", "strides")

    @staticmethod
    def serves(w, epilogue, n_out: int, block_n_scale: int) -> bool:
        """Whether the kernel computes this GEMM (the launch's other conditions: FP8, SM90)."""
        E, n_w, _ = w.shape
        if block_n_scale not in (1, BLOCK_K.value) or E * n_w >= 2**31:
            return False
        # gated: gate and up rows through separate boxes, each a warpgroup's product, whose
        # rows lie in one scale block
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
                              self.n_out, kd))  # fmt: skip
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
        w_desc = GluonDescriptor(w, (E * n_w, K), (s_n, 1), (WG_N.value, BLOCK_K.value))
        if self.gather:  # cp.async copies 16-byte pieces of whole 128-column blocks, unmasked
            whole = self.kd % BLOCK_K.value == 0 and a.stride(1) == 1
            aligned = a.stride(0) % 16 == 0 and a.data_ptr() % 16 == 0
            return (a, w_desc) if whole and aligned else None
        if not tma_ok(a) or a.shape[0] >= 2**31:
            return None
        a_box = (WG_M.value if gated else 2 * WG_M.value, BLOCK_K.value)
        return GluonDescriptor(a, a.shape, a.stride(), a_box), w_desc

    def __call__(self, descs, a, a_scale, w_scale, offsets, out, out_scale, bias, dest_to_src,
                 M) -> None:  # fmt: skip
        a_desc, w_desc = descs
        bm = WG_M.value if self.cx["GATED"] else 2 * WG_M.value
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

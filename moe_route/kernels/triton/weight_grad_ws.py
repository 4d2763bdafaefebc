"""The weight gradient on Hopper, warp-specialised (Gluon): ``dW[e] = Σ_d A[d]^T B[d]``.

The same sums as :func:`.weight_grad._expert_weight_grad_tma_kernel` (each ``[BLOCK_N, BLOCK_K]``
tile of ``dW[e]`` owned by one program, the expert's rows reduced ``BLOCK_R`` at a time in
ascending order, float32 accumulation, one rounding), with its work split between warps:

* a *loader* warp walks the program's tiles and row steps and issues the TMA copies of both
  operands into a ring of ``STAGES`` shared-memory slots (the rows through bounded-rows
  descriptors, :mod:`.tma`: zeros past the expert's last row);
* the *MMA* warpgroup(s) wait for a slot, multiply it (``wgmma`` reading ``A``'s slot
  transposed), hand the slot back once that multiply is done, and at a tile's end round the
  accumulator into a shared-memory staging tile, which a TMA store writes to ``dW``.

Why: in the single-stream kernel the same warps compute the tile index, issue the loads, wait
for them, multiply and store, so at 128-512 rows per expert (4-8 row steps per tile) the
tensor cores idle through every tile's start and end (ncu: tensor pipe 43-65 %, issue-bound).
Here the loader runs ahead across tile boundaries, so the next tile's operands are in shared
memory while the MMA warps round and stage the previous one, and the store itself is
asynchronous.

Programs ``p`` of ``P`` take tiles ``p, p + P, ...`` of ``E x n-tiles x k-tiles`` (an expert
with no rows takes one step of zeros: exact zeros in its ``dW[e]``). Both partitions derive the
same step sequence from ``offsets``, so their slot and phase counters agree without talking.
The result is bitwise equal to the single-stream kernel's with the same tiles (same MMA shape
and order of the row steps).

Needs Triton >= 3.6 (``gl.warp_specialize`` taking ``(function, args)`` pairs) and SM90.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: Rows per range a bounded descriptor addresses (:mod:`.tma`'s ``_ROW_SPAN``).
_SPAN = gl.constexpr(1 << 30)


@gluon.jit
def _tile(tile, per_expert, n_tiles, k_tiles, offsets_ptr, BLOCK_R: gl.constexpr,
          K_FASTEST: gl.constexpr):  # fmt: skip
    """``(e, n-tile, k-tile, lo, size, steps)`` of tile ``tile`` (consecutive tiles step along
    ``Kd`` with ``K_FASTEST``, else along ``N``); ``steps >= 1``, an empty expert's one step
    reading zeros."""
    e = tile // per_expert
    if K_FASTEST:
        pid_n = (tile % per_expert) // k_tiles
        pid_k = tile % k_tiles
    else:
        pid_k = (tile % per_expert) // n_tiles
        pid_n = tile % n_tiles
    lo = gl.load(offsets_ptr + e).to(gl.int32)
    size = gl.load(offsets_ptr + e + 1).to(gl.int32) - lo
    steps = gl.maximum(gl.cdiv(size, BLOCK_R), 1)
    return e, pid_n, pid_k, lo, size, steps


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, total_tiles,
                    per_expert, n_tiles, k_tiles, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    K_FASTEST: gl.constexpr):  # fmt: skip
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = 0
    for tile in range(pid, total_tiles, programs):
        e, pid_n, pid_k, lo, size, steps = _tile(
            tile, per_expert, n_tiles, k_tiles, offsets_ptr, BLOCK_R, K_FASTEST
        )
        for i in range(steps):
            slot = count % STAGES
            phase = (count // STAGES) & 1
            # a slot starts free: the first wait on its "empty" barrier is on phase 1
            mbarrier.wait(empty.index(slot), phase ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            row = _SPAN - size + i * BLOCK_R
            tma.async_copy_global_to_shared(
                a_desc, [_SPAN, lo + size, row, pid_n * BLOCK_N], bar,
                a_bufs.index(slot).reshape([1, 1, BLOCK_R, BLOCK_N]),
            )  # fmt: skip
            tma.async_copy_global_to_shared(
                b_desc, [_SPAN, lo + size, row, pid_k * BLOCK_K], bar,
                b_bufs.index(slot).reshape([1, 1, BLOCK_R, BLOCK_K]),
            )  # fmt: skip
            count += 1


@gluon.jit
def _mma_partition(dw_desc, dw_ptr, stride_we, stride_wn, a_bufs, b_bufs, ready, empty, c_smem,
                   offsets_ptr, total_tiles, per_expert, n_tiles, k_tiles, N: gl.constexpr,
                   KD: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr, K_FASTEST: gl.constexpr,
                   DW_TMA: gl.constexpr, ACC_LAYOUT: gl.constexpr):  # fmt: skip
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = 0
    for tile in range(pid, total_tiles, programs):
        e, pid_n, pid_k, lo, size, steps = _tile(
            tile, per_expert, n_tiles, k_tiles, offsets_ptr, BLOCK_R, K_FASTEST
        )
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, ACC_LAYOUT)
        prev = 0
        for i in range(steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            a = a_bufs.index(slot)
            b = b_bufs.index(slot)
            acc = warpgroup_mma(a.permute((1, 0)), b, acc, is_async=True)
            # the multiply before this one is done: its slot goes back to the loader
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a, b))
            mbarrier.arrive(empty.index(prev), pred=i > 0)
            prev = slot
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev))
        if DW_TMA:
            # the previous tile's store has read the staging tile before it is overwritten
            tma.store_wait(0)
            c_smem.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(
                dw_desc, [e, pid_n * BLOCK_N, pid_k * BLOCK_K],
                c_smem.reshape([1, BLOCK_N, BLOCK_K]),
            )  # fmt: skip
        else:
            _store_dw(dw_ptr, acc, e, pid_n * BLOCK_N, pid_k * BLOCK_K, stride_we, stride_wn, N,
                      KD, BLOCK_N, BLOCK_K, gl.num_warps())  # fmt: skip
    if DW_TMA:
        tma.store_wait(0)


@gluon.jit
def _store_dw(dw_ptr, acc, e, n0, k0, stride_we, stride_wn, N: gl.constexpr, KD: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The tile through pointer stores marked evict-first (``dW`` is written once and not read
    here: its lines leave L2 before the operand rows that the next tiles read again), 16 bytes
    per thread and store, rows of ``BLOCK_K`` contiguous (the accumulator's own layout gives
    each thread 4-byte pieces: 2.5x slower)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8],
                                            [num_warps, 1], [1, 0])  # fmt: skip
    val = gl.convert_layout(acc.to(dw_ptr.dtype.element_ty), layout)
    ns = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))
    ks = k0 + gl.arange(0, BLOCK_K, gl.SliceLayout(0, layout))
    ptrs = dw_ptr + e.to(gl.int64) * stride_we + ns[:, None] * stride_wn + ks[None, :]
    mask = (ns < N)[:, None] & (ks < KD)[None, :]
    gl.store(ptrs, val, mask=mask, eviction_policy="evict_first")


@gluon.constexpr_function
def _acc_layout(block_n, block_k, num_warps):
    """The wgmma accumulator layout of a ``[block_n, block_k]`` tile: warps along ``block_n``
    (16 rows each), the widest instruction ``n`` that divides ``block_k``."""
    warps_m = min(num_warps, block_n // 16)
    warps = [warps_m, num_warps // warps_m]
    n = min(256, block_k // warps[1])
    while block_k % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def expert_weight_grad_ws_kernel(
    a_desc, b_desc, dw_desc, dw_ptr, offsets_ptr, E, stride_we, stride_wn, N: gl.constexpr,
    KD: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, K_FASTEST: gl.constexpr, DW_TMA: gl.constexpr,
    LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """``dW[e] = Σ A^T B`` over each expert's rows (module docstring). ``a_desc`` / ``b_desc``:
    bounded-rows descriptors over ``A [M, N]`` / ``B [M, Kd]``, boxes ``[1, 1, BLOCK_R,
    BLOCK_N / BLOCK_K]``; ``dw_desc`` over ``dW [E, N, Kd]``, box ``[1, BLOCK_N, BLOCK_K]``."""
    dtype: gl.constexpr = a_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_K], dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_N], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_K], b_layout)
    if DW_TMA:
        c_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_K], c_layout)
    else:
        c_smem = a_bufs  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    n_tiles: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles: gl.constexpr = (KD + BLOCK_K - 1) // BLOCK_K
    per_expert: gl.constexpr = n_tiles * k_tiles
    total_tiles = E * per_expert
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_K, num_warps)
    gl.warp_specialize(
        [
            (_mma_partition, (dw_desc, dw_ptr, stride_we, stride_wn, a_bufs, b_bufs, ready, empty,
                              c_smem, offsets_ptr, total_tiles, per_expert, n_tiles, k_tiles, N,
                              KD, BLOCK_R, BLOCK_N, BLOCK_K, STAGES, K_FASTEST, DW_TMA,
                              acc_layout)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                               total_tiles, per_expert, n_tiles, k_tiles, BLOCK_R, BLOCK_N,
                               BLOCK_K, STAGES, K_FASTEST)),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip


# --------------------------------------------------------------------------- launcher
def _gl_dtype(dtype):
    import torch

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _rows_descriptor(t, block):
    """Gluon's descriptor of :func:`.tma.bounded_rows_descriptor`'s view of ``t [M, C]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .tma import bounded_rows_descriptor

    d = bounded_rows_descriptor(t, block)
    layout = gl.NVMMASharedLayout.get_default_for(list(d.block_shape), _gl_dtype(t.dtype))
    return TensorDescriptor(t, list(d.shape), list(d.strides), list(d.block_shape), layout)


def expert_weight_grad_ws(a, b, offsets, dw, block_r, block_n, block_k, stages, num_warps,
                          programs, k_fastest=True, dw_tma=True):  # fmt: skip
    """``dw[e] = Σ_d a[d]^T b[d]`` over each expert's rows (``a [M, N]``, ``b [M, Kd]`` permuted
    rows, ``dw [E, N, Kd]``; all TMA-ready, 16-bit)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, N, KD = dw.shape
    dw_layout = gl.NVMMASharedLayout.get_default_for([1, block_n, block_k], _gl_dtype(dw.dtype))
    dw_desc = TensorDescriptor(dw, list(dw.shape), list(dw.stride()), [1, block_n, block_k],
                               dw_layout)  # fmt: skip
    expert_weight_grad_ws_kernel[(programs,)](
        _rows_descriptor(a, (block_r, block_n)), _rows_descriptor(b, (block_r, block_k)),
        dw_desc, dw, offsets, E, dw.stride(0), dw.stride(1), N, KD, block_r, block_n, block_k,
        stages, k_fastest, dw_tma, 40, num_warps=num_warps,
    )  # fmt: skip


# --------------------------------------------------------------------------- ping-pong (trial)
@gluon.jit
def _pp_partition(a_desc, b_desc, dw_desc, a_bufs, b_bufs, ready, empty, c_bufs, offsets_ptr,
                  total_tiles, per_expert, n_tiles, k_tiles, BLOCK_R: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  ACC_LAYOUT: gl.constexpr, ROLE: gl.constexpr):  # fmt: skip
    """ROLE 0 / 1: the MMA warpgroup of the program's even / odd tiles (ring ``ROLE``); 2: the
    loader, filling ring ``j % 2`` for the program's ``j``-th tile."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if ROLE == 2:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        c0 = 0
        c1 = 0
        j = 0
        for tile in range(pid, total_tiles, programs):
            e, pid_n, pid_k, lo, size, steps = _tile(tile, per_expert, n_tiles, k_tiles,
                                                      offsets_ptr, BLOCK_R, True)  # fmt: skip
            r = j % 2
            cnt = gl.where(r == 0, c0, c1)
            for i in range(steps):
                slot = r * STAGES + cnt % STAGES
                mbarrier.wait(empty.index(slot), ((cnt // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                row = _SPAN - size + i * BLOCK_R
                tma.async_copy_global_to_shared(
                    a_desc, [_SPAN, lo + size, row, pid_n * BLOCK_N], bar,
                    a_bufs.index(slot).reshape([1, 1, BLOCK_R, BLOCK_N]),
                )  # fmt: skip
                tma.async_copy_global_to_shared(
                    b_desc, [_SPAN, lo + size, row, pid_k * BLOCK_K], bar,
                    b_bufs.index(slot).reshape([1, 1, BLOCK_R, BLOCK_K]),
                )  # fmt: skip
                cnt += 1
            c0 = gl.where(r == 0, cnt, c0)
            c1 = gl.where(r == 1, cnt, c1)
            j += 1
    else:
        c_smem = c_bufs.index(ROLE)
        cnt = 0
        for tile in range(pid + ROLE * programs, total_tiles, 2 * programs):
            e, pid_n, pid_k, lo, size, steps = _tile(tile, per_expert, n_tiles, k_tiles,
                                                      offsets_ptr, BLOCK_R, True)  # fmt: skip
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, ACC_LAYOUT)
            prev = 0
            for i in range(steps):
                slot = ROLE * STAGES + cnt % STAGES
                mbarrier.wait(ready.index(slot), (cnt // STAGES) & 1)
                a = a_bufs.index(slot)
                b = b_bufs.index(slot)
                acc = warpgroup_mma(a.permute((1, 0)), b, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a, b))
                mbarrier.arrive(empty.index(prev), pred=i > 0)
                prev = slot
                cnt += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(prev))
            tma.store_wait(0)
            c_smem.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(
                dw_desc, [e, pid_n * BLOCK_N, pid_k * BLOCK_K],
                c_smem.reshape([1, BLOCK_N, BLOCK_K]),
            )  # fmt: skip
        tma.store_wait(0)


@gluon.jit
def expert_weight_grad_pp_kernel(
    a_desc, b_desc, dw_desc, offsets_ptr, E, N: gl.constexpr, KD: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = a_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_K], dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_R, BLOCK_N], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_R, BLOCK_K], b_layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    n_tiles: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles: gl.constexpr = (KD + BLOCK_K - 1) // BLOCK_K
    per_expert: gl.constexpr = n_tiles * k_tiles
    total_tiles = E * per_expert
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_K, num_warps)
    gl.warp_specialize(
        [
            (_pp_partition, (a_desc, b_desc, dw_desc, a_bufs, b_bufs, ready, empty, c_bufs,
                             offsets_ptr, total_tiles, per_expert, n_tiles, k_tiles, BLOCK_R,
                             BLOCK_N, BLOCK_K, STAGES, acc_layout, 0)),
            (_pp_partition, (a_desc, b_desc, dw_desc, a_bufs, b_bufs, ready, empty, c_bufs,
                             offsets_ptr, total_tiles, per_expert, n_tiles, k_tiles, BLOCK_R,
                             BLOCK_N, BLOCK_K, STAGES, acc_layout, 1)),
            (_pp_partition, (a_desc, b_desc, dw_desc, a_bufs, b_bufs, ready, empty, c_bufs,
                             offsets_ptr, total_tiles, per_expert, n_tiles, k_tiles, BLOCK_R,
                             BLOCK_N, BLOCK_K, STAGES, acc_layout, 2)),
        ],
        [4, 1],
        [MMA_REGS, 40],
    )  # fmt: skip


def expert_weight_grad_pp(a, b, offsets, dw, block_r, block_n, block_k, stages, programs,
                          mma_regs=224, maxnreg=168):  # fmt: skip
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, N, KD = dw.shape
    dw_layout = gl.NVMMASharedLayout.get_default_for([1, block_n, block_k], _gl_dtype(dw.dtype))
    dw_desc = TensorDescriptor(dw, list(dw.shape), list(dw.stride()), [1, block_n, block_k],
                               dw_layout)  # fmt: skip
    expert_weight_grad_pp_kernel[(programs,)](
        _rows_descriptor(a, (block_r, block_n)), _rows_descriptor(b, (block_r, block_k)),
        dw_desc, offsets, E, N, KD, block_r, block_n, block_k, stages, mma_regs, num_warps=4,
        maxnreg=maxnreg,
    )  # fmt: skip

"""Backward reductions over an expert's rows: weight gradients and router-weight gradients.

**Weight gradient** (:func:`expert_weight_grad_triton`): for every expert ``e`` with rows
``[offset[e], offset[e+1])`` of the permuted order,

    dW[e] = Σ_d A[d]^T B[d]   ([N, Kd])        db[e] = Σ_d A[d]   ([N])

Program ``(tile, e)`` owns one ``[BLOCK_N, BLOCK_K]`` tile of ``dW[e]`` and walks the expert's
rows ``BLOCK_R`` at a time in ascending order, accumulating ``A^T B`` in float32 (float64 for
float64 inputs) and rounding once. Every output element has one owner and a fixed summation
order: no atomics, the same bits on every run; an expert with no rows gets exact zeros.
``A`` and ``B`` rows can be read through the maps (``row = dest_to_src[d] mod T``) so that
neither ``dout`` nor ``x`` is ever permuted in memory, and ``A`` rows can be scaled by the
router weight of their slot for the bias gradient, the column sum of the ``A`` tiles taken by
the programs of the first ``Kd`` tile. (``dW2 = Σ dout[t]^T (w h)``: GEMM2's backward writes
``w·h``, so no MMA operand is rescaled here.) On Hopper the operand that is not gathered is
loaded through TMA.

**Router-weight gradient** (:func:`router_weight_grad_triton`):
``d w[t,k] = <dout[t], y[d]> = Σ_j partial[d, j] + <dout[t], b2[e]>`` with ``d = dest(k*T+t)``,
where ``partial[d, j]`` are the per-column-tile dot products ``<dout[t] W2[e], h[d]>`` left by
GEMM2's backward epilogue (``ACT_BWD`` in :mod:`.grouped_gemm`), summed here in fixed order.
GEMM2's output ``y`` is never stored for it. Dropped slots get zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ThinKernel, aligned, cdiv, next_pow2
from .grouped_gemm import _mma, _tma_ok


@triton.jit(do_not_specialize=["T"])
def _expert_weight_grad_kernel(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    dw_ptr,
    db_ptr,
    offsets_ptr,
    dest_to_src_ptr,
    scale_ptr,
    N,
    KD,
    T,
    stride_am,
    stride_an,
    stride_bm,
    stride_bk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_dbe,
    stride_dbn,
    stride_st,
    stride_sk,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    A_SCALE: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    A_DESC: tl.constexpr,
    B_DESC: tl.constexpr,
    A_T_LOAD: tl.constexpr,
    ACC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
        if A_GATHER or B_GATHER or A_SCALE:
            src = tl.load(dest_to_src_ptr + r, mask=r_ok, other=0)
            t = (src % T).to(tl.int64)
        a_rows = t if A_GATHER else r.to(tl.int64)
        b_rows = t if B_GATHER else r.to(tl.int64)
        # With a descriptor (TMA, Hopper) the tile may run past the expert into rows that
        # belong to the next one (or are zero-filled past M); the other operand is masked to
        # zero there, and those rows hold finite values, so they add nothing.
        if A_DESC:
            a = a_desc.load([r0.to(tl.int32), pid_n * BLOCK_N])
        elif A_T_LOAD:  # load A^T as it goes into the MMA ([BLOCK_N, BLOCK_R]), no transpose
            a_t = tl.load(
                a_ptr + a_rows[None, :] * stride_am + ns[:, None] * stride_an,
                mask=r_ok[None, :] & n_ok[:, None],
                other=0.0,
            )
            a = tl.trans(a_t)
        else:
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_am + ns[None, :] * stride_an,
                mask=r_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
        if HAS_DBIAS:
            if A_SCALE:  # db = Σ w a (the MMA operand itself is not scaled)
                w = tl.load(scale_ptr + t * stride_st + (src // T) * stride_sk, mask=r_ok, other=0)
                col_sum += tl.sum(a.to(ACC) * w.to(ACC)[:, None], axis=0)
            else:
                col_sum += tl.sum(tl.where(r_ok[:, None], a.to(ACC), 0.0), axis=0)
        if B_DESC:
            b = b_desc.load([r0.to(tl.int32), pid_k * BLOCK_K])
        else:
            b = tl.load(
                b_ptr + b_rows[:, None] * stride_bm + ks[None, :] * stride_bk,
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        if A_T_LOAD and not A_DESC:
            acc = _mma(a_t, b, acc, DOT_PRECISION)
        else:
            acc = _mma(tl.trans(a), b, acc, DOT_PRECISION)
    dw_ptrs = (
        dw_ptr + e.to(tl.int64) * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk
    )
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_DBIAS:  # noqa: SIM102 (a constexpr test, then a run-time one)
        if pid_k == 0:
            db_ptrs = db_ptr + e.to(tl.int64) * stride_dbe + ns * stride_dbn
            tl.store(db_ptrs, col_sum.to(db_ptr.dtype.element_ty), mask=n_ok)


def _descriptor(t: torch.Tensor, block: list[int], use_tma: bool):
    """A TMA descriptor over ``t [M, C]`` (Hopper, 16-bit, aligned), else ``None``."""
    if not use_tma or t.dtype not in (torch.float16, torch.bfloat16) or t.numel() == 0:
        return None
    if not _tma_ok(t):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def expert_weight_grad_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    dw: torch.Tensor,
    config: tuple,
    *,
    db: torch.Tensor | None = None,
    dest_to_src: torch.Tensor | None = None,
    a_gather: bool = False,
    b_gather: bool = False,
    db_scale: torch.Tensor | None = None,
    num_rows: int,
    allow_tf32: bool = False,
    use_tma: bool = False,
    a_t_load: bool = False,
) -> None:
    """``dw[e] = Σ_d A[d]^T B[d]`` and ``db[e] = Σ_d s_d A[d]`` over the rows of each expert.

    Args:
        a: ``[M, N]`` permuted rows, or ``[T, N]`` token rows with ``a_gather``.
        b: ``[M, Kd]`` permuted rows, or ``[T, Kd]`` token rows with ``b_gather``.
        offsets: ``expert_first_token_offset [E+1]``.
        dw: ``[E, N, Kd]`` output, any strides (e.g. ``torch.empty_like(weight)``).
        config: ``(BLOCK_R, BLOCK_N, BLOCK_K, num_warps, num_stages)``
            (:func:`moe_route.tuning.weight_grad_config`).
        db: optional ``[E, N]`` bias-gradient output.
        dest_to_src: ``expanded_dest_row_to_expanded_source_row``, for gathers and scaling.
        db_scale: ``topk_weights [T, K]``: ``s_d`` is the router weight of row ``d``'s slot
            (``1`` without it). ``dW2`` takes ``B = w·h`` from GEMM2's backward instead of
            scaling an MMA operand.
        num_rows: ``M = T*K``.
        use_tma: load the operand that is not gathered through a TMA descriptor (only when the
            other one is gathered and masked; the plan decides: SM90+).
    """
    E, N, KD = dw.shape
    if N == 0 or KD == 0:
        return
    br, bn, bk, warps, stages = config
    T = a.shape[0] if a_gather else b.shape[0] if b_gather else max(num_rows, 1)
    if db_scale is not None:
        T = db_scale.shape[0]
    if a.dtype == torch.float64:
        precision = "fma"
    else:
        precision = "tf32" if allow_tf32 or a.dtype != torch.float32 else "ieee"
    a_desc = _descriptor(a, [br, bn], use_tma) if b_gather and not a_gather else None
    b_desc = _descriptor(b, [br, bk], use_tma) if a_gather and not b_gather else None
    idx = dest_to_src if dest_to_src is not None else offsets
    scale = db_scale if db_scale is not None else dw
    dbt = db if db is not None else dw
    grid = (cdiv(N, bn) * cdiv(KD, bk), E)
    key = (
        config, a.dtype, b.dtype, dw.dtype, dbt.dtype, scale.dtype, a.stride(), b.stride(),
        dw.stride(), dbt.stride(), scale.stride(), a_gather, b_gather, db_scale is not None,
        db is not None, a_desc is not None, b_desc is not None, a_t_load, allow_tf32, N, KD,
        aligned(a, b, dw, dbt, offsets, idx, scale),
    )  # fmt: skip
    _WEIGHT_GRAD.launch(
        key, grid,
        (
            a, b, a_desc if a_desc is not None else a, b_desc if b_desc is not None else b, dw,
            dbt, offsets, idx, scale, N, KD, max(T, 1), a.stride(0), a.stride(1), b.stride(0),
            b.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
            db.stride(0) if db is not None else 0, db.stride(1) if db is not None else 0,
            scale.stride(0) if db_scale is not None else 0,
            scale.stride(1) if db_scale is not None else 0,
        ),
        lambda: dict(
            A_GATHER=a_gather, B_GATHER=b_gather, A_SCALE=db_scale is not None,
            HAS_DBIAS=db is not None, A_DESC=a_desc is not None, B_DESC=b_desc is not None,
            A_T_LOAD=a_t_load, ACC=tl.float64 if a.dtype == torch.float64 else tl.float32,
            DOT_PRECISION=precision, BLOCK_R=br, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            num_stages=stages,
        ),
    )  # fmt: skip


_WEIGHT_GRAD = ThinKernel(_expert_weight_grad_kernel)


@triton.jit(do_not_specialize=["T"])
def _router_weight_grad_kernel(
    partial_ptr,
    dout_ptr,
    b2_ptr,
    src_to_dest_ptr,
    expert_for_src_ptr,
    dw_ptr,
    T,
    H,
    NT,
    stride_pm,
    stride_dt,
    stride_dh,
    stride_be,
    stride_bh,
    stride_wt,
    stride_wk,
    K: tl.constexpr,
    HAS_B2: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_NT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < T * K
    e = tl.load(expert_for_src_ptr + s, mask=s_ok, other=-1)
    routed = e >= 0
    d = tl.load(src_to_dest_ptr + s, mask=routed, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_NT)
    p = tl.load(
        partial_ptr + d[:, None] * stride_pm + j[None, :],
        mask=routed[:, None] & (j < NT)[None, :],
        other=0.0,
    )
    g = tl.sum(p.to(ACC), axis=1)
    t = (s % T).to(tl.int64)
    k = s // T
    if HAS_B2:
        e64 = tl.maximum(e, 0).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            m = routed[:, None] & (hh < H)[None, :]
            dv = tl.load(dout_ptr + t[:, None] * stride_dt + hh[None, :] * stride_dh, mask=m)
            bv = tl.load(b2_ptr + e64[:, None] * stride_be + hh[None, :] * stride_bh, mask=m)
            g += tl.sum(tl.where(m, dv.to(ACC) * bv.to(ACC), 0.0), axis=1)
    g = tl.where(routed, g, 0.0)
    tl.store(dw_ptr + t * stride_wt + k * stride_wk, g.to(dw_ptr.dtype.element_ty), mask=s_ok)


def router_weight_grad_triton(
    partial: torch.Tensor,
    dout: torch.Tensor,
    b2: torch.Tensor | None,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    dw: torch.Tensor,
) -> None:
    """``dw [T, K]`` (preallocated) from GEMM2-backward's ``partial [M, NT]``; see above."""
    T, K = dw.shape
    if T == 0:
        return
    nt = partial.shape[1]
    block_s = 64
    acc = tl.float64 if torch.float64 in (partial.dtype, dout.dtype) else tl.float32
    bt = b2 if b2 is not None else dout
    key = (
        K, nt, partial.dtype, dout.dtype, bt.dtype, dw.dtype, partial.stride(), dout.stride(),
        bt.stride(), dw.stride(), b2 is not None,
        aligned(partial, dout, bt, src_to_dest, expert_for_src, dw),
    )  # fmt: skip
    _ROUTER_GRAD.launch(
        key, (cdiv(T * K, block_s),),
        (
            partial, dout, bt, src_to_dest, expert_for_src, dw, T, dout.shape[1], nt,
            partial.stride(0), dout.stride(0), dout.stride(1),
            bt.stride(0) if b2 is not None else 0, bt.stride(1) if b2 is not None else 0,
            dw.stride(0), dw.stride(1),
        ),
        lambda: dict(
            K=K, HAS_B2=b2 is not None, ACC=acc, BLOCK_S=block_s,
            BLOCK_NT=next_pow2(nt), BLOCK_H=128, num_warps=4,
        ),
    )  # fmt: skip


_ROUTER_GRAD = ThinKernel(_router_weight_grad_kernel)

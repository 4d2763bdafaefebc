"""GEMM2 with the finalize in its epilogue (``finalize="fused"``).

* :func:`_gemm_finalize_kernel` — GEMM2 over :mod:`.gemm_mainloop`'s main loop, the finalize
  in its epilogue, in one of two modes. ``ORDERED`` (deterministic): the tile stores its rows
  of ``y`` to a scratch ``[T*K, H]`` buffer, then each row bumps the arrival counter of its
  ``(token, column tile)``; the row whose bump completes the token reduces the token's rows in
  ``k`` order — the standalone finalize's arithmetic, so the bits do not depend on which tile
  arrives last. Otherwise (atomic): ``w[t,k]·y[d]`` is added into a float32 (float64)
  ``[T, H]`` output with atomics; the sum order then varies run to run.

:func:`grouped_gemm_finalize_triton` launches it (not a launch class: the forward calls it
per call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ThinKernel, cdiv, next_pow2
from .gemm_mainloop import (
    _VARYING,
    GemmConfig,
    _a_descriptor,
    _acc,
    _beyond_tiles,
    _m_tiles,
    _mainloop,
    _precision,
    _program_tile,
    _tile_expert,
    _w_descriptor,
)

#: Rows per step of the ordered fused finalize's reduction.
RED_ROWS = 16


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


# --------------------------------------------------------------------------- launcher
_FINALIZE = ThinKernel(_gemm_finalize_kernel)


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

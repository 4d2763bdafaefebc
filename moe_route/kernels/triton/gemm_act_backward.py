"""GEMM2's backward with the activation's backward in its epilogue (the fused step 1).

* :func:`_gemm_act_bwd_kernel` — ``g[d] = dout[t] @ W2[e]`` (``A`` gathered from ``dout``,
  ``W = W2`` seen as ``[E, I, H]``) over :mod:`.gemm_mainloop`'s main loop; the epilogue
  (:func:`_act_bwd_epilogue`) recomputes ``h[d] = act(z[d])``, writes ``w[t,k]·h[d]`` (for
  ``dW2``), the partial router-weight gradient ``<g[d], h[d]>`` of its column tile (summed in
  fixed order by :mod:`.weight_grad`), and ``dz = act'(z)·w[t,k]·g`` in ``W1``'s gate/up
  layout. (The split alternative, a plain GEMM storing ``g`` and then a pass over the rows, is
  :mod:`.act_backward`.)

:class:`ActBackwardLaunch` is the launch prepared from the operands' layouts;
:func:`grouped_gemm_act_backward_triton` the one-shot launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, next_pow2
from .activation import gated_forward_backward, plain_backward, plain_forward
from .gemm_mainloop import (
    _VARYING,
    GemmConfig,
    GemmEpilogue,
    _a_descriptor,
    _acc,
    _beyond_tiles,
    _gate_up_rows,
    _m_tiles,
    _mainloop,
    _precision,
    _program_tile,
    _tile_expert,
    _w_descriptor,
    _zero_rows,
)


@triton.jit(do_not_specialize=_VARYING)
def _gemm_act_bwd_kernel(
    a_ptr, a_desc, w_ptr, w_desc, wh_ptr, z_ptr, dz_ptr, partial_ptr, weights_ptr, offsets_ptr,
    dest_to_src_ptr, E, M_ROWS, M_TILES, N_OUT, KD, T,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_zm,
    stride_wt, stride_wkk,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACC: tl.constexpr,
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
            UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP, INTERLEAVED, ACC,
        )  # fmt: skip
        part += _act_bwd_epilogue(
            acc_hi, n_tile * BLOCK_N + half + tl.arange(0, half), local, row_ok, wt, bases,
            N_OUT, stride_zm, stride_om, stride_on, ACT, GATED, ALPHA, LIMIT, UP_OFFSET,
            GATE_SOFTCAP, UP_SOFTCAP, INTERLEAVED, ACC,
        )  # fmt: skip
    else:
        part = _act_bwd_epilogue(
            acc, cols, local, row_ok, wt, bases, N_OUT, stride_zm, stride_om, stride_on, ACT,
            GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP, INTERLEAVED, ACC,
        )  # fmt: skip
    # this tile's share of <dout[t] W2[e], h[d]>
    tl.store(partial_ptr + rows.to(tl.int64) * n_tiles + n_tile, part, mask=row_ok)


@triton.jit
def _act_bwd_epilogue(acc, cols, local, row_ok, wt, bases, N_OUT, stride_zm, stride_om,
                      stride_on, ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
                      LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
                      UP_SOFTCAP: tl.constexpr, INTERLEAVED: tl.constexpr,
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
    dh = acc * wt[:, None]
    if GATED:
        zu = tl.load(z_base + z_rows + up_cols[None, :], mask=mask, other=0.0).to(ACC)
        # h and dz from one evaluation of each term (the soft caps' would not fit twice)
        h, d_gate, d_up = gated_forward_backward(zg, zu, dh, ACT, ALPHA, LIMIT, UP_OFFSET,
                                                 GATE_SOFTCAP, UP_SOFTCAP)  # fmt: skip
    else:
        h = plain_forward(zg, ACT)
    h = h.to(wh_base.dtype.element_ty).to(ACC)  # the forward's h, bit for bit
    wh_offs = local[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(wh_base + wh_offs, (h * wt[:, None]).to(wh_base.dtype.element_ty), mask=mask)
    part = tl.sum(acc * h, axis=1)
    if GATED:
        tl.store(dz_base + z_rows + gate_cols[None, :], d_gate.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
        tl.store(dz_base + z_rows + up_cols[None, :], d_up.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
    else:
        d_x = plain_backward(zg, dh, ACT)
        tl.store(dz_base + z_rows + gate_cols[None, :], d_x.to(dz_base.dtype.element_ty),
                 mask=mask)  # fmt: skip
    return part


# --------------------------------------------------------------------------- launcher
_ACT_BWD = ThinKernel(_gemm_act_bwd_kernel)


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
            UP_OFFSET=epilogue.up_offset, GATE_SOFTCAP=epilogue.gate_softcap,
            UP_SOFTCAP=epilogue.up_softcap, INTERLEAVED=epilogue.interleaved,
            ACC=_acc(dout.dtype),
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

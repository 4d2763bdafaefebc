"""Quantised experts: the grouped GEMM on quantised weights.

:func:`_quant_gemm_kernel` — GEMM1 / GEMM2 over expert-grouped rows (the tile order, expert
lookup and epilogue of :mod:`.gemm_mainloop`, shared through its ``@triton.jit`` helpers), in
one of two products (the tokens' FP8 codes come from :mod:`.quantize_rows`, or from the main
loop itself):

- ``MXFP4 = False``: FP8 × FP8. Each ``BLOCK_K = 128`` step is one tensor-core product of
  e4m3 codes whose float32 result is scaled by the row's activation scale and the weight
  block's scale and added to a float32 accumulator: Hopper's FP8 MMA accumulates with
  reduced precision, so no partial sum runs longer than one scale block (DeepSeek-V3's and
  DeepGEMM's promotion). Per-channel scales (``fp8_channel``) come with a zero k-stride.
- ``MXFP4 = True``: 16-bit activations × e2m1 weights, unpacked in the loader and scaled by
  their ue8m0 exponent (one per 32 values) before a 16-bit MMA (Hopper has no FP4 MMA): a
  packed byte's low nibble is the weight of an even column, its high nibble of the next odd
  one, so each product is two, on the tokens' even and odd columns
  (:func:`.mxfp4._mxfp4_mainloop`).

On FP8 a gated GEMM1 computes gate and up as one product twice as wide (a ``[BLOCK_M,
2*BLOCK_N]`` accumulator, split after the loop), and with ``A_DESC`` / ``W_DESC`` (SM90)
the weights, and GEMM2's input, come through TMA descriptors: the same bits as the
pointer-fed loads. With ``SWAP`` (SM90's 16-row tiles) each block's product is computed
transposed, the weights first: on SM90 an FP8 MMA of 64 weight rows by the 16 token rows,
where the unswapped 16-row product is 16-bit MMAs on codes converted pair by pair.

``OUT_FP8`` (GEMM1 on FP8): the epilogue quantises ``act(...)`` per row over its
``BLOCK_N = 128`` columns (the activations' group) and writes GEMM2's input as e4m3 codes and
scales, so the intermediate is half the bytes and no separate pass reads it. Dropped rows
``[offset[E], M)`` are written as zeros (codes and scales), so every output is defined.

``UPCAST`` (the CPU interpreter, whose FP8 dot and float-to-e4m3 rounding are wrong, and which
runs no PTX): the e4m3 operands are widened to fp16 (exactly) before the product, codes are
rounded in integer arithmetic (:func:`.fp8_codes._e4m3_bits`), and e2m1 weights unpack in
Triton operations rather than PTX (as on fp16 activations, :func:`.mxfp4._e2m1_pair`); the
scaling, gathers and epilogue are the GPU's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, LaunchKey, ThinKernel, cdiv, next_pow2
from .activation import gated_forward, plain_forward
from .fp8_codes import fp8_codes, fp8_scale
from .gemm_mainloop import (
    GemmConfig,
    GemmEpilogue,
    _a_rows,
    _beyond_tiles,
    _gate_up_descriptor,
    _gate_up_rows,
    _m_tiles,
    _program_tile,
    _tile_expert,
)
from .mxfp4 import _mxfp4_mainloop
from .tma import descriptor, tma_ok

#: Columns per scale block along the reduction (the FP8 formats' ``k`` block).
SCALE_K = 128

_VARYING = ["M_ROWS", "M_TILES", "T"]


# --------------------------------------------------------------------------- grouped GEMM
@triton.jit
def _fp8_rows(n0, N_OUT, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, SPLIT: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """The ``W`` rows of an FP8 tile's product (``WN`` = ``2*BLOCK_N`` columns when gated: the
    gate rows of output columns ``n0 ...`` then their up rows, or with ``SPLIT == 2`` the
    interleaved rows ``2*n0 ...`` as one box reads them), and which of them exist."""
    if GATED:
        j = tl.arange(0, 2 * BLOCK_N)
        if SPLIT == 2:
            rows = 2 * n0 + j
            ok = rows < 2 * N_OUT
        else:
            cols = n0 + j % BLOCK_N
            gate_rows, up_rows = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
            rows = tl.where(j < BLOCK_N, gate_rows, up_rows)
            ok = cols < N_OUT
    else:
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < N_OUT
    return rows, ok


@triton.jit
def _fp8_operand(v, s, UPCAST: tl.constexpr):
    """float32 rows ``v`` as the e4m3 operand of a product, on the rows' scales ``s``."""
    a = fp8_codes(v, s[:, None], UPCAST)
    if UPCAST:  # (the interpreter's codes come as uint8)
        a = a.to(tl.float8e4nv, bitcast=True)
    return a


@triton.jit
def _scaled_fp8_dot(a, w, a_s, w_s, UPCAST: tl.constexpr):
    """One scale block's product in float32: ``(a @ w) · a_s[:, None] · w_s[None, :]``."""
    if UPCAST:
        part = tl.dot(a.to(tl.float16), w.to(tl.float16), out_dtype=tl.float32)
    else:
        part = tl.dot(a, w, out_dtype=tl.float32)
    return part * a_s[:, None] * w_s[None, :]


@triton.jit
def _scaled_fp8_dot_t(w, a, a_s, w_s, UPCAST: tl.constexpr):
    """:func:`_scaled_fp8_dot` transposed, the weights first: ``(w @ a.T) · a_s[None, :] ·
    w_s[:, None]`` for ``w [WN, BLOCK_K]``, so that 16 rows of ``a`` are the narrow side of an
    SM90 FP8 MMA (64 rows of weights per warpgroup) rather than 16-bit MMAs on converted
    codes. The scales multiply in the same order, so each element rounds as there."""
    if UPCAST:
        part = tl.dot(w.to(tl.float16), tl.trans(a).to(tl.float16), out_dtype=tl.float32)
    else:
        part = tl.dot(w, tl.trans(a), out_dtype=tl.float32)
    return part * a_s[None, :] * w_s[:, None]


@triton.jit
def _fp8_mainloop(a_ptr, a_desc, as_ptr, w_base, w_desc, ws_base, e, first_row, a_rows, row_ok,
                  w_rows, w_ok, n0, KD, stride_am, stride_ak, stride_asm, stride_ask,
                  stride_wn, stride_wk, stride_sn, stride_sk, SN: tl.constexpr,
                  A_DESC: tl.constexpr, W_DESC: tl.constexpr, SPLIT: tl.constexpr,
                  A_QUANT: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr,
                  SWAP: tl.constexpr, BLOCK_M: tl.constexpr, WN: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """``Σ_k (A[rows, k] @ W[e][w_rows, k].T) · a_s[rows, k] · w_s[w_rows, k]`` over the
    ``BLOCK_K = 128`` blocks ``k`` of ``KD``, in float32: each block one FP8 product, scaled and
    added (the module doc). ``A`` through ``a_desc`` (rows ``first_row ...``, past the expert
    read but never stored) or gathered rows ``a_rows``; ``W`` through ``w_desc`` (boxes of
    ``WN`` rows: one ``[1, BLOCK_N, BLOCK_K]`` box, gate and up halves in one
    ``[1, 2, WN/2, BLOCK_K]`` box (``SPLIT == 1``) or ``WN`` interleaved rows (``SPLIT == 2``))
    or pointers at ``w_rows``.

    ``A_QUANT``: ``A`` holds 16-bit or float32 rows, quantised here as
    :func:`.quantize_rows._quantize_rows_kernel` (or :func:`_quant_tile`'s ``OUT_FP8``
    epilogue) does: the same codes and scales, so the same products. ``1``, each block on its
    own scale; ``2``, one scale per row, from a first pass over the row. Else ``A`` holds e4m3
    codes and ``as_ptr`` their scales. ``SWAP``: each block's product as ``(W @ A.T).T``
    (:func:`_scaled_fp8_dot_t`), the accumulator ``[WN, BLOCK_M]`` until the end."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    if SWAP:  # [WN, BLOCK_K]: the weights are the product's first operand
        w_ptrs = w_base + w_rows[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk
    else:
        w_ptrs = w_base + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    ws_ptrs = ws_base + (w_rows // SN).to(tl.int64) * stride_sn
    as_ptrs = as_ptr + a_rows * stride_asm
    if A_QUANT == 2:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, KD, BLOCK_K):
            ok = row_ok[:, None] & (k0 + ks < KD)[None, :]
            v = tl.load(a_ptrs + k0 * stride_ak, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        row_s = fp8_scale(amax, UE8M0)
    if SWAP:
        acc = tl.zeros([WN, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, WN], dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        k_ok = k0 + ks < KD
        if A_DESC:
            a = a_desc.load([first_row.to(tl.int32), k0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            if SPLIT == 1:
                w = tl.reshape(w_desc.load([e, 0, n0, k0]), [WN, BLOCK_K])
            elif SPLIT == 2:
                w = tl.reshape(w_desc.load([e, 2 * n0, k0]), [WN, BLOCK_K])
            else:
                w = tl.reshape(w_desc.load([e, n0, k0]), [WN, BLOCK_K])
            if not SWAP:
                w = w.T
        elif SWAP:
            w = tl.load(w_ptrs, mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if A_QUANT:
            v = a.to(tl.float32)
            if A_QUANT == 1:  # noqa: SIM108 (constexpr branches; row_s exists in one)
                a_s = fp8_scale(tl.max(tl.abs(v), axis=1), UE8M0)
            else:
                a_s = row_s
            a = _fp8_operand(v, a_s, UPCAST)
        else:
            a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptrs, mask=w_ok, other=0.0)
        if SWAP:
            acc += _scaled_fp8_dot_t(w, a, a_s, w_s, UPCAST)
        else:
            acc += _scaled_fp8_dot(a, w, a_s, w_s, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
        as_ptrs += stride_ask
        ws_ptrs += stride_sk
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _quant_zero_rows(out_ptr, os_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om, stride_on,
                     stride_osm, OUT_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):  # fmt: skip
    """A tile of the dropped rows ``[offset[E], M)``: zeros (codes and scales)."""
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M_ROWS
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptrs, zeros, mask=row_ok[:, None] & (cols < N_OUT)[None, :])
    if OUT_FP8:
        tl.store(os_ptr + rows.to(tl.int64) * stride_osm + n_tile,
                 tl.zeros([BLOCK_M], dtype=tl.float32), mask=row_ok)  # fmt: skip


@triton.jit
def _quant_tile(
    a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, bias_ptr, dest_to_src_ptr,
    e, first_row, row_end, n_tile, N_OUT, KD, KP, T,
    stride_am, stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_om, stride_on, stride_osm, stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
    MXFP4: tl.constexpr, SN: tl.constexpr, OUT_FP8: tl.constexpr, UE8M0: tl.constexpr,
    UPCAST: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, SPLIT: tl.constexpr,
    A_QUANT: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of expert ``e``'s rows ``[first_row, row_end)``:
    main loop, bias, activation, store (with ``OUT_FP8`` as e4m3 codes and one scale per row
    of the tile)."""
    rows = first_row + tl.arange(0, BLOCK_M)
    n0 = n_tile * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N_OUT
    row_ok = rows < row_end
    gate_rows, up_rows = _gate_up_rows(cols, N_OUT, GATED, INTERLEAVED)
    a_rows = _a_rows(dest_to_src_ptr, rows, row_ok, T, GATHER)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    ws_base = ws_ptr + e.to(tl.int64) * stride_se
    if MXFP4:
        acc, acc_up = _mxfp4_mainloop(
            a_ptr, w_base, ws_base, a_rows, row_ok, gate_rows, up_rows, col_ok, KD, KP,
            stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk, GATED, UPCAST,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    else:
        w_rows, w_ok = _fp8_rows(n0, N_OUT, GATED, INTERLEAVED, SPLIT, BLOCK_N)
        WN: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
        acc = _fp8_mainloop(
            a_ptr, a_desc, as_ptr, w_base, w_desc, ws_base, e, first_row, a_rows, row_ok,
            w_rows, w_ok, n0, KD, stride_am, stride_ak, stride_asm, stride_ask, stride_wn,
            stride_wk, stride_sn, stride_sk, SN, A_DESC, W_DESC, SPLIT, A_QUANT, UE8M0, UPCAST,
            SWAP, BLOCK_M, WN, BLOCK_K,
        )  # fmt: skip
        if GATED and SPLIT == 2:  # columns: gate, up, gate, up, ...
            acc, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        elif GATED:  # columns: BLOCK_N gate, then BLOCK_N up
            acc, acc_up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        else:
            acc_up = acc
    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc += tl.load(b_base + gate_rows * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[
            None, :
        ]
        if GATED:
            acc_up += tl.load(b_base + up_rows * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[
                None, :
            ]
    if GATED:
        h = gated_forward(acc, acc_up, ACT, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP)
    else:
        h = plain_forward(acc, ACT)
    mask = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    if OUT_FP8:
        s = fp8_scale(tl.max(tl.where(mask, tl.abs(h), 0.0), axis=1), UE8M0)
        tl.store(out_ptrs, fp8_codes(h, s[:, None], UPCAST), mask=mask)
        tl.store(os_ptr + rows.to(tl.int64) * stride_osm + n_tile, s, mask=row_ok)
    else:
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _quant_gemm_kernel(
    a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, bias_ptr, offsets_ptr,
    dest_to_src_ptr, E, M_ROWS, M_TILES, N_OUT, KD, KP, T,
    stride_am, stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_om, stride_on, stride_osm, stride_be, stride_bn,
    ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
    MXFP4: tl.constexpr, SN: tl.constexpr, OUT_FP8: tl.constexpr, UE8M0: tl.constexpr,
    UPCAST: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, SPLIT: tl.constexpr,
    A_QUANT: tl.constexpr, SWAP: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``out[d] = act(A[d] @ W[e].T + b[e])`` for each routed row ``d`` of expert ``e``, one
    program per tile (:func:`_quant_tile`); with ``OUT_FP8`` stored as e4m3 codes plus one
    scale per row per column tile; with ``A_QUANT`` (:func:`_fp8_mainloop`) ``A`` holds
    16-bit or float32 rows, quantised in the main loop."""
    m_tile, n_tile = _program_tile(M_TILES, N_OUT, BLOCK_N, GROUP_M)
    if _beyond_tiles(offsets_ptr, m_tile, E, M_ROWS, BLOCK_M):
        return
    e, first_row, row_end = _tile_expert(offsets_ptr, m_tile, E, BLOCK_M, E_POW2)
    if e >= E:  # past the experts: the dropped rows [offset[E], M) are zeros
        _quant_zero_rows(out_ptr, os_ptr, first_row, n_tile, M_ROWS, N_OUT, stride_om,
                         stride_on, stride_osm, OUT_FP8, BLOCK_M, BLOCK_N)  # fmt: skip
        return
    _quant_tile(
        a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, bias_ptr,
        dest_to_src_ptr, e, first_row, row_end, n_tile, N_OUT, KD, KP, T, stride_am,
        stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk, stride_se,
        stride_sn, stride_sk, stride_om, stride_on, stride_osm, stride_be, stride_bn, ACT,
        GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP, INTERLEAVED, HAS_BIAS, GATHER,
        MXFP4, SN, OUT_FP8, UE8M0, UPCAST, A_DESC, W_DESC, SPLIT, A_QUANT, SWAP, BLOCK_M,
        BLOCK_N, BLOCK_K,
    )  # fmt: skip


_QUANT_GEMM = ThinKernel(_quant_gemm_kernel)


def _upcast(mxfp4: bool, a_dtype: torch.dtype) -> bool:
    """The kernels' ``UPCAST``: the interpreter's FP8 and FP4 workarounds, and the MXFP4
    weights unpacked in Triton operations rather than PTX on 16-bit activations other than
    bf16 (:func:`.mxfp4._e2m1_pair`)."""
    return INTERPRETING or (mxfp4 and a_dtype != torch.bfloat16)


def in_loop_quant(x_group: int) -> int:
    """The ``a_quant`` (``A_QUANT``) of 16-bit tokens quantised in a main loop with a scale per
    ``x_group`` columns: 1 (per group), or 2 for ``x_group = 0`` (per row)."""
    return 1 if x_group else 2


class QuantGemmLaunch:
    """GEMM1 / GEMM2 on quantised weights, prepared from the operands' layouts (as
    :class:`.grouped_gemm.GemmLaunch` is for 16-bit weights).

    ``a``: e4m3 rows with ``a_scale [rows, groups]`` (FP8), or 16-bit rows (MXFP4); read through
    ``dest_to_src`` when ``gather``. ``w``: e4m3 ``[E, N, K]`` with ``w_scale`` ``[E, nb, kb]``
    (block ``(sn, 128)``) or ``[E, N]`` (per channel), or packed e2m1 ``[E, N, K/2]`` with
    ue8m0 ``[E, N, K/32]``. ``out_fp8``: the output as e4m3 codes and scales per 128 columns
    (``cfg.block_n`` must be 128). ``a_quant`` (FP8): ``a`` holds 16-bit or float32 rows
    (no ``a_scale``), quantised in the main loop per 128 columns (1) or per row (2), as the
    quantiser, or an ``out_fp8`` epilogue, would have written them. ``kd``: the logical
    reduction width.

    ``cfg.use_tma`` (FP8): the weights, and ``a`` where it is not gathered, through TMA
    descriptors where TMA can address them, built per call (they hold addresses).
    """

    __slots__ = ("E", "cfg", "cx", "epilogue", "fp8", "gather", "kd", "key", "kp",
                 "n_out", "sm90", "static", "strides")  # fmt: skip

    def __init__(self, a, a_scale, w, w_scale, kd: int, cfg: GemmConfig, epilogue: GemmEpilogue,
                 bias, gather: bool, out_dtype: torch.dtype, out_fp8: bool, mxfp4: bool,
                 block_n_scale: int, ue8m0: bool, a_quant: int = 0):  # fmt: skip
        E, n_w, kp = w.shape
        n_out = n_w // 2 if epilogue.gated else n_w
        self.E, self.kd, self.n_out, self.cfg, self.gather = E, kd, n_out, cfg, gather
        self.epilogue, self.fp8 = epilogue, not mxfp4
        self.kp = kp
        sa, sw, ss = a.stride(), w.stride(), w_scale.stride()
        # per channel / per token: one scale for every k block (a zero k-stride)
        s_strides = (ss[0], ss[1], 0) if w_scale.dim() == 2 else ss
        sa_s = (0, 0)
        if a_scale is not None:
            sa_s = (a_scale.stride(0), 0 if a_scale.shape[1] == 1 else a_scale.stride(1))
        sb = bias.stride() if bias is not None else (0, 0)
        so = (n_out, 1)
        sos = cdiv(n_out, cfg.block_n) if out_fp8 else 0
        self.strides = (*sa, *sa_s, *sw, *s_strides, *so, sos, *sb)
        self.static = (cfg, epilogue, a.dtype, w.dtype, w_scale.dtype, out_dtype,
                       bias.dtype if bias is not None else None, self.strides, gather, out_fp8,
                       mxfp4, block_n_scale, ue8m0, a_quant, E, n_out, kd)  # fmt: skip
        self.cx = dict(
            ACT=epilogue.act, GATED=epilogue.gated, ALPHA=epilogue.alpha, LIMIT=epilogue.limit,
            UP_OFFSET=epilogue.up_offset, GATE_SOFTCAP=epilogue.gate_softcap,
            UP_SOFTCAP=epilogue.up_softcap, INTERLEAVED=epilogue.interleaved,
            HAS_BIAS=bias is not None, GATHER=gather, MXFP4=mxfp4, SN=block_n_scale,
            OUT_FP8=out_fp8, UE8M0=ue8m0, UPCAST=_upcast(mxfp4, a.dtype), A_QUANT=a_quant,
            SWAP=cfg.swap_ab and not mxfp4,
            E_POW2=next_pow2(E + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        # On SM90 the warp-specialised kernel (:mod:`.quant_sm90`), where the layout allows
        # (docs/decisions.md, "FP8 prefill: a warp-specialised kernel").
        self.sm90 = None
        if cfg.use_tma and self.fp8 and not a_quant and not INTERPRETING:
            from .quant_sm90 import Fp8Sm90Launch

            if Fp8Sm90Launch.serves(w, epilogue, n_out, block_n_scale):
                self.sm90 = Fp8Sm90Launch(a, a_scale, w, w_scale, kd, epilogue, bias, gather,
                                          out_dtype, out_fp8, block_n_scale, ue8m0,
                                          cfg.group_m)  # fmt: skip
        # without TMA nothing depends on the addresses: one key for every call
        tma = cfg.use_tma and self.fp8
        self.key = None if tma else LaunchKey((*self.static, False, False, self._split(None)))

    def _split(self, w_desc) -> int:
        """How a gated tile's weight rows come (:func:`_fp8_rows`): interleaved rows through a
        descriptor 2, else gate then up 1; 0 not gated."""
        if not self.epilogue.gated:
            return 0
        return 2 if w_desc is not None and self.epilogue.interleaved else 1

    def _descriptors(self, a, w):
        """``(a_desc, w_desc)`` of this call's FP8 operands where TMA addresses them."""
        bm, bn, bk = self.cfg.block_m, self.cfg.block_n, self.cfg.block_k
        fp8 = torch.float8_e4m3fn
        a_desc = None
        if not self.gather and a.dtype == fp8 and tma_ok(a) and a.shape[0] < 2**31:
            a_desc = descriptor(a, (bm, bk))
        w_desc = None
        if w.dtype == fp8 and self.epilogue.gated:
            w_desc, _ = _gate_up_descriptor(w, self.n_out, bn, bk, self.epilogue.interleaved,
                                            dtypes=(fp8,))  # fmt: skip
        elif w.dtype == fp8 and tma_ok(w):
            w_desc = descriptor(w, (1, bn, bk))
        return a_desc, w_desc

    def __call__(self, a, a_scale, w, w_scale, offsets, out, out_scale=None, bias=None,
                 dest_to_src=None, num_rows=None) -> None:  # fmt: skip
        M = a.shape[0] if num_rows is None else num_rows
        if M == 0 or self.n_out == 0:
            return
        if self.sm90 is not None:
            descs = self.sm90.descriptors(a, w)
            if descs is not None:
                self.sm90(descs, a, a_scale, w_scale, offsets, out, out_scale, bias, dest_to_src,
                          M)  # fmt: skip
                return
        cfg = self.cfg
        key, a_desc, w_desc = self.key, None, None
        if key is None:
            a_desc, w_desc = self._descriptors(a, w)
            key = (*self.static, a_desc is not None, w_desc is not None, self._split(w_desc))
        m_tiles = _m_tiles(M, self.E, cfg.block_m)
        grid = m_tiles * cdiv(self.n_out, cfg.block_n)
        a_s = a_scale if a_scale is not None else a
        o_s = out_scale if out_scale is not None else out
        if INTERPRETING and out.dtype == torch.float8_e4m3fn:
            out = out.view(torch.uint8)  # (the codes of _e4m3_bits)
        b = bias if bias is not None else out
        d2s = dest_to_src if self.gather else offsets
        _QUANT_GEMM.launch(
            key, (grid,),
            (a, a if a_desc is None else a_desc, a_s, w, w if w_desc is None else w_desc,
             w_scale, out, o_s, b, offsets, d2s, self.E, M, m_tiles, self.n_out, self.kd,
             self.kp, a.shape[0], *self.strides),
            lambda: dict(self.cx, A_DESC=a_desc is not None, W_DESC=w_desc is not None,
                         SPLIT=self._split(w_desc)),
        )  # fmt: skip

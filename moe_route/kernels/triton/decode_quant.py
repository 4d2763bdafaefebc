"""The decode path (:mod:`.decode`) on quantised experts: its first launch and the launch
class of both.

The first launch runs the sorted path's own GEMM1 tile (:func:`.quant._quant_tile`) on one
routed row per program: FP8 quantises the token row in its main loop and writes ``h`` in
float32; MXFP4 unpacks the e2m1 weights and writes ``h`` in the tokens' dtype. The second
launch is :mod:`.decode`'s, which reads FP8 and MXFP4 weights as well. Where a call takes this
path: :func:`moe_route.tuning.quant_decode_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv
from .decode import _DOWN, _ROWS, MAX_SLOTS, DecodeConfig, _routed_slot, _scratch, _zero_arrivals
from .gemm_mainloop import GemmEpilogue
from .quant import _quant_tile, _upcast, in_loop_quant


@triton.jit(do_not_specialize=["T", "ARRIVED_AT", "ARRIVALS"])
def _decode_up_quant_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr, ARRIVED_AT, ARRIVALS, T, N_OUT, KD, KP, E,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_it, stride_ik, stride_hs,
    TOP_K: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
    UP_SOFTCAP: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr, SN: tl.constexpr, A_QUANT: tl.constexpr, UE8M0: tl.constexpr,
    UPCAST: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program ``(slot = t*K + k, n-tile)`` on quantised experts: ``h[slot, cols]``, by the
    sorted path's own tile at decode sizes (:func:`.quant._quant_tile`, one routed row): FP8,
    the token row quantised in the main loop, ``h`` in float32; MXFP4, the 16-bit row times
    the unpacked weights, ``h`` in the tokens' dtype (GEMM2's input as the sorted path
    stores it); and :func:`.decode._zero_arrivals`."""
    _zero_arrivals(h_ptr, ARRIVED_AT, ARRIVALS)
    slot, t, e = _routed_slot(ids_ptr, stride_it, stride_ik, TOP_K)
    if (e < 0) | (e >= E):  # dropped (or an unchecked id past the experts): h never read
        return
    # The tile's rows are `slot ...` (one routed); row `slot` of A is x[t]: A's base shifted
    # back by `slot - t` rows (the rows past the first are masked, never addressed).
    a_ptr = x_ptr + (t - slot).to(tl.int64) * stride_xt
    _quant_tile(
        a_ptr, x_ptr, x_ptr, w_ptr, w_ptr, ws_ptr, h_ptr, h_ptr, b_ptr, ids_ptr, e, slot,
        slot + 1, tl.program_id(1), N_OUT, KD, KP, T, stride_xt, stride_xh, 0, 0, stride_we,
        stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_hs, 1, 0, stride_be,
        stride_bn, ACT, GATED, ALPHA, LIMIT, UP_OFFSET, GATE_SOFTCAP, UP_SOFTCAP,
        INTERLEAVED, HAS_BIAS, False, MXFP4, SN, False, UE8M0, UPCAST, False, False,
        1 if GATED else 0, A_QUANT, SWAP, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


class QuantDecodeLaunch:
    """:class:`.decode.DecodeLaunch` on quantised experts (``w1`` / ``w2`` with their scales, as
    :func:`moe_route.fused_moe` takes them). FP8: the first launch quantises each token row in
    its main loop and writes ``h`` in float32, the second quantises ``h`` per 128 columns as
    it reads it, with the quantiser's codes and the sorted path's scaling (within the
    format's error of the sorted path, tests/test_gpu_quant.py). MXFP4: both launches unpack
    the e2m1 weights as the sorted path's GEMMs do, ``h`` in the tokens' dtype as the sorted
    path's GEMM1 stores it. ``x_group``: the tokens' scale group (128, or 0: per token);
    ``w_block_rows``: rows per weight scale block (1: per channel, and MXFP4). Keeps no
    tensor."""

    def __init__(self, x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, b1, b2, bias,
                 epilogue: GemmEpilogue, cfg: DecodeConfig, x_group: int, w_block_rows: int,
                 ue8m0: bool):  # fmt: skip
        H = x.shape[1]
        K = topk_ids.shape[1]
        mx = w1.dtype == torch.uint8  # (packed e2m1: w2's last dimension is I / 2)
        E, n_inter = w1.shape[0], w1.shape[1] // 2 if epilogue.gated else w1.shape[1]
        self.K, self.H, self.n_inter = K, H, n_inter
        self.h_dtype = x.dtype if mx else torch.float32
        self.split = cfg.split
        wide = topk_weights.dtype == torch.float64
        self.terms_dtype = torch.float64 if wide else torch.float32
        self.has_b1, self.has_b2, self.has_bias = b1 is not None, b2 is not None, bias is not None
        self.up_tiles, self.down_tiles = cdiv(n_inter, cfg.up_n), cdiv(H, cfg.down_n)
        out_acc = tl.float64 if wide else tl.float32
        upcast = _upcast(mx, x.dtype)
        epi = epilogue
        sx, sw1, sw2, sid, stw = x.stride(), w1.stride(), w2.stride(), topk_ids.stride(), \
            topk_weights.stride()  # fmt: skip
        s1, s2 = w1_scale.stride(), w2_scale.stride()
        # per channel: one scale for every k block (a zero k-stride)
        s1 = (*s1, 0) if w1_scale.dim() == 2 else s1
        s2 = (*s2, 0) if w2_scale.dim() == 2 else s2
        sh, so = (n_inter, 1), (H, 1)  # h and out are new, contiguous
        sb1 = b1.stride() if b1 is not None else (0, 0)
        sb2 = b2.stride() if b2 is not None else (0, 0)
        if bias is None:
            bias_dtype, sbias = x.dtype, (0, 0)
        else:
            bias_dtype = bias.dtype
            sbias = (0, bias.stride(0)) if bias.dim() == 1 else bias.stride()
        dtypes = tuple(None if t is None else t.dtype
                       for t in (x, w1, w1_scale, w2, w2_scale, b1, b2, bias, topk_weights,
                                 topk_ids))  # fmt: skip
        self.up_key = LaunchKey((cfg, epi, dtypes, sx, sw1, s1, sb1, sid, K, n_inter, H, E,
                                 x_group, w_block_rows, ue8m0))  # fmt: skip
        self.up_tail = (n_inter, H, w1.shape[2], E, *sx, *sw1, *s1, *sb1, *sid, n_inter)
        self.up_constexprs = lambda: dict(
            TOP_K=K, ACT=epi.act, GATED=epi.gated, ALPHA=epi.alpha, LIMIT=epi.limit,
            UP_OFFSET=epi.up_offset, GATE_SOFTCAP=epi.gate_softcap, UP_SOFTCAP=epi.up_softcap,
            INTERLEAVED=epi.interleaved, HAS_BIAS=b1 is not None, MXFP4=mx, SN=w_block_rows,
            A_QUANT=0 if mx else in_loop_quant(x_group), UE8M0=ue8m0, UPCAST=upcast,
            SWAP=cfg.swap and not mx, BLOCK_M=_ROWS, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        self.down_key = LaunchKey((cfg, dtypes, sw2, s2, sb2, sid, stw, sbias, bias_dtype, K, H,
                                   n_inter, E, w_block_rows, ue8m0))  # fmt: skip
        self.down_tail = (H, n_inter, w2.shape[2], E, *sh, *sw2, *s2, *sb2, *sid, *stw, *sbias, *so)
        self.down_constexprs = lambda: dict(
            TOP_K=K, HAS_B2=b2 is not None, HAS_BIAS=bias is not None, ACC=tl.float32,
            OUT_ACC=out_acc, DOT_PRECISION="tf32", BLOCK_M=_ROWS, BLOCK_N=cfg.down_n,
            BLOCK_K=cfg.down_k, COUNTS=False, SLOTS=MAX_SLOTS, FP8=not mx, MXFP4=mx,
            SN=w_block_rows, UE8M0=ue8m0, UPCAST=upcast, SPLIT=cfg.split,
            SWAP=cfg.swap and not mx, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def __call__(self, x, w1, w2, topk_weights, topk_ids, b1, b2, bias, w1_scale,
                 w2_scale) -> torch.Tensor:  # fmt: skip
        """``fused_moe``'s output ``[T, H]``."""
        T = x.shape[0]
        out = x.new_empty(T, self.H)
        if T == 0 or self.H == 0:
            return out
        slots = T * self.K
        h, terms_at, arrived_at, arrivals = _scratch(
            self.split, T, slots, self.n_inter, self.H, self.down_tiles, self.h_dtype,
            self.terms_dtype, x.device,
        )  # fmt: skip
        if self.n_inter:  # (which zeroes the counters)
            _UP_QUANT.launch(self.up_key, (slots, self.up_tiles),
                             (x, w1, w1_scale, b1 if self.has_b1 else w1, topk_ids, h,
                              arrived_at, arrivals, T, *self.up_tail),
                             self.up_constexprs)  # fmt: skip
        _DOWN.launch(
            self.down_key, (slots if self.split else T, self.down_tiles),
            (h, w2, w2_scale, b2 if self.has_b2 else w2, topk_ids, topk_weights,
             bias if self.has_bias else out, out, out, terms_at, arrived_at, T,
             *self.down_tail),
            self.down_constexprs,
        )  # fmt: skip
        return out


_UP_QUANT = ThinKernel(_decode_up_quant_kernel)

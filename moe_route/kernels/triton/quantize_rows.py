"""The activations' FP8 quantiser: ``x [R, C]`` to e4m3 codes and one float32 scale per row
per ``GROUP`` columns (or per row), :func:`moe_route.quant.quantize_fp8_rows`'s bits.
``fused_moe`` quantises the tokens ``[T, H]`` once (a token goes to ``K`` experts; GEMM1
gathers its codes and scales through the maps, :mod:`.quant`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRETING, LaunchKey, ThinKernel, cdiv, next_pow2
from .fp8_codes import fp8_codes, fp8_scale


@triton.jit(do_not_specialize=["R"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_xr, stride_xc, stride_qr, stride_sr,
                          GROUP: tl.constexpr, ROW_WISE: tl.constexpr, UE8M0: tl.constexpr,
                          SOFT_FP8: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):  # fmt: skip
    """Program ``(i, g)``: rows ``[i*BLOCK_R, ...)``, column group ``g`` (``GROUP = BLOCK_C``
    columns); with ``ROW_WISE`` one scale per row over all ``C`` columns (two passes)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xr
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_qr
    if ROW_WISE:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = row_ok[:, None] & (cols < C)[None, :]
            v = tl.load(x_rows + cols[None, :] * stride_xc, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        s = fp8_scale(amax, UE8M0)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = row_ok[:, None] & (cols < C)[None, :]
            v = tl.load(x_rows + cols[None, :] * stride_xc, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_rows + cols[None, :], fp8_codes(v, s[:, None], SOFT_FP8), mask=ok)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sr, s, mask=row_ok)
    else:
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (cols < C)[None, :]
        v = tl.load(x_rows + cols[None, :] * stride_xc, mask=ok, other=0.0).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(v), axis=1), UE8M0)
        tl.store(q_rows + cols[None, :], fp8_codes(v, s[:, None], SOFT_FP8), mask=ok)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sr + g, s, mask=row_ok)


_QUANTIZE_ROWS = ThinKernel(_quantize_rows_kernel)


class QuantizeRowsLaunch:
    """:func:`_quantize_rows_kernel`'s launch prepared from ``x``'s layout and the group
    (``group=0``: one scale per row). Writes ``q [R, C]`` (contiguous e4m3) and ``s [R, G]``
    (contiguous float32)."""

    __slots__ = ("block_r", "cx", "groups", "key", "strides")

    def __init__(self, x: torch.Tensor, group: int, ue8m0: bool):
        C = x.shape[1]
        row_wise = group == 0
        block_c = 128 if row_wise else next_pow2(group)
        self.block_r = 16
        self.groups = 1 if row_wise else cdiv(C, group)
        sx = x.stride()
        self.strides = (C, *sx, C, self.groups)
        self.key = LaunchKey((x.dtype, sx, C, group, ue8m0))
        self.cx = dict(GROUP=max(group, 1), ROW_WISE=row_wise, UE8M0=ue8m0,
                       SOFT_FP8=INTERPRETING, BLOCK_R=self.block_r, BLOCK_C=block_c,
                       num_warps=4)  # fmt: skip

    def __call__(self, x, q, s) -> None:
        R = x.shape[0]
        if R == 0 or x.shape[1] == 0:
            return
        C, sxr, sxc, sqr, ssr = self.strides
        q = q.view(torch.uint8) if INTERPRETING else q
        _QUANTIZE_ROWS.launch(self.key, (cdiv(R, self.block_r), self.groups),
                              (x, q, s, R, C, sxr, sxc, sqr, ssr), lambda: self.cx)  # fmt: skip


def quantize_rows_triton(x: torch.Tensor, group: int = 128, ue8m0: bool = False):
    """``(q, s)`` of ``x [R, C]``: see :func:`moe_route.quant.quantize_fp8_rows`."""
    R, C = x.shape
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R, 1 if group == 0 else cdiv(C, group), dtype=torch.float32, device=x.device)
    QuantizeRowsLaunch(x, group, ue8m0)(x, q, s)
    return q, s

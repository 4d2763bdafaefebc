"""FP8 (e4m3) codes and scales inside a kernel: what :func:`moe_route.quant.quantize_fp8_rows`
computes, element by element. Shared by the quantiser and the GEMM epilogues that write
GEMM2's input as FP8 (:mod:`.quant`, :mod:`.quant_sm90`)."""

from __future__ import annotations

import triton
import triton.language as tl

#: The largest finite e4m3 value and the floor of a block's absolute maximum
#: (:mod:`moe_route.quant`'s constants, restated as kernel literals).
FP8_MAX = tl.constexpr(448.0)
FP8_EPS = tl.constexpr(1e-10)


@triton.jit
def _pow2_ceil(s):
    """The smallest power of two >= ``s`` (positive normal float32), exactly."""
    bits = s.to(tl.int32, bitcast=True)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, UE8M0: tl.constexpr):
    s = tl.math.div_rn(tl.maximum(amax, FP8_EPS), FP8_MAX)
    if UE8M0:
        s = _pow2_ceil(s)
    return s


@triton.jit
def _round_bits(bits):
    """float32 bits rounded to 3 mantissa bits, nearest even, shifted down: a carry out of
    the mantissa goes into the exponent, as it must."""
    return (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20


@triton.jit
def _e4m3_bits(v):
    """The e4m3 codes of finite float32 ``|v| <= 448`` as ``uint8``, rounded to nearest even,
    in integer arithmetic. The CPU interpreter's own conversion drops the carry of a rounding
    into the exponent (124.3 became 64), so it runs this; the GPU runs its conversion."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    tiny = a < 0.015625  # 2^-6, e4m3's smallest normal: below it, steps of 2^-9
    # a + 2^-6 is exact and rounds the subnormal steps where a normal 2^-6 + k 2^-9 rounds
    shifted = tl.where(tiny, a + 0.015625, a).to(tl.int32, bitcast=True)
    code = _round_bits(shifted) - (120 << 3) - tl.where(tiny, 8, 0)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def fp8_codes(v, s, SOFT_FP8: tl.constexpr):
    """``e4m3(clamp(v / s, -448, 448))``, ``s`` broadcast over ``v`` (as ``uint8`` codes with
    ``SOFT_FP8``: :func:`_e4m3_bits`).

    ``v / s`` is float32 division's quotient, bit for bit, computed as the product by the
    rounded reciprocal (one division per row) corrected once by the exact remainder (two
    FMAs; Markstein's correction): an IEEE division per value costs a range check and a
    slow-path branch each. The interpreter, whose FMA rounds twice, divides. The GPU's
    conversion saturates (``cvt.rn.satfinite``), which is the clamp."""
    if SOFT_FP8:
        q = tl.math.div_rn(v, s)
        return _e4m3_bits(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    r = tl.math.div_rn(1.0, s)
    q = v * r
    q = tl.math.fma(tl.math.fma(-q, s, v), r, q)
    return q.to(tl.float8e4nv)

"""MXFP4 weights in the loader of the grouped GEMM on quantised experts (:mod:`.quant`).

Hopper has no FP4 MMA, so the e2m1 weights (two per byte, one ue8m0 exponent per 32 along
``K``) are unpacked and scaled in registers before a 16-bit MMA with the tokens: in PTX on
bf16 tokens (:data:`_E2M1_BF16`), else in Triton operations (:func:`_e2m1`; fp16 tokens and
the CPU interpreter), the same values either way. A packed byte's low nibble is the weight
of an even column and its high nibble of the next odd one, so each product is two, on the
tokens' even and odd columns (:func:`_mxfp4_dot`, :func:`_mxfp4_mainloop`), and the bytes
are used as they were read, with no interleaving shuffle.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(c, scale):
    """float32 ``value(c) · scale`` of e2m1 codes (the low 4 bits of ``c``; bit 3 the sign):
    a magnitude code ``m >= 2`` is ``2^(m>>1 - 1) · (1 + (m&1)/2)``, built as float32 bits;
    codes 0 and 1 are 0 and 0.5."""
    c = c.to(tl.int32)
    mag = c & 7
    bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22) | ((c & 8) << 28)
    v = tl.where(mag < 2, tl.where((c & 8) != 0, -0.5, 0.5) * mag.to(tl.float32),
                 bits.to(tl.float32, bitcast=True))  # fmt: skip
    return v * scale


#: e2m1 codes to scaled bf16 weights on SM90 (PTX): four packed bytes ``$4`` and their scales
#: ``$5, $6`` (bf16 pairs) in, the low nibbles' weights ``$0, $1`` and the high nibbles' ``$2,
#: $3`` (bf16 pairs) out. PRMT gives each byte a 16-bit lane whose high byte is filled with
#: the byte's top bit (the high nibble's sign; shifting the word left by 4 first brings the low
#: nibbles there); a left shift by 2 and one mask leave a code's magnitude bits (exponent,
#: mantissa) in bf16's two lowest exponent bits and its top mantissa bit, and its sign in bit
#: 15: the e2m1 value times 2^-126 (code 1, 0.5, a subnormal). A bf16x2 multiply by 2^126 makes
#: it the value, a second by the scale the weight; both exact.
_E2M1_BF16 = tl.constexpr("""
{
.reg .b32 low, t, rebias;
mov.b32 rebias, 0x7E807E80;
shl.b32 low, $4, 4;
prmt.b32 t, low, 0, 0x9180;
shl.b32 t, t, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, rebias;
mul.rn.bf16x2 $0, t, $5;
prmt.b32 t, low, 0, 0xB3A2;
shl.b32 t, t, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, rebias;
mul.rn.bf16x2 $1, t, $6;
prmt.b32 t, $4, 0, 0x9180;
shl.b32 t, t, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, rebias;
mul.rn.bf16x2 $2, t, $5;
prmt.b32 t, $4, 0, 0xB3A2;
shl.b32 t, t, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, rebias;
mul.rn.bf16x2 $3, t, $6;
}
""")


@triton.jit
def _e2m1_pair(p, e8, dtype: tl.constexpr, ASM: tl.constexpr):
    """``(even, odd)``: the weights of the low and of the high nibbles of packed bytes ``p``,
    each times ``2^(e8 - 127)`` (``e8 = 0`` is ``2^-127``), in the 16-bit ``dtype``. ``ASM``
    (SM90, bf16): bf16 values from :data:`_E2M1_BF16`, scaled in bf16; else float32 values
    from :func:`_e2m1` rounded once to ``dtype``. The same values either way: an e2m1 value
    times a power of two in bf16's range is exact."""
    if ASM:
        e = e8.to(tl.int16)
        scale = tl.where(e == 0, 0x40, e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        even, odd = tl.inline_asm_elementwise(_E2M1_BF16, "=r,=r,=r,=r,r,r,r", [p, scale],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                              pack=4)  # fmt: skip
    else:
        e = e8.to(tl.int32)
        scale = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)
        even = _e2m1(p, scale).to(dtype)
        odd = _e2m1(p >> 4, scale).to(dtype)
    return even, odd


@triton.jit
def _mxfp4_dot(a_even, a_odd, w_base, s_base, w_rows, col_ok, k0, KP, acc, acc_odd, stride_wn,
               stride_wk, stride_sn, stride_sk, ASM: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """``(acc + a_even @ W_even, acc_odd + a_odd @ W_odd)`` for ``W = W[w_rows, k0 ...].T``
    on e2m1 weights, float32: the tokens' even columns (``a_even``) times the low nibbles'
    weights, their odd columns times the high nibbles' (:func:`_e2m1_pair`), the packed bytes
    taken as they were read, with no interleaving shuffle. Each 16 bytes of a row share one
    ue8m0 scale. At 16 token rows (decode sizes, where the loop's instructions are the time)
    the ``[BLOCK_K / 32, BLOCK_N]`` scales are read once and broadcast to the bytes they
    scale; wider tiles read one per byte, the repeats from L1 (faster there:
    docs/decisions.md, "MXFP4 scales: one read per 32 weights at 16 rows")."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    rows = w_rows[None, :].to(tl.int64)
    ok = (kp < KP)[:, None] & col_ok[None, :]
    p = tl.load(w_base + rows * stride_wn + kp[:, None] * stride_wk, mask=ok, other=0)
    if a_even.shape[0] <= 16:
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        e8 = tl.load(
            s_base + rows * stride_sn + ks[:, None] * stride_sk,
            mask=(ks < tl.cdiv(KP, 16))[:, None] & col_ok[None, :],
            other=127,
        )
        e8 = tl.reshape(tl.broadcast_to(e8[:, None, :], [BLOCK_K // 32, 16, e8.shape[1]]),
                        [BLOCK_K // 2, e8.shape[1]])  # fmt: skip
    else:
        e8 = tl.load(s_base + rows * stride_sn + (kp // 16)[:, None] * stride_sk, mask=ok,
                     other=127)  # fmt: skip
    even, odd = _e2m1_pair(p, e8, a_even.dtype, ASM)
    acc = tl.dot(a_even, even, acc, out_dtype=tl.float32)
    return acc, tl.dot(a_odd, odd, acc_odd, out_dtype=tl.float32)


@triton.jit
def _mxfp4_mainloop(a_ptr, w_base, ws_base, a_rows, row_ok, gate_rows, up_rows, col_ok, KD, KP,
                    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk,
                    GATED: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``(A[a_rows] @ W[e][gate_rows].T, A[a_rows] @ W[e][up_rows].T)`` over ``KD`` in float32
    on e2m1 weights (the second only when ``GATED``; both from one read of each ``A`` tile).
    Each product is two: ``A``'s even columns times the low nibbles' weights, its odd columns
    times the high nibbles' (:func:`_mxfp4_dot`), into two accumulators (a product that
    accumulates into another's result would make Triton lay the pair out as a chain of
    dependent MMAs and convert the accumulator between them every step). The weights unpack
    in PTX on bf16 activations, else (``UPCAST``: the interpreter, fp16) in Triton."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_odd = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up_odd = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    for k0 in range(0, KD, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + ks < KD)[None, :], other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
        acc, acc_odd = _mxfp4_dot(a_even, a_odd, w_base, ws_base, gate_rows, col_ok, k0, KP,
                                  acc, acc_odd, stride_wn, stride_wk, stride_sn, stride_sk,
                                  not UPCAST, BLOCK_K)  # fmt: skip
        if GATED:
            acc_up, acc_up_odd = _mxfp4_dot(a_even, a_odd, w_base, ws_base, up_rows, col_ok, k0,
                                            KP, acc_up, acc_up_odd, stride_wn, stride_wk,
                                            stride_sn, stride_sk, not UPCAST,
                                            BLOCK_K)  # fmt: skip
        a_ptrs += BLOCK_K * stride_ak
    return acc + acc_odd, acc_up + acc_up_odd

"""Activation math of the GEMM epilogues: forward and backward, gated and plain.

``@triton.jit`` functions only; the parameters come from
:meth:`moe_route.activations.Activation.triton_constexprs` as constexprs: ``ACT`` (the
element-wise kind's code), ``ALPHA`` (silu's slope), ``LIMIT`` (``0.0``: no clamp),
``UP_OFFSET``, ``GATE_SOFTCAP`` and ``UP_SOFTCAP`` (``0.0``: none; silu only). Inputs are
float32 / float64 accumulator tiles; the constants are made in the tile's dtype (``tl.full``),
so a float64 tile (gradcheck) is not computed with float32-rounded constants.

Clamp gradients follow ``torch.clamp``: they pass where ``gate <= LIMIT`` and
``-LIMIT <= up <= LIMIT``, bounds included, and are zero elsewhere.

The soft caps ``c·tanh(x/c)`` use :func:`_tanh`, accurate to a few ulps relative to the value in
both dtypes (``2 sigmoid(2y) - 1`` alone has an absolute error near 0; libdevice's ``tanh`` is
not available to the interpreter), so the CPU tests run the code the GPU runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Codes of moe_route.activations.KIND_CODES.
_SILU = tl.constexpr(1)
_GELU = tl.constexpr(2)
_RELU = tl.constexpr(3)
_GELU_TANH = tl.constexpr(4)
_RELU2 = tl.constexpr(5)


@triton.jit
def _k(V: tl.constexpr, like):
    """The constant ``V`` in ``like``'s dtype."""
    return tl.full([], V, like.dtype)


@triton.jit
def _gelu_tanh_sigmoid(x):
    """``sigmoid(2u)`` with ``u = √(2/π)(x + 0.044715 x³)``: ``0.5 (1 + tanh(u))``."""
    u = _k(0.7978845608028654, x) * (x + _k(0.044715, x) * x * x * x)
    return tl.sigmoid(u + u)


@triton.jit
def _value(x, ACT: tl.constexpr, ALPHA: tl.constexpr):
    """``f(x)`` of the element-wise kind ``ACT``."""
    if ACT == _SILU:
        y = x * tl.sigmoid(x if ALPHA == 1.0 else _k(ALPHA, x) * x)
    elif ACT == _GELU:
        y = _k(0.5, x) * x * (1.0 + tl.math.erf(x * _k(0.7071067811865476, x)))
    elif ACT == _GELU_TANH:
        y = x * _gelu_tanh_sigmoid(x)
    elif ACT == _RELU:
        y = tl.maximum(x, 0.0)
    elif ACT == _RELU2:
        r = tl.maximum(x, 0.0)
        y = r * r
    else:
        y = x
    return y


@triton.jit
def _derivative(x, ACT: tl.constexpr, ALPHA: tl.constexpr):
    """``f'(x)`` (relu' and relu2' are 0 at 0, as torch's)."""
    if ACT == _SILU:
        if ALPHA == 1.0:
            s = tl.sigmoid(x)
            d = s * (1.0 + x * (1.0 - s))
        else:
            ax = _k(ALPHA, x) * x
            s = tl.sigmoid(ax)
            d = s * (1.0 + ax * (1.0 - s))
    elif ACT == _GELU:
        cdf = _k(0.5, x) * (1.0 + tl.math.erf(x * _k(0.7071067811865476, x)))
        d = cdf + x * tl.exp(_k(-0.5, x) * x * x) * _k(0.3989422804014327, x)
    elif ACT == _GELU_TANH:
        s = _gelu_tanh_sigmoid(x)
        # d/dx [x sigmoid(2u)] = s + x s (1 - s) 2u', u' = √(2/π)(1 + 3·0.044715 x²)
        du2 = _k(1.5957691216057308, x) * (1.0 + _k(0.134145, x) * x * x)
        d = s + x * s * (1.0 - s) * du2
    elif ACT == _RELU:
        d = tl.where(x > 0.0, 1.0, 0.0).to(x.dtype)
    elif ACT == _RELU2:
        d = 2.0 * tl.maximum(x, 0.0)
    else:
        d = tl.full(x.shape, 1.0, x.dtype)
    return d


@triton.jit
def _tanh(y):
    """``(tanh(y), 1 - tanh(y)²)``.

    ``|y| < 0.625``: Cephes' ``tanhf`` polynomial (float32) or ``tanh`` rational function
    (float64) of ``y²``, accurate relative to the value near 0; beyond, ``2 sigmoid(2y) - 1``,
    whose absolute error of a few ulps is relative there (``|tanh| > 0.55``). ``1 - tanh²`` as
    torch's tanh backward computes it (0 once tanh rounds to ±1). Both sides are evaluated and
    ``tl.where`` keeps one (the unused one may be inf or NaN for a huge ``y``); NaN stays NaN.
    Of the forms tried, this one spills least in the fused activation backward's epilogue on
    SM90 (tens of bytes at 255 registers; hundreds with the sign-symmetric
    ``1 - 2 sigmoid(-2|y|)`` and ``q (2 - q)``: ``scripts/kernel_resources.py``)."""
    z = y * y
    if y.dtype == tl.float64:
        p = (_k(-9.64399179425052238628e-1, y) * z + _k(-9.92877231001918586564e1, y)) * z
        p = p + _k(-1.61468768441708447952e3, y)
        q = ((z + _k(1.12811678491632931402e2, y)) * z + _k(2.23548839060100448583e3, y)) * z
        q = q + _k(4.84406305325125486048e3, y)
        small = y + y * z * (p / q)
    else:
        p = _k(-5.70498872745e-3, y) * z + _k(2.06390887954e-2, y)
        p = (p * z + _k(-5.37397155531e-2, y)) * z + _k(1.33314422036e-1, y)
        p = p * z + _k(-3.33332819422e-1, y)
        small = y + y * z * p
    big = _k(2.0, y) * tl.sigmoid(_k(2.0, y) * y) - 1.0
    t = tl.where(z < _k(0.390625, y), small, big)  # |y| < 0.625
    return t, 1.0 - t * t


@triton.jit
def _softcap(x, CAP: tl.constexpr):
    """``(CAP·tanh(x/CAP), its derivative 1 - tanh²(x/CAP))``."""
    t, sech2 = _tanh(x * _k(1.0 / CAP, x))
    return _k(CAP, x) * t, sech2


@triton.jit
def _gate_terms(g, ACT: tl.constexpr, ALPHA: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
                DERIVATIVE: tl.constexpr):  # fmt: skip
    """``(f(g), f'(g))`` (``f'`` only with ``DERIVATIVE``, else ``f`` again). With
    ``GATE_SOFTCAP`` ``c`` (silu): ``f = c tanh(g/c) · s`` and
    ``f' = s (sech²(g/c) + ALPHA c tanh(g/c) (1 - s))``, ``s = sigmoid(ALPHA·g)``."""
    if GATE_SOFTCAP > 0.0:
        capped, sech2 = _softcap(g, GATE_SOFTCAP)
        if ALPHA == 1.0:
            s = tl.sigmoid(g)
            f = capped * s
            if DERIVATIVE:
                d = s * (sech2 + capped * (1.0 - s))
        else:
            s = tl.sigmoid(_k(ALPHA, g) * g)
            f = capped * s
            if DERIVATIVE:
                d = s * (sech2 + _k(ALPHA, g) * capped * (1.0 - s))
    else:
        f = _value(g, ACT, ALPHA)
        if DERIVATIVE:
            d = _derivative(g, ACT, ALPHA)
    if not DERIVATIVE:
        d = f
    return f, d


@triton.jit
def _clamped(gate, up, LIMIT: tl.constexpr):
    """``(min(gate, LIMIT), clamp(up, -LIMIT, LIMIT))``; NaN stays NaN, as in torch."""
    if LIMIT > 0.0:
        lim = _k(LIMIT, gate)
        gate = tl.minimum(gate, lim, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(tl.minimum(up, lim, propagate_nan=tl.PropagateNan.ALL), -lim,
                        propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    return gate, up


@triton.jit
def gated_forward(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                  UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
                  UP_SOFTCAP: tl.constexpr):  # fmt: skip
    """``f(min(gate, limit)) · (softcap(clamp(up, -limit, limit)) + up_offset)``, ``f``'s
    linear factor soft-capped with ``GATE_SOFTCAP`` (silu)."""
    g, u = _clamped(gate, up, LIMIT)
    if UP_SOFTCAP > 0.0:
        u, _ = _softcap(u, UP_SOFTCAP)
    if UP_OFFSET != 0.0:
        u = u + _k(UP_OFFSET, u)
    f, _ = _gate_terms(g, ACT, ALPHA, GATE_SOFTCAP, False)
    return f * u


@triton.jit
def plain_forward(x, ACT: tl.constexpr):
    """``f(x)``."""
    return _value(x, ACT, 1.0)


@triton.jit
def gated_forward_backward(gate, up, dh, ACT: tl.constexpr, ALPHA: tl.constexpr,
                           LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
                           GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr):  # fmt: skip
    """``(h, d gate, d up)``: :func:`gated_forward` and its gradients given ``dh``, each term
    computed once (the backward epilogues need both; the soft caps' terms would otherwise
    stay live twice)."""
    g, u = _clamped(gate, up, LIMIT)
    if UP_SOFTCAP > 0.0:
        u, du = _softcap(u, UP_SOFTCAP)
    if UP_OFFSET != 0.0:
        u = u + _k(UP_OFFSET, u)
    f, fd = _gate_terms(g, ACT, ALPHA, GATE_SOFTCAP, True)
    h = f * u
    d_gate = dh * u * fd
    d_up = dh * f
    if UP_SOFTCAP > 0.0:
        d_up = d_up * du
    if LIMIT > 0.0:
        lim = _k(LIMIT, gate)
        d_gate = tl.where(gate <= lim, d_gate, 0.0)
        d_up = tl.where((up >= -lim) & (up <= lim), d_up, 0.0)
    return h, d_gate, d_up


@triton.jit
def gated_backward(gate, up, dh, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                   UP_OFFSET: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
                   UP_SOFTCAP: tl.constexpr):  # fmt: skip
    """``(d gate, d up)`` of :func:`gated_forward` given ``dh``."""
    _, d_gate, d_up = gated_forward_backward(gate, up, dh, ACT, ALPHA, LIMIT, UP_OFFSET,
                                             GATE_SOFTCAP, UP_SOFTCAP)  # fmt: skip
    return d_gate, d_up


@triton.jit
def plain_backward(x, dh, ACT: tl.constexpr):
    """``dh · f'(x)``."""
    return dh * _derivative(x, ACT, 1.0)

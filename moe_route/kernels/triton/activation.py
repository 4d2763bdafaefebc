"""Activation math of the GEMM epilogues: forward and backward, gated and plain.

``@triton.jit`` functions only; the parameters come from
:meth:`moe_route.activations.Activation.triton_constexprs` as constexprs: ``ACT`` (the
element-wise kind's code), ``ALPHA`` (silu's slope), ``LIMIT`` (``0.0``: no clamp) and
``UP_OFFSET``. Inputs are float32 / float64 accumulator tiles; the constants are made in the
tile's dtype (``tl.full``), so a float64 tile (gradcheck) is not computed with float32-rounded
constants.

Clamp gradients follow ``torch.clamp``: they pass where ``gate <= LIMIT`` and
``-LIMIT <= up <= LIMIT``, bounds included, and are zero elsewhere.
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
                  UP_OFFSET: tl.constexpr):  # fmt: skip
    """``f(min(gate, limit)) · (clamp(up, -limit, limit) + up_offset)``."""
    g, u = _clamped(gate, up, LIMIT)
    if UP_OFFSET != 0.0:
        u = u + _k(UP_OFFSET, u)
    return _value(g, ACT, ALPHA) * u


@triton.jit
def plain_forward(x, ACT: tl.constexpr):
    """``f(x)``."""
    return _value(x, ACT, 1.0)


@triton.jit
def gated_backward(gate, up, dh, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                   UP_OFFSET: tl.constexpr):  # fmt: skip
    """``(d gate, d up)`` of :func:`gated_forward` given ``dh``."""
    g, u = _clamped(gate, up, LIMIT)
    if UP_OFFSET != 0.0:
        u = u + _k(UP_OFFSET, u)
    d_gate = dh * u * _derivative(g, ACT, ALPHA)
    d_up = dh * _value(g, ACT, ALPHA)
    if LIMIT > 0.0:
        lim = _k(LIMIT, gate)
        d_gate = tl.where(gate <= lim, d_gate, 0.0)
        d_up = tl.where((up >= -lim) & (up <= lim), d_up, 0.0)
    return d_gate, d_up


@triton.jit
def plain_backward(x, dh, ACT: tl.constexpr):
    """``dh · f'(x)``."""
    return dh * _derivative(x, ACT, 1.0)

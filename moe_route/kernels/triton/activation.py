"""The activations of GEMM1's epilogue and of its backward, as ``@triton.jit`` math only.

Inputs are accumulator tiles (float32, or float64 for float64 GEMMs). ``ACT`` is the
element-wise activation's code (:data:`ACT_CODES`); gated activations apply it to the gate
columns and multiply by the up columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Codes of the element-wise activations (``ACT``); gated ones use the code of their gate.
ACT_CODES = {"identity": 0, "silu": 1, "gelu": 2, "relu": 3}


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:
        x = x * tl.sigmoid(x)
    elif ACT == 2:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:
        x = tl.maximum(x, 0.0)
    return x


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """d act / dx at ``x`` (relu'(0) = 0, as torch)."""
    if ACT == 1:
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        d = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == 3:
        d = tl.where(x > 0.0, 1.0, 0.0).to(x.dtype)
    else:
        d = tl.full(x.shape, 1.0, x.dtype)
    return d


@triton.jit
def plain_forward(x, ACT: tl.constexpr):
    return _act(x, ACT)


@triton.jit
def plain_backward(x, dh, ACT: tl.constexpr):
    return dh * _act_grad(x, ACT)


@triton.jit
def gated_forward(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                  UP_OFFSET: tl.constexpr):  # fmt: skip
    return _act(gate, ACT) * up


@triton.jit
def gated_backward(gate, up, dh, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                   UP_OFFSET: tl.constexpr):  # fmt: skip
    return dh * up * _act_grad(gate, ACT), dh * _act(gate, ACT)

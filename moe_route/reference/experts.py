"""Reference of the experts' computation: the activations (plain and gated, with their
derivatives and backward) and the grouped GEMM over expert-grouped rows, forward and backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activations import Activation, as_activation
from ._dtype import _compute_dtype

GATE_UP_LAYOUTS = ("concat", "interleaved")


# --------------------------------------------------------------------------- activations
def split_gate_up(
    z: torch.Tensor, gate_up_layout: str = "concat"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split GEMM1's ``[M, 2I]`` output into gate and up (``"concat"`` or ``"interleaved"``)."""
    if gate_up_layout == "concat":
        gate, up = z.chunk(2, dim=-1)
    elif gate_up_layout == "interleaved":
        gate, up = z[..., 0::2], z[..., 1::2]
    else:
        raise ValueError(f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}")
    return gate, up


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(x / cap)``, as transformers' ``Inkling2Softcap``."""
    return torch.tanh(x / cap) * cap


def _elementwise(x: torch.Tensor, spec: Activation) -> torch.Tensor:
    if spec.kind == "silu" and spec.gate_softcap is not None:  # the linear factor capped
        return _softcap(x, spec.gate_softcap) * torch.sigmoid(spec.alpha * x)
    if spec.kind == "silu":
        return F.silu(x) if spec.alpha == 1.0 else x * torch.sigmoid(spec.alpha * x)
    if spec.kind == "gelu":
        return F.gelu(x)
    if spec.kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if spec.kind == "relu":
        return F.relu(x)
    if spec.kind == "relu2":
        return F.relu(x).square()
    return x  # identity


def _clamped(gate: torch.Tensor, up: torch.Tensor, spec: Activation):
    if spec.limit is None:
        return gate, up
    return gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)


def activation_reference(
    z: torch.Tensor, activation: str | Activation, gate_up_layout: str = "concat"
) -> torch.Tensor:
    """Apply an activation (see :mod:`moe_route.activations`) to GEMM1's pre-activation ``z``.

    Gated activations take ``[M, 2I]`` and return ``[M, I]``:
    ``f(min(gate, limit)) * (clamp(up, -limit, limit) + up_offset)`` (``swiglu = silu(g) * u``
    without parameters); the exact, erf-based gelu unless the kind says ``gelu_tanh``. With soft
    caps (``swiglu`` only), ``up`` becomes ``c'·tanh(up/c')`` before the offset and silu's linear
    factor ``c·tanh(g/c)``: ``c·tanh(g/c) · sigmoid(alpha·g) · c'·tanh(u/c')`` for Inkling2. Torch
    ops only, so autograd through it defines the gradients (``torch.clamp``'s at the bounds).
    """
    spec = as_activation(activation)
    if not spec.gated:
        return _elementwise(z, spec)
    gate, up = _clamped(*split_gate_up(z, gate_up_layout), spec)
    if spec.up_softcap is not None:
        up = _softcap(up, spec.up_softcap)
    if spec.up_offset:
        up = up + spec.up_offset
    return _elementwise(gate, spec) * up


def activation_grad_reference(x: torch.Tensor, activation: str | Activation) -> torch.Tensor:
    """``d f / dx`` of the element-wise part of an activation (the gate's for gated ones).

    ``silu' = s (1 + a x (1 - s))`` with ``s = sigmoid(a x)``, ``a = alpha``, and with a
    ``gate_softcap`` ``c``: ``s (1 - t² + a c t (1 - s))``, ``t = tanh(x / c)``;
    ``gelu' = Φ(x) + x φ(x)``; ``gelu_tanh' = s + x s (1 - s) 2u'`` with ``s = sigmoid(2u)``,
    ``u = √(2/π)(x + 0.044715 x³)``; ``relu' = [x > 0]`` and ``relu2' = 2 max(x, 0)`` (0 at 0,
    as torch); ``identity' = 1``.
    """
    spec = as_activation(activation)
    if spec.kind == "silu" and spec.gate_softcap is not None:
        t = torch.tanh(x / spec.gate_softcap)
        s = torch.sigmoid(spec.alpha * x)
        return s * (1 - t * t + spec.alpha * spec.gate_softcap * t * (1 - s))
    if spec.kind == "silu":
        ax = spec.alpha * x
        s = torch.sigmoid(ax)
        return s * (1 + ax * (1 - s))
    if spec.kind == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
        return cdf + x * torch.exp(-0.5 * x * x) * 0.3989422804014327
    if spec.kind == "gelu_tanh":
        k = (2 / torch.pi) ** 0.5
        s = torch.sigmoid(2 * k * (x + 0.044715 * x**3))
        return s + x * s * (1 - s) * 2 * k * (1 + 3 * 0.044715 * x * x)
    if spec.kind == "relu":
        return (x > 0).to(x.dtype)
    if spec.kind == "relu2":
        return 2 * F.relu(x)
    return torch.ones_like(x)


def activation_backward_reference(
    z: torch.Tensor, dh: torch.Tensor, activation: str | Activation, gate_up_layout: str = "concat"
) -> torch.Tensor:
    """Gradient of :func:`activation_reference` w.r.t. ``z``, given ``dh`` (same layout as z).

    Written out (not autograd): ``d gate = dh · (u + up_offset) · f'(g) · [gate <= limit]``,
    ``d up = dh · f(g) · [-limit <= up <= limit]`` with ``g``, ``u`` the clamped values; the
    bounds pass the gradient, as ``torch.clamp``'s backward does. With an ``up_softcap`` ``c'``,
    ``u`` is ``c'·tanh(u/c')`` in ``d gate`` and ``d up`` has the factor ``1 - tanh²(u/c')``.
    """
    spec = as_activation(activation)
    if not spec.gated:
        return dh * activation_grad_reference(z, spec)
    gate, up = split_gate_up(z, gate_up_layout)
    g, u = _clamped(gate, up, spec)
    d_up = dh * _elementwise(g, spec)
    if spec.up_softcap is not None:
        t = torch.tanh(u / spec.up_softcap)
        u = t * spec.up_softcap
        d_up = d_up * (1 - t * t)
    d_gate = dh * (u + spec.up_offset) * activation_grad_reference(g, spec)
    if spec.limit is not None:
        zero = torch.zeros((), dtype=d_gate.dtype, device=d_gate.device)
        d_gate = torch.where(gate <= spec.limit, d_gate, zero)
        d_up = torch.where((up >= -spec.limit) & (up <= spec.limit), d_up, zero)
    if gate_up_layout == "concat":
        return torch.cat([d_gate, d_up], dim=-1)
    return torch.stack([d_gate, d_up], dim=-1).reshape(z.shape)


# --------------------------------------------------------------------------- grouped GEMM
def grouped_gemm_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "identity",
    gate_up_layout: str = "concat",
) -> torch.Tensor:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for the rows ``d`` of each expert ``e``.

    Args:
        a: ``[M, Kdim]`` permuted rows (``M >= offset[E]``; rows past it are left zero).
        w: ``[E, N, Kdim]`` any strided view.
        expert_first_token_offset: ``[E+1]`` int64.
        bias: optional ``[E, N]``.
    """
    cdt = _compute_dtype(a, w)
    offsets = expert_first_token_offset.tolist()  # the oracle may sync; kernels must not
    n_out = w.shape[1] // 2 if as_activation(activation).gated else w.shape[1]
    out = torch.zeros(a.shape[0], n_out, dtype=cdt, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        z = a[lo:hi].to(cdt) @ w[e].to(cdt).t()
        if bias is not None:
            z = z + bias[e].to(cdt)
        out[lo:hi] = activation_reference(z, activation, gate_up_layout)
    return out.to(a.dtype)


def grouped_gemm_backward_reference(
    dout: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "identity",
    gate_up_layout: str = "concat",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`grouped_gemm_reference` (``a`` already permuted) given ``dout``.

    For the rows ``d`` of expert ``e``: ``z = a[d] @ w[e].T + bias[e]``,
    ``dz = act'(z) dout[d]``, ``da[d] = dz @ w[e]``, ``dw[e] = Σ dz^T a[d]``,
    ``db[e] = Σ dz``. Rows past ``offset[E]`` (dropped) get a zero ``da``; an expert with no
    rows gets zero ``dw`` and ``db``.

    Returns:
        ``(da [M, Kd], dw [E, N, Kd], db [E, N])`` in the dtypes of ``a``, ``w``, ``w``.
    """
    cdt = _compute_dtype(dout, a, w)
    offsets = expert_first_token_offset.tolist()  # the oracle may sync; kernels must not
    da = torch.zeros(a.shape, dtype=cdt, device=a.device)
    dw = torch.zeros(w.shape, dtype=cdt, device=a.device)
    db = torch.zeros(w.shape[:2], dtype=cdt, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        a_e, w_e = a[lo:hi].to(cdt), w[e].to(cdt)
        z = a_e @ w_e.t()
        if bias is not None:
            z = z + bias[e].to(cdt)
        dz = activation_backward_reference(z, dout[lo:hi].to(cdt), activation, gate_up_layout)
        da[lo:hi] = dz @ w_e
        dw[e] = dz.t() @ a_e
        db[e] = dz.sum(0)
    return da.to(a.dtype), dw.to(w.dtype), db.to(w.dtype)

"""Pure-PyTorch reference for every stage of the MoE token path.

This module *defines* the semantics of ``DESIGN.md``; every backend is tested against it, the
benchmarks use it as their oracle, and it is the CPU fallback. It favours clarity over speed:
loops over experts are fine here, kernels elsewhere must not have them.

Arithmetic is float32, or float64 when the inputs are float64 (for ``gradcheck``); results are
returned in the dtype of the activations, rounded once.

Index conventions (the data contract):

* ``T`` tokens, ``K`` slots per token, ``E`` experts; expanded source row ``s = k*T + t``.
* Permuted (dest) order: experts ascending, then token ascending, then slot ``k`` ascending;
  dropped slots (``topk_ids == -1``) after every routed row, in source-row order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import Activation, as_activation

GATE_UP_LAYOUTS = ("concat", "interleaved")


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )


# --------------------------------------------------------------------------- router
def topk_routing_reference(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Mixtral renormalises, Qwen3-MoE does by option).

    Args:
        router_logits: ``[T, E]`` float.
        top_k: ``K``, experts per token.
        renormalize: divide the K selected probabilities by their sum.

    Returns:
        ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``; ids of a token in descending
        probability order (ties: lower expert id first, as ``torch.topk``).
    """
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


# --------------------------------------------------------------------------- routing maps
def routing_maps_reference(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four routing tables of the data contract, by a stable sort of unique keys.

    Returns:
        ``expanded_source_row_to_expanded_dest_row [T*K] int32``,
        ``expanded_dest_row_to_expanded_source_row [T*K] int32``,
        ``expert_for_source_row [T*K] int32`` (``-1`` for dropped slots),
        ``expert_first_token_offset [E+1] int64``.
    """
    T, K = topk_ids.shape
    N = T * K
    device = topk_ids.device
    ids = topk_ids.to(torch.int64)
    t = torch.arange(T, device=device).unsqueeze(1).expand(T, K)
    k = torch.arange(K, device=device).unsqueeze(0).expand(T, K)
    token_major = t * K + k  # order inside one expert: token, then slot
    source = k * T + t  # expanded source row s = k*T + t
    dropped = (ids < 0) | (ids >= num_experts)  # unchecked out-of-range ids count as dropped
    # Routed rows sort by (expert, token, slot); dropped rows after all of them by source row.
    key = torch.where(dropped, num_experts * N + source, ids * N + token_major)
    dest_to_token_major = torch.argsort(key.reshape(-1))  # keys are unique: the order is total
    dest_to_src = source.reshape(-1)[dest_to_token_major]
    src_to_dest = torch.empty_like(dest_to_src)
    src_to_dest[dest_to_src] = torch.arange(N, device=device)
    expert_for_source_row = torch.where(dropped, -1, ids).t().reshape(-1)  # k-major, as s
    counts = torch.bincount(ids[~dropped].reshape(-1), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return (
        src_to_dest.to(torch.int32),
        dest_to_src.to(torch.int32),
        expert_for_source_row.to(torch.int32),
        offsets,
    )


# --------------------------------------------------------------------------- expand
def expand_rows_reference(
    x: torch.Tensor,
    expanded_dest_row_to_expanded_source_row: torch.Tensor,
    expert_first_token_offset: torch.Tensor,
) -> torch.Tensor:
    """``x_perm[d] = x[dest_to_src[d] mod T]`` for routed rows; dropped rows are zero."""
    T = x.shape[0]
    dest_to_src = expanded_dest_row_to_expanded_source_row.to(torch.int64)
    N = dest_to_src.numel()
    x_perm = x[dest_to_src % T] if T > 0 else x.new_zeros(N, x.shape[1])
    routed = torch.arange(N, device=x.device) < expert_first_token_offset[-1]
    return x_perm.masked_fill(~routed.unsqueeze(1), 0)


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


def _elementwise(x: torch.Tensor, spec: Activation) -> torch.Tensor:
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
    without parameters); the exact, erf-based gelu unless the kind says ``gelu_tanh``. Torch ops
    only, so autograd through it defines the gradients (``torch.clamp``'s at the bounds).
    """
    spec = as_activation(activation)
    if not spec.gated:
        return _elementwise(z, spec)
    gate, up = _clamped(*split_gate_up(z, gate_up_layout), spec)
    if spec.up_offset:
        up = up + spec.up_offset
    return _elementwise(gate, spec) * up


def activation_grad_reference(x: torch.Tensor, activation: str | Activation) -> torch.Tensor:
    """``d f / dx`` of the element-wise part of an activation (the gate's for gated ones).

    ``silu' = s (1 + a x (1 - s))`` with ``s = sigmoid(a x)``, ``a = alpha``;
    ``gelu' = Φ(x) + x φ(x)``; ``gelu_tanh' = s + x s (1 - s) 2u'`` with ``s = sigmoid(2u)``,
    ``u = √(2/π)(x + 0.044715 x³)``; ``relu' = [x > 0]`` and ``relu2' = 2 max(x, 0)`` (0 at 0,
    as torch); ``identity' = 1``.
    """
    spec = as_activation(activation)
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
    bounds pass the gradient, as ``torch.clamp``'s backward does.
    """
    spec = as_activation(activation)
    if not spec.gated:
        return dh * activation_grad_reference(z, spec)
    gate, up = split_gate_up(z, gate_up_layout)
    g, u = _clamped(gate, up, spec)
    d_gate = dh * (u + spec.up_offset) * activation_grad_reference(g, spec)
    d_up = dh * _elementwise(g, spec)
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


# --------------------------------------------------------------------------- finalize
def finalize_moe_routing_reference(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    expanded_source_row_to_expanded_dest_row: torch.Tensor,
    expert_for_source_row: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = bias[t] + Σ_k w[t,k] · y_perm[dest(k*T+t)]`` over routed slots, k ascending.

    Accumulates in float32 (float64 for float64 inputs) and rounds once to ``y_perm.dtype``.
    A dropped slot contributes nothing, whatever its weight or row hold (NaN included).
    """
    T, K = topk_weights.shape
    cdt = _compute_dtype(y_perm, topk_weights)
    H = y_perm.shape[1]
    acc = torch.zeros(T, H, dtype=cdt, device=y_perm.device)
    dest = expanded_source_row_to_expanded_dest_row.to(torch.int64).view(K, T)
    routed = (expert_for_source_row >= 0).view(K, T)
    zero = torch.zeros((), dtype=cdt, device=y_perm.device)
    for k in range(K):
        term = topk_weights[:, k].to(cdt).unsqueeze(1) * y_perm[dest[k]].to(cdt)
        acc = acc + torch.where(routed[k].unsqueeze(1), term, zero)
    if bias is not None:
        acc = acc + bias.to(cdt)
    return acc.to(y_perm.dtype)


def finalize_moe_routing_backward_reference(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    expanded_source_row_to_expanded_dest_row: torch.Tensor,
    expert_for_source_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`finalize_moe_routing_reference` w.r.t. ``y_perm`` and the weights.

    ``d y_perm[dest(k*T+t)] = w[t,k] dout[t]`` and ``d w[t,k] = <dout[t], y_perm[dest]>`` for
    routed slots; zero for dropped slots (whatever their weight or row hold).
    """
    T, K = topk_weights.shape
    cdt = _compute_dtype(dout, y_perm, topk_weights)
    dest = expanded_source_row_to_expanded_dest_row.to(torch.int64).view(K, T)
    routed = (expert_for_source_row >= 0).view(K, T)
    g = dout.to(cdt)
    dy = torch.zeros(y_perm.shape, dtype=cdt, device=y_perm.device)
    dw = torch.zeros(T, K, dtype=cdt, device=y_perm.device)
    for k in range(K):
        w = torch.where(routed[k], topk_weights[:, k].to(cdt), 0)
        dy[dest[k]] = w.unsqueeze(1) * g
        dot = (g * y_perm[dest[k]].to(cdt)).sum(1)
        dw[:, k] = torch.where(routed[k], dot, 0)
    return dy.to(y_perm.dtype), dw.to(topk_weights.dtype)


# --------------------------------------------------------------------------- whole chain
def moe_forward_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole MoE forward of DESIGN.md: maps → expand → GEMM1+act → GEMM2 → finalize.

    Args:
        x: ``[T, H]``; w1: ``[E, 2I or I, H]``; w2: ``[E, H, I]``;
        topk_weights: ``[T, K]``; topk_ids: ``[T, K]`` (``-1`` = dropped).
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    cdt = _compute_dtype(x, w1, w2)  # no intermediate rounding: the chain runs in cdt
    src_to_dest, dest_to_src, expert_for_src, offsets = routing_maps_reference(
        topk_ids, w1.shape[0]
    )
    x_perm = expand_rows_reference(x.to(cdt), dest_to_src, offsets)
    h = grouped_gemm_reference(
        x_perm, w1, offsets, b1, activation=activation, gate_up_layout=gate_up_layout
    )
    y = grouped_gemm_reference(h, w2, offsets, b2)
    out = finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
    return out.to(x.dtype)


def moe_backward_reference(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    z: torch.Tensor,
    maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    activation: str = "swiglu",
    gate_up_layout: str = "concat",
    b2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Explicit gradients of :func:`moe_forward_reference` (without ``bias``) given ``dout``.

    Uses the saved pre-activation ``z [T*K, 2I or I]`` (GEMM1's output before the activation,
    in permuted order) instead of GEMM2's output: for the slot ``(t, k)`` in row ``d`` of
    expert ``e``, with ``g[d] = dout[t] @ W2[e]`` and ``h = act(z)``,

    * ``d w[t,k] = <dout[t], y[d]> = <g[d], h[d]> + <dout[t], b2[e]>``,
    * ``dh[d] = w[t,k] g[d]``, ``dz = act'(z) dh``, ``dx_perm[d] = dz[d] @ W1[e]``,
      ``dx[t] = Σ_k dx_perm[dest(k*T+t)]`` (k ascending),
    * ``dW2[e] = Σ_d (w dout[t])^T h[d]``, ``db2[e] = Σ_d w dout[t]``,
      ``dW1[e] = Σ_d dz[d]^T x[t]``, ``db1[e] = Σ_d dz[d]``.

    Args:
        maps: ``(src_to_dest, dest_to_src, expert_for_src, offsets)``.

    Returns:
        ``(dx, dw1, dw2, d_topk_weights, db1, db2)`` in the dtypes of their primals; ``dW`` of an
        expert with no rows is exactly zero.
    """
    cdt = _compute_dtype(dout, x, w1, w2, z)
    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    T, K = topk_weights.shape
    d2s = dest_to_src.to(torch.int64)
    tok = d2s % T if T else d2s
    slot = d2s // T if T else d2s
    dout_c, x_c, z_c = dout.to(cdt), x.to(cdt), z.to(cdt)
    wts = topk_weights.to(cdt)
    M = d2s.numel()
    dx_perm = torch.zeros(M, x.shape[1], dtype=cdt, device=x.device)
    dy_dot = torch.zeros(M, dtype=cdt, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=cdt, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=cdt, device=x.device)
    db1 = torch.zeros(w1.shape[:2], dtype=cdt, device=x.device)
    db2 = torch.zeros(w2.shape[:2], dtype=cdt, device=x.device)
    bounds = offsets.tolist()  # the oracle may sync; kernels must not
    for e in range(w1.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        rows_t = tok[lo:hi]
        w_row = wts[rows_t, slot[lo:hi]].unsqueeze(1)
        h_e = activation_reference(z_c[lo:hi], activation, gate_up_layout)
        g_e = dout_c[rows_t] @ w2[e].to(cdt)
        dz_e = activation_backward_reference(z_c[lo:hi], w_row * g_e, activation, gate_up_layout)
        dy_dot[lo:hi] = (g_e * h_e).sum(1)
        if b2 is not None:
            dy_dot[lo:hi] += dout_c[rows_t] @ b2[e].to(cdt)
        dx_perm[lo:hi] = dz_e @ w1[e].to(cdt)
        dy_e = w_row * dout_c[rows_t]
        dw2[e] = dy_e.t() @ h_e
        db2[e] = dy_e.sum(0)
        dw1[e] = dz_e.t() @ x_c[rows_t]
        db1[e] = dz_e.sum(0)
    routed = (expert_for_src >= 0).view(K, T)
    dest = src_to_dest.to(torch.int64).view(K, T)
    dx = torch.zeros(T, x.shape[1], dtype=cdt, device=x.device)
    d_topk = torch.zeros(T, K, dtype=cdt, device=x.device)
    for k in range(K):
        dx = dx + torch.where(routed[k].unsqueeze(1), dx_perm[dest[k]], 0)
        d_topk[:, k] = torch.where(routed[k], dy_dot[dest[k]], 0)
    db2_dtype = b2.dtype if b2 is not None else w2.dtype
    return (
        dx.to(x.dtype),
        dw1.to(w1.dtype),
        dw2.to(w2.dtype),
        d_topk.to(topk_weights.dtype),
        db1.to(w1.dtype),
        db2.to(db2_dtype),
    )


# =========================================================================== routers (loops)
# Oracles of moe_route/routing.py, written independently of it: one token (or one slot) at a
# time in Python float64 arithmetic, no torch.topk, no masks. Slow by design; tests only.
import math as _math  # noqa: E402


def _ranked(values: list[float], candidates) -> list[int]:
    """Candidates by descending value, ties to the lower index (``torch.topk``'s order)."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def softmax_topk_reference(
    logits: torch.Tensor, k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop: softmax, the ``k`` most probable experts, optionally renormalised.

    The experts rank by logit (the probabilities' order, without ties that only the rounding of
    ``exp`` makes), ties to the lower id. Finite logits only.

    Returns ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``.
    """
    weights, ids = [], []
    for row in logits.double().tolist():
        top = max(row)
        exps = [_math.exp(v - top) for v in row]
        total = sum(exps)
        probs = [v / total for v in exps]
        chosen = _ranked(row, range(len(row)))[:k]
        w = [probs[e] for e in chosen]
        if renormalize:
            s = sum(w)
            w = [v / s for v in w]
        weights.append(w)
        ids.append(chosen)
    return _router_result(weights, ids, k)


def sigmoid_grouped_topk_reference(
    logits: torch.Tensor,
    k: int,
    *,
    n_group: int = 1,
    topk_group: int | None = None,
    expert_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loop of the DeepSeek-V3 router (see ``routing.sigmoid_grouped_topk``).

    Returns ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``.
    """
    E = logits.shape[1]
    G = E // n_group
    topk_group = n_group if topk_group is None else topk_group
    bias = [0.0] * E if expert_bias is None else expert_bias.double().tolist()
    weights, ids = [], []
    for row in logits.double().tolist():
        scores = [1.0 / (1.0 + _math.exp(-v)) for v in row]
        choice = [s + b for s, b in zip(scores, bias, strict=True)]
        group_score = []
        for g in range(n_group):
            members = _ranked(choice, range(g * G, (g + 1) * G))
            group_score.append(sum(choice[e] for e in members[:2]))
        kept = _ranked(group_score, range(n_group))[:topk_group]
        candidates = [e for g in kept for e in range(g * G, (g + 1) * G)]
        chosen = _ranked(choice, candidates)[:k]
        w = [scores[e] for e in chosen]
        if renormalize:
            s = sum(w) + 1e-20
            w = [v / s for v in w]
        weights.append([v * routed_scaling_factor for v in w])
        ids.append(chosen)
    return _router_result(weights, ids, k)


def _router_result(weights, ids, k):
    T = len(ids)
    return (
        torch.tensor(weights, dtype=torch.float64).reshape(T, k).to(torch.float32),
        torch.tensor(ids, dtype=torch.int64).reshape(T, k).to(torch.int32),
    )


def load_balancing_loss_reference(
    router_probs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> float:
    """``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of tokens whose (routed) top-k holds
    ``e`` and ``P_e`` the mean probability of ``e``; a Python float."""
    probs = router_probs.double().tolist()
    ids = topk_ids.tolist()
    T = max(len(ids), 1)
    total = 0.0
    for e in range(num_experts):
        f = sum(1 for row in ids if e in row) / T
        P = sum(row[e] for row in probs) / T
        total += f * P
    return num_experts * total


def router_z_loss_reference(logits: torch.Tensor) -> float:
    """``mean_t (log Σ_e exp logits[t, e])²``; a Python float."""
    rows = logits.double().tolist()
    total = 0.0
    for row in rows:
        top = max(row)
        lse = top + _math.log(sum(_math.exp(v - top) for v in row))
        total += lse * lse
    return total / max(len(rows), 1)


def apply_capacity_reference(
    topk_ids: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Walk the slots token by token (then slot by slot); an expert keeps its first
    ``capacity`` slots, later ones become ``-1``."""
    ids = topk_ids.tolist()
    used = [0] * num_experts
    for row in ids:
        for k, e in enumerate(row):
            if e < 0:
                continue
            if used[e] < capacity:
                used[e] += 1
            else:
                row[k] = -1
    return torch.tensor(ids, dtype=topk_ids.dtype).reshape(topk_ids.shape)

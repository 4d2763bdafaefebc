"""fused_moe(): the whole MoE token path in one call, forward and backward.

Inference runs the chain of public ops (maps → GEMM1 + activation → GEMM2 → finalize). When a
gradient is wanted, one custom op, ``moe_route::moe_experts``, runs the same chain and also
returns GEMM1's pre-activation ``z``; its registered backward, ``moe_route::moe_experts_backward``,
needs only ``x``, ``z``, the weights and the routing (never ``x_perm``, ``h`` or GEMM2's output):

1. GEMM2's backward with the activation's backward in its epilogue: ``g = dout[t] @ W2[e]``
   (rows read from ``dout`` through the maps), recompute ``h = act(z)``, write ``w[t,k]·h``
   (for ``dW2``), ``dz = act'(z) · w[t,k] g`` and the partial router-weight gradients
   ``<g, h>`` per column tile;
2. ``d w[t,k]``: those partials summed in fixed order (+ ``<dout[t], b2[e]>``);
3. ``dW2[e] = Σ dout[t]^T (w h)``, ``dW1[e] = Σ dz^T x[t]`` (and the bias gradients) by the
   deterministic per-expert reduction of :mod:`moe_route.kernels.triton.weight_grad`;
4. ``dx_perm = dz @ W1[e]`` (grouped GEMM over ``W1`` seen k-major) and ``dx[t]``, the sum of
   its ``K`` copies in fixed ``k`` order (the finalize kernel with unit weights).

No float atomics anywhere in the backward: same inputs, same bits.
"""

from __future__ import annotations

import torch

from . import _checks
from .arch import backend_for, finalize_path_for
from .finalize import finalize_moe_routing
from .grouped_gemm import bias_dtypes, check_gemm_args, grouped_gemm
from .maps import build_routing_maps
from .reference import (
    activation_reference,
    expand_rows_reference,
    finalize_moe_routing_reference,
    grouped_gemm_reference,
    moe_backward_reference,
)


def _gemm2_finalize_triton(h, w2, b2, bias, topk_weights, maps, path, allow_tf32):
    """GEMM2 and finalize on the Triton path (``path`` from :func:`finalize_path_for`): the
    standalone pair, or the epilogue-fused finalize, ordered (``"fused"``) or atomic."""
    from .kernels.triton.finalize import finalize_triton
    from .kernels.triton.grouped_gemm import FinalizeEpilogue, grouped_gemm_triton

    offsets, src_to_dest, dest_to_src, expert_for_src = maps
    T, H = topk_weights.shape[0], w2.shape[1]
    if path == "fused_atomic":
        acc = torch.zeros(T, H, dtype=torch.float32, device=h.device)
        if bias is not None:
            acc += bias.float()
        epilogue = FinalizeEpilogue(topk_weights, src_to_dest, expert_for_src, acc, None, False)
        grouped_gemm_triton(
            h, w2, offsets, acc, bias=b2, dest_to_src=dest_to_src, finalize=epilogue,
            allow_tf32=allow_tf32,
        )  # fmt: skip
        return acc.to(h.dtype)
    out = h.new_empty(T, H)
    y = h.new_empty(h.shape[0], H)  # GEMM2's rows (the ordered epilogue's scratch)
    if path == "fused":
        epilogue = FinalizeEpilogue(topk_weights, src_to_dest, expert_for_src, out, bias, True)
        grouped_gemm_triton(
            h, w2, offsets, y, bias=b2, dest_to_src=dest_to_src, finalize=epilogue,
            allow_tf32=allow_tf32,
        )  # fmt: skip
        return out
    grouped_gemm_triton(h, w2, offsets, y, bias=b2, allow_tf32=allow_tf32)
    finalize_triton(y, topk_weights, src_to_dest, expert_for_src, bias, out)
    return out


@torch.library.custom_op("moe_route::gemm2_fused_finalize", mutates_args=())
def _gemm2_fused_finalize_op(
    h: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    topk_weights: torch.Tensor,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    path: str,
    allow_tf32: bool,
    backend: str,
) -> torch.Tensor:
    """GEMM2 with the finalize in its epilogue; ``path`` is ``"fused"`` (ordered, the same
    bits every run) or ``"fused_atomic"``."""
    if backend_for(h.device, backend).value == "reference":
        y = grouped_gemm_reference(h, w2, offsets, b2)
        return finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
    maps = (offsets, src_to_dest, dest_to_src, expert_for_src)
    return _gemm2_finalize_triton(h, w2, b2, bias, topk_weights, maps, path, allow_tf32)


@_gemm2_fused_finalize_op.register_fake
def _(h, w2, offsets, src_to_dest, dest_to_src, expert_for_src, topk_weights, b2, bias, *_):
    return h.new_empty(topk_weights.shape[0], w2.shape[1])


# --------------------------------------------------------------------------- training
@torch.library.custom_op("moe_route::moe_experts", mutates_args=())
def _moe_experts_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    path: str,
    gather: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE forward that also returns ``z``, GEMM1's pre-activation (saved for backward)."""
    M = dest_to_src.numel()
    if backend_for(x.device, backend).value == "reference":
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        x_perm = expand_rows_reference(x.to(cdt), dest_to_src, offsets)
        z = grouped_gemm_reference(x_perm, w1, offsets, b1).to(x.dtype)
        h = activation_reference(z.to(cdt), activation, gate_up_layout)
        y = grouped_gemm_reference(h, w2, offsets, b2)
        out = finalize_moe_routing_reference(y, topk_weights, src_to_dest, expert_for_src, bias)
        return out.to(x.dtype), z
    from .kernels.triton.expand import expand_rows_triton
    from .kernels.triton.grouped_gemm import grouped_gemm_triton

    z = x.new_empty(M, w1.shape[1])
    h = x.new_empty(M, w2.shape[2])
    if gather:
        rows = x
    else:
        rows = x.new_empty(M, x.shape[1])
        expand_rows_triton(x, src_to_dest, expert_for_src, rows)
    grouped_gemm_triton(
        rows, w1, offsets, h, bias=b1, activation=activation,
        interleaved=gate_up_layout == "interleaved", dest_to_src=dest_to_src, gather=gather,
        num_rows=M, pre_activation=z, allow_tf32=allow_tf32,
    )  # fmt: skip
    maps = (offsets, src_to_dest, dest_to_src, expert_for_src)
    return _gemm2_finalize_triton(h, w2, b2, bias, topk_weights, maps, path, allow_tf32), z


@_moe_experts_op.register_fake
def _(x, w1, w2, topk_weights, b1, b2, bias, offsets, src_to_dest, dest_to_src, *_):
    return x.new_empty(x.shape), x.new_empty(dest_to_src.numel(), w1.shape[1])


@torch.library.custom_op("moe_route::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    z: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    activation: str,
    gate_up_layout: str,
    need_dx: bool,
    need_dw1: bool,
    need_dw2: bool,
    need_dtopk: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2, d_topk_weights, db1, db2)``; the ones not asked for are empty.

    ``need_dw1`` / ``need_dw2`` also cover ``db1`` / ``db2`` when those biases exist.
    """
    maps = (src_to_dest, dest_to_src, expert_for_src, offsets)
    if backend_for(x.device, backend).value == "reference":
        grads = moe_backward_reference(
            dout, x, w1, w2, topk_weights, z, maps, activation=activation,
            gate_up_layout=gate_up_layout, b2=b2,
        )  # fmt: skip
    else:
        grads = _moe_backward_triton(
            dout, x, w1, w2, topk_weights, b1, b2, z, maps, activation, gate_up_layout,
            need_dx, need_dw1, need_dw2, need_dtopk, allow_tf32,
        )  # fmt: skip
    grads = list(grads)
    for i, bias_in in ((4, b1), (5, b2)):
        if bias_in is not None:
            grads[i] = grads[i].to(bias_in.dtype)
    wanted = (need_dx, need_dw1, need_dw2, need_dtopk)
    wanted += (b1 is not None and need_dw1, b2 is not None and need_dw2)
    # Outputs may not alias each other: each gradient not asked for is its own empty tensor.
    return tuple(g if w else x.new_empty(0) for g, w in zip(grads, wanted, strict=True))


@_moe_experts_backward_op.register_fake
def _(dout, x, w1, w2, topk_weights, b1, b2, z, o, s2d, d2s, efs, act, lay, ndx, nw1, nw2, ntk, *_):
    like = (x, w1, w2, topk_weights, b1, b2)
    wanted = (ndx, nw1, nw2, ntk, b1 is not None and nw1, b2 is not None and nw2)
    return tuple(
        torch.empty_like(t) if w else x.new_empty(0) for t, w in zip(like, wanted, strict=True)
    )


def _moe_backward_triton(
    dout, x, w1, w2, topk_weights, b1, b2, z, maps, activation, gate_up_layout,
    need_dx, need_dw1, need_dw2, need_dtopk, allow_tf32,
):  # fmt: skip
    from .kernels.triton.finalize import finalize_triton
    from .kernels.triton.grouped_gemm import grouped_gemm_triton
    from .kernels.triton.weight_grad import expert_weight_grad_triton, router_weight_grad_triton

    src_to_dest, dest_to_src, expert_for_src, offsets = maps
    T, H = x.shape
    K = topk_weights.shape[1]
    M = dest_to_src.numel()
    empty = x.new_empty(0)
    # 1. g = dout[t] @ W2[e]; wh = w act(z); dz = act'(z) w g; partial <g, h> per column tile.
    wh = x.new_empty(M, w2.shape[2])
    dz = torch.empty_like(z)
    partial = grouped_gemm_triton(
        dout, w2.transpose(1, 2), offsets, wh, activation=activation,
        interleaved=gate_up_layout == "interleaved", dest_to_src=dest_to_src, gather=True,
        num_rows=M, act_backward=(z, dz, topk_weights), allow_tf32=allow_tf32,
    )  # fmt: skip
    dtopk = empty
    if need_dtopk:
        dtopk = torch.empty_like(topk_weights)
        router_weight_grad_triton(partial, dout, b2, src_to_dest, expert_for_src, dtopk)
    dw2 = db2 = empty
    if need_dw2:
        dw2 = torch.empty_like(w2)
        db2 = torch.empty(w2.shape[:2], dtype=b2.dtype, device=x.device) if b2 is not None else None
        expert_weight_grad_triton(
            dout, wh, offsets, dw2, db=db2, dest_to_src=dest_to_src, a_gather=True,
            db_scale=topk_weights, num_rows=M, allow_tf32=allow_tf32,
        )  # fmt: skip
    del wh
    dx = empty
    if need_dx:
        dx_perm = x.new_empty(M, H)
        grouped_gemm_triton(dz, w1.transpose(1, 2), offsets, dx_perm, allow_tf32=allow_tf32)
        dx = x.new_empty(T, H)
        unit = torch.ones((), dtype=torch.float32, device=x.device).expand(T, K)
        finalize_triton(dx_perm, unit, src_to_dest, expert_for_src, None, dx)
        del dx_perm
    # dW1 last: dx_perm is freed by then, so the peak holds dz, dW1 and dW2 but no [M, H].
    dw1 = db1 = empty
    if need_dw1:
        dw1 = torch.empty_like(w1)
        db1 = torch.empty(w1.shape[:2], dtype=b1.dtype, device=x.device) if b1 is not None else None
        expert_weight_grad_triton(
            dz, x, offsets, dw1, db=db1, dest_to_src=dest_to_src, b_gather=True, num_rows=M,
            allow_tf32=allow_tf32,
        )  # fmt: skip
    return dx, dw1, dw2, dtopk, db1 if db1 is not None else empty, db2 if db2 is not None else empty


def _moe_experts_setup_context(ctx, inputs, output):
    x, w1, w2, topk_weights, b1, b2, bias, offsets, s2d, d2s, efs, act, layout, _, _, tf32, be = (
        inputs
    )
    ctx.save_for_backward(x, w1, w2, topk_weights, b1, b2, output[1], offsets, s2d, d2s, efs)
    ctx.config = (act, layout, tf32, be)
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)
    ctx.mark_non_differentiable(output[1])


def _moe_experts_backward(ctx, dout, _dz):
    x, w1, w2, topk_weights, b1, b2, z, offsets, s2d, d2s, efs = ctx.saved_tensors
    act, layout, tf32, be = ctx.config
    need = ctx.needs_input_grad
    dx, dw1, dw2, dtopk, db1, db2 = _moe_experts_backward_op(
        dout, x, w1, w2, topk_weights, b1, b2, z, offsets, s2d, d2s, efs, act, layout,
        need[0], need[1] or need[4], need[2] or need[5], need[3], tf32, be,
    )  # fmt: skip
    dbias = None
    if need[6]:
        ndim, dtype = ctx.bias_meta
        acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
        dbias = (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)
    grads = (dx, dw1, dw2, dtopk, db1, db2)
    return (
        tuple(g if n else None for g, n in zip(grads, need[:6], strict=True))
        + (dbias,)
        + (None,) * 10
    )


torch.library.register_autograd(
    "moe_route::moe_experts", _moe_experts_backward, setup_context=_moe_experts_setup_context
)


def fused_moe(
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
    finalize: str = "auto",
    deterministic: bool = True,
    gather: bool | None = None,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The MoE layer's expert computation: maps → GEMM1 + activation → GEMM2 → finalize.

    Args:
        x: ``[T, H]`` bf16 / fp16 / fp32 (/ fp64) tokens.
        w1: ``[E, 2I, H]`` (gated) or ``[E, I, H]``, any strided view; w2: ``[E, H, I]``.
        topk_weights: ``[T, K]`` router weights; topk_ids: ``[T, K]`` expert ids (``-1``
            drops a slot).
        activation, gate_up_layout: as :func:`moe_route.grouped_gemm`.
        b1: ``[E, 2I or I]``; b2: ``[E, H]`` (scaled by the router weight, as part of the expert).
        bias: ``[H]`` or ``[T, H]`` added once per token (e.g. the residual).
        finalize: ``"auto"``, ``"fused"`` (GEMM2's epilogue reduces into the output, no
            separate finalize launch) or ``"standalone"``; see
            :func:`moe_route.arch.finalize_path_for`.
        deterministic: same bits on every run (the default; both finalize paths honour it).
            ``False`` with ``finalize="fused"`` reduces with float atomics instead.
        gather: read GEMM1's rows straight from ``x`` through the maps (no ``x_perm``), or
            expand first so that GEMM1 loads its rows with TMA. ``None`` picks by shape: a
            separate expand pays off only when each row carries much work (large ``I``).

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Differentiable in ``x``, ``w1``, ``w2``, ``topk_weights``, ``b1``, ``b2`` and ``bias``
    (float64 included, for ``gradcheck``). With grad enabled and any of them requiring grad, the
    forward saves GEMM1's pre-activation ``[T*K, 2I or I]`` and the routing, nothing else; the
    backward is deterministic and skips the gradients nobody asked for.
    """
    E, n_inter = check_gemm_args("x", x, "w1", w1, "b1", b1, activation, gate_up_layout)
    T, H = x.shape
    _checks.check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,))
    if tuple(w2.shape) != (E, H, n_inter):
        raise ValueError(
            f"w2 must be [E, H, I] = [{E}, {H}, {n_inter}] to follow w1 {list(w1.shape)} with "
            f"activation {activation!r}, got {_checks.describe(w2)}"
        )
    if b2 is not None:
        _checks.check_tensor("b2", b2, ndim=2, dtypes=bias_dtypes(x.dtype))
        if tuple(b2.shape) != (E, H):
            raise ValueError(f"b2 must be [E, H] = [{E}, {H}], got {_checks.describe(b2)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES)
        if tuple(bias.shape) not in ((H,), (T, H)):
            raise ValueError(
                f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
            )
    _checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("topk_ids", topk_ids, ndim=2)
    if topk_weights.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights {_checks.describe(topk_weights)} must match topk_ids "
            f"{_checks.describe(topk_ids)} and have T = {T} rows like x"
        )
    _checks.check_same_device(
        x=x, w1=w1, w2=w2, b2=b2, bias=bias, topk_weights=topk_weights, topk_ids=topk_ids
    )
    path = finalize_path_for(x.device, finalize, deterministic).value

    maps = build_routing_maps(topk_ids, E, backend=backend)
    if gather is None:
        # NOTE: H200, bf16: the TMA-fed GEMM1 over x_perm beat the gathering GEMM1 by 6% at
        # mixtral (I=14336), more than the expand costs; at qwen3 (I=768) and deepseek-v3
        # (I=2048) the expand cost more than it saved (bench/bench_moe.py --sweep).
        gather = n_inter < 4096
    if _wants_grad(x, w1, w2, topk_weights, b1, b2, bias):
        out, _ = _moe_experts_op(
            x, w1, w2, topk_weights, b1, b2, bias, maps.expert_first_token_offset,
            maps.expanded_source_row_to_expanded_dest_row,
            maps.expanded_dest_row_to_expanded_source_row, maps.expert_for_source_row,
            activation, gate_up_layout, path, gather, allow_tf32, backend,
        )  # fmt: skip
        return out
    if gather:
        h = grouped_gemm(
            x, w1, maps, bias=b1, activation=activation, gate_up_layout=gate_up_layout,
            gather=True, allow_tf32=allow_tf32, backend=backend,
        )  # fmt: skip
    else:
        from .permute import expand_rows

        h = grouped_gemm(
            expand_rows(x, maps, backend=backend), w1, maps, bias=b1, activation=activation,
            gate_up_layout=gate_up_layout, allow_tf32=allow_tf32, backend=backend,
        )  # fmt: skip
    if path != "standalone":
        return _gemm2_fused_finalize_op(
            h, w2, maps.expert_first_token_offset,
            maps.expanded_source_row_to_expanded_dest_row,
            maps.expanded_dest_row_to_expanded_source_row, maps.expert_for_source_row,
            topk_weights, b2, bias, path, allow_tf32, backend,
        )  # fmt: skip
    y = grouped_gemm(h, w2, maps, bias=b2, allow_tf32=allow_tf32, backend=backend)
    return finalize_moe_routing(y, topk_weights, maps, bias, backend=backend)


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

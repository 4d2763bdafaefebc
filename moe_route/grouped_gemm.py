"""Grouped GEMM entry points: GEMM1 (with fused activation) and GEMM2 over permuted rows."""

from __future__ import annotations

import torch

from . import _checks
from .arch import backend_for
from .maps import RoutingMaps
from .permute import check_maps
from .reference import (
    ACTIVATIONS,
    GATE_UP_LAYOUTS,
    GATED_ACTIVATIONS,
    activation_backward_reference,
    expand_rows_reference,
    finalize_moe_routing_reference,
    grouped_gemm_backward_reference,
    grouped_gemm_reference,
)

# float64 runs on the FMA units (small tiles): it is there for gradcheck, not for speed.
GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.custom_op("moe_route::grouped_gemm", mutates_args=())
def _grouped_gemm_op(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    gather: bool,
    allow_tf32: bool,
    backend: str,
) -> torch.Tensor:
    M = dest_to_src.numel()
    if backend_for(a.device, backend).value == "reference":
        rows = expand_rows_reference(a, dest_to_src, offsets) if gather else a
        return grouped_gemm_reference(
            rows, w, offsets, bias, activation=activation, gate_up_layout=gate_up_layout
        )
    from .kernels.triton.grouped_gemm import grouped_gemm_triton

    out = a.new_empty(M, _n_out(w, activation))
    grouped_gemm_triton(
        a, w, offsets, out, bias=bias, activation=activation,
        interleaved=gate_up_layout == "interleaved", dest_to_src=dest_to_src, gather=gather,
        num_rows=M, allow_tf32=allow_tf32,
    )  # fmt: skip
    return out


@_grouped_gemm_op.register_fake
def _(a, w, offsets, src_to_dest, dest_to_src, expert_for_src, bias, activation, *_):
    return a.new_empty(dest_to_src.numel(), _n_out(w, activation))


@torch.library.custom_op("moe_route::grouped_gemm_backward", mutates_args=())
def _grouped_gemm_backward_op(
    dout: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    gate_up_layout: str,
    gather: bool,
    need_da: bool,
    need_dw: bool,
    need_db: bool,
    allow_tf32: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, dw, db)`` of :func:`grouped_gemm`; the ones not asked for are empty.

    The pre-activation is recomputed (one more GEMM) for a non-identity activation: this
    stage-by-stage backward saves only the op's inputs. ``fused_moe`` saves it instead.
    """
    if backend_for(a.device, backend).value == "reference":
        rows = expand_rows_reference(a, dest_to_src, offsets) if gather else a
        da, dw, db = grouped_gemm_backward_reference(
            dout, rows, w, offsets, bias, activation=activation, gate_up_layout=gate_up_layout
        )
        if gather:  # the K copies of each token, summed in k order
            T = a.shape[0]
            unit = torch.ones(T, src_to_dest.numel() // max(T, 1), dtype=da.dtype, device=a.device)
            da = finalize_moe_routing_reference(da, unit, src_to_dest, expert_for_src)
    else:
        da, dw, db = _grouped_gemm_backward_triton(
            dout, a, w, offsets, src_to_dest, dest_to_src, expert_for_src, bias, activation,
            gate_up_layout, gather, need_da, need_dw, need_db, allow_tf32,
        )  # fmt: skip
    if bias is not None:
        db = db.to(bias.dtype)
    wanted = (need_da, need_dw, need_db and bias is not None)
    return tuple(g if n else a.new_empty(0) for g, n in zip((da, dw, db), wanted, strict=True))


@_grouped_gemm_backward_op.register_fake
def _(dout, a, w, offsets, s2d, d2s, efs, bias, act, layout, gather, need_da, need_dw, need_db, *_):
    wanted = (need_da, need_dw, need_db and bias is not None)
    like = (a, w, bias if bias is not None else a)
    return tuple(
        torch.empty_like(t) if n else a.new_empty(0) for t, n in zip(like, wanted, strict=True)
    )


def _grouped_gemm_backward_triton(
    dout, a, w, offsets, src_to_dest, dest_to_src, expert_for_src, bias, activation,
    gate_up_layout, gather, need_da, need_dw, need_db, allow_tf32,
):  # fmt: skip
    from .kernels.triton.finalize import finalize_triton
    from .kernels.triton.grouped_gemm import grouped_gemm_triton
    from .kernels.triton.weight_grad import expert_weight_grad_triton

    M = dest_to_src.numel()
    dz = dout
    if activation != "identity":
        z = a.new_empty(M, w.shape[1])
        grouped_gemm_triton(
            a, w, offsets, z, bias=bias, dest_to_src=dest_to_src, gather=gather, num_rows=M,
            allow_tf32=allow_tf32,
        )  # fmt: skip
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        dz = activation_backward_reference(z.to(acc), dout.to(acc), activation, gate_up_layout).to(
            a.dtype
        )
    empty = a.new_empty(0)
    da = dw = db = empty
    if need_da:
        da_perm = a.new_empty(M, a.shape[1])
        grouped_gemm_triton(dz, w.transpose(1, 2), offsets, da_perm, allow_tf32=allow_tf32)
        da = da_perm
        if gather:
            T = a.shape[0]
            da = a.new_empty(a.shape)
            unit = torch.ones((), dtype=torch.float32, device=a.device).expand(T, M // max(T, 1))
            finalize_triton(da_perm, unit, src_to_dest, expert_for_src, None, da)
    if need_dw or need_db:
        dw = torch.empty_like(w)
        db = torch.empty(w.shape[:2], dtype=w.dtype, device=a.device) if need_db else None
        expert_weight_grad_triton(
            dz, a, offsets, dw, db=db, dest_to_src=dest_to_src, b_gather=gather, num_rows=M,
            allow_tf32=allow_tf32,
        )  # fmt: skip
        db = empty if db is None else db
    return da, dw, db


def _grouped_gemm_setup_context(ctx, inputs, output):
    a, w, offsets, s2d, d2s, efs, bias, activation, layout, gather, tf32, backend = inputs
    ctx.save_for_backward(a, w, offsets, s2d, d2s, efs, bias)
    ctx.config = (activation, layout, gather, tf32, backend)


def _grouped_gemm_backward(ctx, dout):
    a, w, offsets, s2d, d2s, efs, bias = ctx.saved_tensors
    activation, layout, gather, tf32, backend = ctx.config
    need = ctx.needs_input_grad
    da, dw, db = _grouped_gemm_backward_op(
        dout, a, w, offsets, s2d, d2s, efs, bias, activation, layout, gather, need[0], need[1],
        need[6], tf32, backend,
    )  # fmt: skip
    grads = [da if need[0] else None, dw if need[1] else None] + [None] * 10
    grads[6] = db if need[6] else None
    return tuple(grads)


torch.library.register_autograd(
    "moe_route::grouped_gemm", _grouped_gemm_backward, setup_context=_grouped_gemm_setup_context
)


def _n_out(w: torch.Tensor, activation: str) -> int:
    return w.shape[1] // 2 if activation in GATED_ACTIVATIONS else w.shape[1]


def bias_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """A per-expert bias has the activations' dtype or float32 (float64 only with float64)."""
    return (dtype,) if dtype in (torch.float32, torch.float64) else (dtype, torch.float32)


def check_gemm_args(a_name, a, w_name, w, bias_name, bias, activation, gate_up_layout, E=None):
    """Validate one grouped GEMM's operands; returns ``(E, N_out)``."""
    _checks.check_tensor(a_name, a, ndim=2, dtypes=GEMM_DTYPES)
    _checks.check_tensor(w_name, w, ndim=3, dtypes=GEMM_DTYPES)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up_layout={gate_up_layout!r}: expected one of {GATE_UP_LAYOUTS}")
    if w.dtype != a.dtype:
        raise TypeError(
            f"{w_name} has dtype {w.dtype} but {a_name} has {a.dtype}: expected one dtype"
        )
    if E is not None and w.shape[0] != E:
        raise ValueError(f"{w_name} must have E = {E} experts in dim 0, got {_checks.describe(w)}")
    if w.shape[2] != a.shape[1]:
        raise ValueError(
            f"{w_name} [E, N, K] must have K = {a_name}.shape[1] = {a.shape[1]}, "
            f"got {_checks.describe(w)}"
        )
    if activation in GATED_ACTIVATIONS and w.shape[1] % 2:
        raise ValueError(
            f"{w_name} for gated activation {activation!r} must have an even N = 2*I (gate and "
            f"up rows), got {_checks.describe(w)}"
        )
    if bias is not None:
        _checks.check_tensor(bias_name, bias, ndim=2, dtypes=bias_dtypes(a.dtype))
        if tuple(bias.shape) != tuple(w.shape[:2]):
            raise ValueError(
                f"{bias_name} must be [E, N] = {list(w.shape[:2])} (one row per expert, matching "
                f"{w_name}), got {_checks.describe(bias)}"
            )
    _checks.check_same_device(**{a_name: a, w_name: w, bias_name: bias})
    return w.shape[0], _n_out(w, activation)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    maps: RoutingMaps,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "identity",
    gate_up_layout: str = "concat",
    gather: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[d] = act(a[d] @ w[e].T + bias[e])`` for every permuted row ``d`` of expert ``e``.

    GEMM1 is ``grouped_gemm(x_perm, w1, maps, activation="swiglu")``, GEMM2 is
    ``grouped_gemm(h, w2, maps)``. One launch for all experts, no host synchronisation.

    Args:
        a: ``[T*K, Kd]`` permuted rows; with ``gather=True`` the token rows ``x [T, Kd]``, read
            through ``maps`` (the expand is fused into the GEMM: ``x_perm`` never exists).
        w: ``[E, N, Kd]`` weights, any strided view (e.g. ``[E, Kd, N].transpose(1, 2)``),
            never copied. Gated activations: ``N = 2*I`` rows, gate then up (``"concat"``) or
            alternating (``"interleaved"``).
        maps: :class:`RoutingMaps` for ``E = w.shape[0]`` experts.
        bias: optional ``[E, N]``.
        activation: ``swiglu`` / ``geglu`` (gated) or ``silu`` / ``gelu`` / ``relu`` / ``identity``.
        allow_tf32: float32 inputs use TF32 tensor cores (else exact float32 products).

    Returns:
        ``[T*K, N_out]`` in ``a.dtype`` (``N_out = I`` for gated activations, else ``N``),
        float32 accumulation, rounded once. Rows of dropped slots are zero.
    """
    E, _ = check_gemm_args("a", a, "w", w, "bias", bias, activation, gate_up_layout)
    if not isinstance(maps, RoutingMaps):
        raise TypeError(f"maps must be a RoutingMaps, got {type(maps).__name__}")
    if maps.num_experts != E:
        raise ValueError(f"maps were built for E={maps.num_experts} experts but w has E={E}")
    if gather:
        check_maps(maps, a.shape[0], a.device, "a")
    else:
        if a.shape[0] != maps.num_expanded_rows:
            raise ValueError(
                f"a must have T*K = {maps.num_expanded_rows} permuted rows (or pass gather=True "
                f"with x [T, Kd]), got {_checks.describe(a)}"
            )
    backend_for(a.device, backend)
    return _grouped_gemm_op(
        a, w, maps.expert_first_token_offset, maps.expanded_source_row_to_expanded_dest_row,
        maps.expanded_dest_row_to_expanded_source_row, maps.expert_for_source_row, bias,
        activation, gate_up_layout, gather, allow_tf32, backend,
    )  # fmt: skip

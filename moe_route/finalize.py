"""finalizeMoeRouting: unpermute, scale by router weight, K-way reduce, add bias.

The standalone path (this module's op) reads GEMM2's permuted output; the epilogue-fused path
lives in GEMM2 (:func:`moe_route.fused_moe`, see :func:`moe_route.arch.finalize_path_for`).
Both agree with :func:`moe_route.reference.finalize_moe_routing_reference`.
"""

from __future__ import annotations

import torch

from . import _checks, _interop, arch
from ._dispatch import (
    CallMemo,
    Op,
    bias_key,
    memo_env,
    memo_wanted,
    needs_dispatcher,
    rows_key,
)
from .kernels import torch_impl
from .kernels.triton.finalize import FinalizeLaunch, finalize_backward_triton, finalize_triton
from .maps import RoutingMaps, check_maps


def finalize_tables(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``out [T, H]`` on a resolved ``backend`` (the expand backward reuses it, unit weights)."""
    if backend == "torch":
        return torch_impl.finalize_torch(y_perm, topk_weights, src_to_dest, expert_for_src, bias)
    if backend == "cupy":
        from .kernels.cupy.finalize import finalize_cupy as launch
    else:
        launch = finalize_triton
    out = y_perm.new_empty(topk_weights.shape[0], y_perm.shape[1])
    launch(y_perm, topk_weights, src_to_dest, expert_for_src, bias, out)
    return out


def _finalize_fake(y_perm, topk_weights, src_to_dest, expert_for_src, bias, backend):
    return y_perm.new_empty(topk_weights.shape[0], y_perm.shape[1])


def _finalize_backward_impl(
    dout: torch.Tensor,
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    need_dy: bool,
    need_dw: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d y_perm, d topk_weights)``; one not asked for is an empty tensor."""
    if backend == "torch":
        dy, dw = torch_impl.finalize_backward_torch(
            dout, y_perm, topk_weights, src_to_dest, expert_for_src, need_dy=need_dy,
            need_dw=need_dw,
        )  # fmt: skip
    else:  # the Triton kernel (also for backend="cupy": the CuPy backend is forward-only)
        # Rows no slot owns stay zero; dy is contiguous whatever y_perm's strides.
        dy = (
            torch.zeros(y_perm.shape, dtype=y_perm.dtype, device=y_perm.device) if need_dy else None
        )
        dw = torch.empty_like(topk_weights) if need_dw else None
        finalize_backward_triton(dout, y_perm, topk_weights, src_to_dest, expert_for_src, dy, dw)
    return (
        dy if need_dy else y_perm.new_empty(0),
        dw if need_dw else topk_weights.new_empty(0),
    )


def _finalize_backward_fake(dout, y_perm, topk_weights, s2d, efs, need_dy, need_dw, backend):
    return (
        y_perm.new_empty(y_perm.shape) if need_dy else y_perm.new_empty(0),
        torch.empty_like(topk_weights) if need_dw else topk_weights.new_empty(0),
    )


_FINALIZE_BACKWARD = Op(
    "finalize_moe_routing_backward", _finalize_backward_impl, _finalize_backward_fake
)


def _setup_context(ctx, inputs, output):
    y_perm, topk_weights, src_to_dest, expert_for_src, bias, backend = inputs
    ctx.save_for_backward(y_perm, topk_weights, src_to_dest, expert_for_src)
    ctx.backend = backend
    ctx.bias_meta = None if bias is None else (bias.dim(), bias.dtype)


def _backward(ctx, dout):
    y_perm, topk_weights, src_to_dest, expert_for_src = ctx.saved_tensors
    need_dy, need_dw, need_bias = (ctx.needs_input_grad[i] for i in (0, 1, 4))
    dy = dw = dbias = None
    if need_dy or need_dw:
        dy, dw = _FINALIZE_BACKWARD(
            dout, y_perm, topk_weights, src_to_dest, expert_for_src, need_dy, need_dw,
            ctx.backend,
        )  # fmt: skip
    if need_bias:
        ndim, dtype = ctx.bias_meta
        acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
        dbias = (dout if ndim == 2 else dout.sum(0, dtype=acc)).to(dtype)
    return (dy if need_dy else None), (dw if need_dw else None), None, None, dbias, None


FINALIZE = Op(
    "finalize_moe_routing", finalize_tables, _finalize_fake, setup_context=_setup_context,
    backward=_backward,
)  # fmt: skip


def finalize_moe_routing(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    maps: RoutingMaps,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[t] = bias[t] + Σ_k topk_weights[t, k] · y_perm[dest(k*T + t)]``.

    The sum runs over routed slots only, in ascending ``k``, in float32 (float64 for float64
    inputs), and is rounded once to ``y_perm.dtype``. Deterministic.

    Args:
        y_perm: ``[T*K, H]`` permuted expert outputs (GEMM2), float16/bfloat16/float32/float64.
            Rows of dropped slots are never read.
        topk_weights: ``[T, K]`` router weights (``token_final_scales``), float32 or the
            activation dtype, any strides.
        maps: from :func:`moe_route.build_routing_maps`.
        bias: optional ``[H]`` or ``[T, H]`` (e.g. a residual), added once per token.
        backend: ``"auto"``, ``"triton"``, ``"cupy"`` or ``"torch"``.

        Any of the arrays may be a CuPy array (viewed without a copy).

    Returns:
        ``[T, H]`` in ``y_perm.dtype``, a CuPy array if any input was one. A token whose slots
        are all dropped gets ``bias[t]`` (or zeros).
    """
    key = _call_key(y_perm, topk_weights, maps, bias, backend) if memo_wanted() else None
    call = _CALLS.get(key)
    if call is not None:
        return call(y_perm, topk_weights, maps, bias)
    cupy_caller = _interop.any_cupy(y_perm, topk_weights, bias)
    if cupy_caller:
        y_perm, topk_weights, bias = map(_interop.as_torch, (y_perm, topk_weights, bias))
    _checks.check_tensor("y_perm", y_perm, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    T, K = topk_weights.shape
    H = y_perm.shape[1]
    check_maps(maps, T, topk_weights.device, "topk_weights")
    if maps.top_k != K:
        raise ValueError(
            f"topk_weights has K={K} slots per token but maps were built with K={maps.top_k}"
        )
    if y_perm.shape[0] != T * K:
        raise ValueError(
            f"y_perm must have T*K = {T * K} rows (T={T}, K={K}), got {_checks.describe(y_perm)}"
        )
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES)
        if tuple(bias.shape) not in ((H,), (T, H)):
            raise ValueError(
                f"bias must be [H] = [{H}] or [T, H] = [{T}, {H}], got {_checks.describe(bias)}"
            )
    _checks.check_same_device(y_perm=y_perm, topk_weights=topk_weights, bias=bias)
    chosen = arch.cached_backend(y_perm.device, backend)
    call = FinalizeCall(y_perm, topk_weights, maps, bias, chosen, key is not None)
    _CALLS.keep(key, call, (y_perm, topk_weights, bias, *maps.tensors()))
    out = call(y_perm, topk_weights, maps, bias)
    return _interop.as_cupy(out) if cupy_caller else out


class FinalizeCall:
    """What :func:`finalize_moe_routing` decided for one call signature (:func:`_call_key`):
    the backend, and where the call needs neither autograd nor the custom op's dispatch, the
    kernel's prepared launch."""

    __slots__ = ("backend", "launch")

    def __init__(self, y_perm, topk_weights, maps: RoutingMaps, bias, backend: str,
                 eager: bool):  # fmt: skip
        self.backend, self.launch = backend, None
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (y_perm, topk_weights, bias)
        )
        tensors = (y_perm, topk_weights, bias, *maps.tensors())
        if eager and not grads and backend == "triton" and not needs_dispatcher(tensors):
            self.launch = FinalizeLaunch(y_perm, topk_weights, bias, maps.top_k, y_perm.dtype)

    def __call__(self, y_perm, topk_weights, maps: RoutingMaps, bias) -> torch.Tensor:
        launch = self.launch
        s2d, efs = maps.expanded_source_row_to_expanded_dest_row, maps.expert_for_source_row
        if launch is None:
            return FINALIZE(y_perm, topk_weights, s2d, efs, bias, self.backend)
        out = y_perm.new_empty(maps.num_tokens, y_perm.shape[1])
        launch(y_perm, topk_weights, s2d, efs, bias, out)
        return out


#: :func:`finalize_moe_routing`'s decisions by call signature
_CALLS = CallMemo()


def _call_key(y_perm, topk_weights, maps, bias, backend) -> tuple | None:
    """The signature of a :func:`finalize_moe_routing` call: what its checks and decisions
    read of each tensor (per-token ones without their row count) and of the maps, whether
    the row counts agree with the maps' ``T`` and ``K``, the backend asked for, grad mode and
    the environment (None for arguments of the wrong kinds: the checks say what is wrong)."""
    try:
        T, K = maps.num_tokens, maps.top_k
        rows = (
            topk_weights.shape[0] == T
            and y_perm.shape[0] == T * K
            and (bias is None or bias.dim() == 1 or bias.shape[0] == T)
        )
        return (rows, rows_key(y_perm), rows_key(topk_weights), bias_key(bias), type(maps), K,
                maps.device, backend, torch.is_grad_enabled(), memo_env())  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None

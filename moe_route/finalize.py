"""finalizeMoeRouting: unpermute, scale by router weight, K-way reduce, add bias.

The standalone path (this module's kernel) reads GEMM2's permuted output. On SM90+ the same
reduction is meant to live in GEMM2's epilogue (see :func:`moe_route.arch.finalize_path_for`);
both must agree with :func:`moe_route.reference.finalize_moe_routing_reference`.
"""

from __future__ import annotations

import torch

from . import _checks, _interop
from .arch import backend_for
from .maps import RoutingMaps
from .permute import check_maps
from .reference import finalize_moe_routing_reference


@torch.library.custom_op("moe_route::finalize_moe_routing", mutates_args=())
def _finalize_op(
    y_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    src_to_dest: torch.Tensor,
    expert_for_src: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    chosen = backend_for(y_perm.device, backend).value
    if chosen == "reference":
        return finalize_moe_routing_reference(
            y_perm, topk_weights, src_to_dest, expert_for_src, bias
        )
    if chosen == "cupy":
        from .kernels.cupy.finalize import finalize_cupy as launch
    else:
        from .kernels.triton.finalize import finalize_triton as launch

    out = y_perm.new_empty(topk_weights.shape[0], y_perm.shape[1])
    launch(y_perm, topk_weights, src_to_dest, expert_for_src, bias, out)
    return out


@_finalize_op.register_fake
def _(y_perm, topk_weights, src_to_dest, expert_for_src, bias, backend):
    return y_perm.new_empty(topk_weights.shape[0], y_perm.shape[1])


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
        backend: ``"auto"``, ``"triton"``, ``"cupy"`` or ``"reference"``.

        Any of the arrays may be a CuPy array (viewed without a copy).

    Returns:
        ``[T, H]`` in ``y_perm.dtype``, a CuPy array if any input was one. A token whose slots
        are all dropped gets ``bias[t]`` (or zeros).
    """
    cupy_caller = _interop.any_cupy(y_perm, topk_weights, bias)
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
    backend_for(y_perm.device, backend)
    out = _finalize_op(
        y_perm,
        topk_weights,
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expert_for_source_row,
        bias,
        backend,
    )
    return _interop.as_cupy(out) if cupy_caller else out

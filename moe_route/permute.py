"""Expand (permute) token rows into the expert-grouped order of the routing maps."""

from __future__ import annotations

import torch

from . import _checks, _interop
from .arch import backend_for
from .maps import RoutingMaps
from .reference import expand_rows_reference


@torch.library.custom_op("moe_route::expand_rows", mutates_args=())
def _expand_rows_op(
    x: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    chosen = backend_for(x.device, backend).value
    if chosen == "reference":
        return expand_rows_reference(x, dest_to_src, offsets)
    if chosen == "cupy":
        from .kernels.cupy.expand import expand_rows_cupy as launch
    else:
        from .kernels.triton.expand import expand_rows_triton as launch

    out = x.new_empty(src_to_dest.numel(), x.shape[1])
    launch(x, src_to_dest, expert_for_src, out)
    return out


@_expand_rows_op.register_fake
def _(x, src_to_dest, dest_to_src, expert_for_src, offsets, backend):
    return x.new_empty(src_to_dest.numel(), x.shape[1])


def _expand_rows_setup_context(ctx, inputs, output):
    x, src_to_dest, _, expert_for_src, _, backend = inputs
    ctx.save_for_backward(src_to_dest, expert_for_src)
    ctx.meta = (x.shape[0], x.dtype, backend)


def _expand_rows_backward(ctx, d_x_perm):
    """``dx[t] = Σ_k d_x_perm[dest(k*T+t)]`` over routed slots, ``k`` ascending: the finalize
    reduction with unit weights (deterministic, float32 accumulation)."""
    from .finalize import _finalize_op

    src_to_dest, expert_for_src = ctx.saved_tensors
    T, dtype, backend = ctx.meta
    K = src_to_dest.numel() // T if T else 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    unit = torch.ones(T, K, dtype=acc, device=d_x_perm.device)
    dx = _finalize_op(d_x_perm, unit, src_to_dest, expert_for_src, None, backend)
    return dx, None, None, None, None, None


torch.library.register_autograd(
    "moe_route::expand_rows", _expand_rows_backward, setup_context=_expand_rows_setup_context
)


def check_maps(maps: object, num_tokens: int, device: torch.device, arg: str) -> RoutingMaps:
    if not isinstance(maps, RoutingMaps):
        raise TypeError(
            f"maps must be a RoutingMaps from build_routing_maps, got {type(maps).__name__}"
        )
    if maps.num_tokens != num_tokens:
        raise ValueError(
            f"maps were built for T={maps.num_tokens} tokens but {arg} has {num_tokens} tokens"
        )
    if maps.device != device:
        raise ValueError(f"maps are on {maps.device} but {arg} is on {device}")
    return maps


def expand_rows(x: torch.Tensor, maps: RoutingMaps, *, backend: str = "auto") -> torch.Tensor:
    """Gather token rows into permuted (expert-grouped) order.

    Args:
        x: ``[T, H]`` float16/bfloat16/float32/float64, any strides; a torch tensor or a CuPy
            array (viewed without a copy).
        maps: from :func:`moe_route.build_routing_maps` for the same ``T``.
        backend: ``"auto"``, ``"triton"``, ``"cupy"`` or ``"reference"``.

    Returns:
        ``x_perm [T*K, H]`` (contiguous, ``x.dtype``, a CuPy array if ``x`` is one):
        ``x_perm[d] = x[t]`` for the routed dest row ``d`` of token ``t``; dropped rows
        (``d >= expert_first_token_offset[E]``) are zero.
    """
    cupy_caller = _interop.is_cupy(x)
    x = _interop.as_torch(x)
    _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    check_maps(maps, x.shape[0], x.device, "x")
    backend_for(x.device, backend)
    out = _expand_rows_op(
        x,
        maps.expanded_source_row_to_expanded_dest_row,
        maps.expanded_dest_row_to_expanded_source_row,
        maps.expert_for_source_row,
        maps.expert_first_token_offset,
        backend,
    )
    return _interop.as_cupy(out) if cupy_caller else out

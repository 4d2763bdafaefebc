"""Expand (permute) token rows into the expert-grouped order of the routing maps."""

from __future__ import annotations

import torch

from . import _checks, _interop, arch
from ._dispatch import Op
from .finalize import FINALIZE
from .kernels import torch_impl
from .kernels.triton.expand import expand_rows_triton
from .maps import RoutingMaps, check_maps


def expand_tables(
    x: torch.Tensor,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """``x_perm [T*K, H]`` on a resolved ``backend``."""
    if backend == "torch":
        return torch_impl.expand_rows_torch(x, dest_to_src, offsets)
    if backend == "cupy":
        from .kernels.cupy.expand import expand_rows_cupy as launch
    else:
        launch = expand_rows_triton
    out = x.new_empty(src_to_dest.numel(), x.shape[1])
    launch(x, src_to_dest, expert_for_src, out)
    return out


def _expand_fake(x, src_to_dest, dest_to_src, expert_for_src, offsets, backend):
    return x.new_empty(src_to_dest.numel(), x.shape[1])


def _setup_context(ctx, inputs, output):
    x, src_to_dest, _, expert_for_src, _, backend = inputs
    ctx.save_for_backward(src_to_dest, expert_for_src)
    ctx.meta = (x.shape[0], x.dtype, backend)


def _backward(ctx, d_x_perm):
    """``dx[t] = Σ_k d_x_perm[dest(k*T+t)]`` over routed slots, ``k`` ascending: the finalize
    reduction with unit weights (deterministic, float32 accumulation)."""
    src_to_dest, expert_for_src = ctx.saved_tensors
    T, dtype, backend = ctx.meta
    K = src_to_dest.numel() // T if T else 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    unit = torch.ones((), dtype=acc, device=d_x_perm.device).expand(T, K)
    dx = FINALIZE(d_x_perm, unit, src_to_dest, expert_for_src, None, backend)
    return dx, None, None, None, None, None


EXPAND = Op(
    "expand_rows", expand_tables, _expand_fake, setup_context=_setup_context, backward=_backward
)


def expand_rows(x: torch.Tensor, maps: RoutingMaps, *, backend: str = "auto") -> torch.Tensor:
    """Gather token rows into permuted (expert-grouped) order.

    Args:
        x: ``[T, H]`` float16/bfloat16/float32/float64, any strides; a torch tensor or a CuPy
            array (viewed without a copy).
        maps: from :func:`moe_route.build_routing_maps` for the same ``T``.
        backend: ``"auto"``, ``"triton"``, ``"cupy"`` or ``"torch"``.

    Returns:
        ``x_perm [T*K, H]`` (contiguous, ``x.dtype``, a CuPy array if ``x`` is one):
        ``x_perm[d] = x[t]`` for the routed dest row ``d`` of token ``t``; dropped rows
        (``d >= expert_first_token_offset[E]``) are zero.
    """
    cupy_caller = _interop.is_cupy(x)
    if cupy_caller:
        x = _interop.as_torch(x)
    _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    check_maps(maps, x.shape[0], x.device, "x")
    out = EXPAND(x, *maps.tensors(), arch.cached_backend(x.device, backend))
    return _interop.as_cupy(out) if cupy_caller else out

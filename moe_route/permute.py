"""Expand (permute) token rows into the expert-grouped order of the routing maps."""

from __future__ import annotations

import torch

from . import _checks, _interop, arch
from ._dispatch import CallMemo, Op, memo_env, memo_wanted, needs_dispatcher, rows_key
from .finalize import FINALIZE
from .kernels import torch_impl
from .kernels.triton.expand import ExpandLaunch, expand_rows_triton
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
    key = _call_key(x, maps, backend) if memo_wanted() else None
    call = _CALLS.get(key)
    if call is not None:
        return call(x, maps)
    cupy_caller = _interop.is_cupy(x)
    if cupy_caller:
        x = _interop.as_torch(x)
    _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    check_maps(maps, x.shape[0], x.device, "x")
    call = ExpandCall(x, maps, arch.cached_backend(x.device, backend), key is not None)
    _CALLS.keep(key, call, (x, *maps.tensors()))
    out = call(x, maps)
    return _interop.as_cupy(out) if cupy_caller else out


class ExpandCall:
    """What :func:`expand_rows` decided for one call signature (:func:`_call_key`): the
    backend, and where the call needs neither autograd nor the custom op's dispatch, the
    kernel's prepared launch."""

    __slots__ = ("backend", "launch")

    def __init__(self, x: torch.Tensor, maps: RoutingMaps, backend: str, eager: bool):
        self.backend, self.launch = backend, None
        plain = eager and not (x.requires_grad and torch.is_grad_enabled())
        if plain and backend == "triton" and not needs_dispatcher((x, *maps.tensors())):
            self.launch = ExpandLaunch(x, maps.top_k)

    def __call__(self, x: torch.Tensor, maps: RoutingMaps) -> torch.Tensor:
        launch = self.launch
        if launch is None:
            return EXPAND(x, *maps.tensors(), self.backend)
        out = x.new_empty(maps.num_tokens * maps.top_k, x.shape[1])
        launch(x, maps.expanded_source_row_to_expanded_dest_row, maps.expert_for_source_row, out)
        return out


#: :func:`expand_rows`'s decisions by call signature
_CALLS = CallMemo()


def _call_key(x, maps, backend) -> tuple | None:
    """The signature of an :func:`expand_rows` call: what its checks and decisions read of
    ``x`` (:func:`~moe_route._dispatch.rows_key`) and of the maps, whether they agree on
    ``T``, the backend asked for, grad mode and the environment (None for arguments that are
    not a tensor and maps: the checks say what is wrong)."""
    try:
        return (rows_key(x), x.shape[0] == maps.num_tokens, type(maps), maps.top_k,
                maps.device, backend, torch.is_grad_enabled(), memo_env())  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None

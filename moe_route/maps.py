"""Routing maps: the expanded-row permutation tables of the data contract.

``build_routing_maps(topk_ids, num_experts)`` turns the router's ``[T, K]`` expert ids into the
tables every later stage reads. See ``DESIGN.md`` for the contract; in short, expanded source
row ``s = k*T + t`` is slot ``k`` of token ``t``, and the permuted (dest) order groups rows by
expert, ascending, then token, then slot, with dropped slots (``-1``) last in source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks, _interop
from .arch import backend_for
from .reference import routing_maps_reference


@dataclass(frozen=True)
class RoutingMaps:
    """The routing tables for ``T`` tokens, ``K`` slots each, ``E`` experts (``N = T*K``).

    All tensors live on the device of the ``topk_ids`` they were built from.
    """

    #: ``[N] int32`` — dest (permuted) row of expanded source row ``s = k*T + t``.
    expanded_source_row_to_expanded_dest_row: torch.Tensor
    #: ``[N] int32`` — the inverse permutation: source row of dest row ``d``.
    expanded_dest_row_to_expanded_source_row: torch.Tensor
    #: ``[N] int32`` — expert of source row ``s`` (``topk_ids[t, k]``), ``-1`` if dropped.
    expert_for_source_row: torch.Tensor
    #: ``[E+1] int64`` — first dest row of expert ``e``; entry ``E`` is the number of routed
    #: rows, after which the dropped rows sit.
    expert_first_token_offset: torch.Tensor
    #: ``T``, tokens (``num_rows`` in the reference walkthrough).
    num_tokens: int
    #: ``K``, slots per token (``experts_per_token``).
    top_k: int
    #: ``E``, experts.
    num_experts: int

    def __post_init__(self):
        n = self.num_tokens * self.top_k
        for name in (
            "expanded_source_row_to_expanded_dest_row",
            "expanded_dest_row_to_expanded_source_row",
            "expert_for_source_row",
        ):
            t = getattr(self, name)
            if t.dtype != torch.int32 or tuple(t.shape) != (n,):
                raise ValueError(
                    f"RoutingMaps.{name}: expected [{n}] int32, got {_checks.describe(t)}"
                )
        off = self.expert_first_token_offset
        if off.dtype != torch.int64 or tuple(off.shape) != (self.num_experts + 1,):
            raise ValueError(
                f"RoutingMaps.expert_first_token_offset: expected [{self.num_experts + 1}] int64, "
                f"got {_checks.describe(off)}"
            )

    @property
    def num_expanded_rows(self) -> int:
        """``N = T*K``: rows of the permuted buffers (routed rows first, dropped after)."""
        return self.num_tokens * self.top_k

    @property
    def device(self) -> torch.device:
        return self.expert_first_token_offset.device

    def tokens_per_expert(self) -> torch.Tensor:
        """``[E] int64`` routed rows per expert (a device op, no host sync)."""
        return torch.diff(self.expert_first_token_offset)


@torch.library.custom_op("moe_route::routing_maps", mutates_args=())
def _routing_maps_op(
    topk_ids: torch.Tensor, num_experts: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = backend_for(topk_ids.device, backend, op="routing_maps", slots=topk_ids.numel()).value
    if chosen == "reference":
        return routing_maps_reference(topk_ids, num_experts)
    if chosen == "cupy":
        from .kernels.cupy.routing_maps import routing_maps_cupy as launch
    else:
        from .kernels.triton.routing_maps import routing_maps_triton as launch

    n = topk_ids.numel()
    src_to_dest = topk_ids.new_empty(n, dtype=torch.int32)
    dest_to_src = topk_ids.new_empty(n, dtype=torch.int32)
    expert_for_src = topk_ids.new_empty(n, dtype=torch.int32)
    offsets = topk_ids.new_empty(num_experts + 1, dtype=torch.int64)
    launch(topk_ids, num_experts, src_to_dest, dest_to_src, expert_for_src, offsets)
    return src_to_dest, dest_to_src, expert_for_src, offsets


@_routing_maps_op.register_fake
def _(topk_ids, num_experts, backend):
    n = topk_ids.numel()
    return (
        topk_ids.new_empty(n, dtype=torch.int32),
        topk_ids.new_empty(n, dtype=torch.int32),
        topk_ids.new_empty(n, dtype=torch.int32),
        topk_ids.new_empty(num_experts + 1, dtype=torch.int64),
    )


def _check_kernel_limits(chosen: str, E: int, K: int, device: torch.device) -> None:
    if chosen == "triton":
        from .kernels.triton.routing_maps import check_num_experts_supported
    elif chosen == "cupy":
        from .kernels.cupy.routing_maps import check_num_experts_supported
    else:
        return  # the reference takes any E
    check_num_experts_supported(E, K, device)


def build_routing_maps(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    backend: str = "auto",
    check_ids: bool | None = None,
) -> RoutingMaps:
    """Build the routing tables from the router's choices.

    Args:
        topk_ids: ``[T, K]`` int32/int64 expert ids (any strides), a torch tensor or a CuPy
            array (viewed without a copy); ``-1`` marks a dropped slot. ``T = 0`` is allowed;
            ``K <= num_experts``.
        num_experts: ``E >= 1``. The kernels hold a counter per expert in one program: Triton
            takes ``E + K + 1 <= 32768`` on an A100/H100/H200 (fewer on GPUs with less shared
            memory), CuPy ``E + K <= opt-in shared memory / 8 bytes``; the reference any ``E``.
        backend: ``"auto"`` (Triton on CUDA, or the CuPy kernels at the sizes where they
            measured faster when CuPy is installed; reference on CPU), ``"triton"``,
            ``"cupy"`` or ``"reference"``.
        check_ids: verify every id is in ``[-1, E)`` and raise ``ValueError`` otherwise.
            Reading the ids synchronises with the host, so the default (``None``) checks CPU
            tensors only, and GPU tensors when ``MOE_ROUTE_CHECK_IDS=1``. Unchecked ids outside
            the range are treated as dropped (``-1``) by the kernels: never out-of-bounds.

    Returns:
        :class:`RoutingMaps` of torch tensors, whichever type ``topk_ids`` had (a CuPy caller
        views a table without a copy: ``cupy.from_dlpack(maps.expert_first_token_offset)``).
        Deterministic: the same ids give the same bits.
    """
    E = _checks.check_num_experts(num_experts)
    ids = _checks.check_topk_ids(_interop.as_torch(topk_ids), E)
    chosen = backend_for(ids.device, backend, op="routing_maps", slots=ids.numel()).value
    _check_kernel_limits(chosen, E, ids.shape[1], ids.device)  # before any launch
    if _checks.ids_value_check_wanted(ids, check_ids):
        _checks.check_topk_id_values(ids, E)
    T, K = ids.shape
    tables = _routing_maps_op(ids, E, backend)
    return RoutingMaps(*tables, num_tokens=T, top_k=K, num_experts=E)

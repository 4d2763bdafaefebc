"""Routing maps: the expanded-row permutation tables of the data contract.

``build_routing_maps(topk_ids, num_experts)`` turns the router's ``[T, K]`` expert ids into the
tables every later stage reads. See ``DESIGN.md`` for the contract; in short, expanded
source row ``s = k*T + t`` is slot ``k`` of token ``t``, and the permuted (dest) order groups rows
by expert, ascending, then token, then slot, with dropped slots (``-1``) last in source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks, _interop, arch
from ._dispatch import CallMemo, Op, memo_env, memo_wanted, needs_dispatcher, rows_key
from ._env import flag
from .kernels import torch_impl
from .kernels.triton.routing_maps import MapsLaunch, routing_maps_triton
from .tuning import token_bucket

#: The tables' field names in :meth:`RoutingMaps.tensors` order.
_TABLES = (
    "expanded_source_row_to_expanded_dest_row",
    "expanded_dest_row_to_expanded_source_row",
    "expert_for_source_row",
    "expert_first_token_offset",
)


@dataclass(frozen=True)
class RoutingMaps:
    """The routing tables for ``T`` tokens, ``K`` slots each, ``E`` experts (``N = T*K``).

    All tensors live on the device of the ``topk_ids`` they were built from. Maps from
    :func:`build_routing_maps` are consistent by construction. Maps built by hand are checked
    when constructed: shapes, dtypes and devices always; the *values* (the two permutations
    inverse to each other, experts in range and grouped as the offsets say) when the tables
    are on the CPU, or on a GPU with ``MOE_ROUTE_CHECK_IDS=1`` or :meth:`validate` (reading
    them synchronises). Unchecked inconsistent maps on a GPU are undefined behaviour. A table
    given as a strided view is kept as a contiguous copy (the kernels read flat arrays). The
    constructor has no unchecked mode: only the library's own code, which builds the tables
    by construction, skips the checks (a private classmethod).
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
        _checks.check_size("RoutingMaps.num_tokens", self.num_tokens, 0)
        _checks.check_size("RoutingMaps.top_k", self.top_k, 1)
        _checks.check_num_experts(self.num_experts, "RoutingMaps.num_experts")
        n = self.num_tokens * self.top_k
        for name in (
            "expanded_source_row_to_expanded_dest_row",
            "expanded_dest_row_to_expanded_source_row",
            "expert_for_source_row",
        ):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (n,):
                got = _checks.describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"RoutingMaps.{name}: expected [{n}] int32, got {got}")
        off = self.expert_first_token_offset
        if off.dtype != torch.int64 or tuple(off.shape) != (self.num_experts + 1,):
            raise ValueError(
                f"RoutingMaps.expert_first_token_offset: expected [{self.num_experts + 1}] int64, "
                f"got {_checks.describe(off)}"
            )
        # The kernels index the tables as flat arrays: strided views become contiguous copies.
        for name, t in zip(_TABLES, self.tensors(), strict=True):
            if not t.is_contiguous():
                object.__setattr__(self, name, t.contiguous())
        devices = {t.device for t in self.tensors()}
        if len(devices) != 1:
            raise ValueError(
                f"RoutingMaps tensors are on several devices: {sorted(map(str, devices))}"
            )
        if off.device.type == "cpu" or flag("MOE_ROUTE_CHECK_IDS"):
            self.validate()

    @classmethod
    def _built(cls, tables, num_tokens: int, top_k: int, num_experts: int) -> RoutingMaps:
        """Maps from the library's own kernels (``tables`` in :meth:`tensors` order), unchecked:
        private, for code that builds the tables by construction.

        Filled in directly, not through the frozen dataclass's ``__init__`` (one
        ``object.__setattr__`` per field and the ``__post_init__`` call), which costs four times
        as much host time per call (docs/decisions.md, "Call memos")."""
        maps = object.__new__(cls)
        d = maps.__dict__
        (
            d["expanded_source_row_to_expanded_dest_row"],
            d["expanded_dest_row_to_expanded_source_row"],
            d["expert_for_source_row"],
            d["expert_first_token_offset"],
        ) = tables
        d["num_tokens"], d["top_k"], d["num_experts"] = num_tokens, top_k, num_experts
        return maps

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tables in the one order every op takes them: ``(src_to_dest, dest_to_src,
        expert_for_src, offsets)``."""
        return (
            self.expanded_source_row_to_expanded_dest_row,
            self.expanded_dest_row_to_expanded_source_row,
            self.expert_for_source_row,
            self.expert_first_token_offset,
        )

    def validate(self) -> None:
        """Raise ``ValueError`` unless the tables are consistent (reads them: syncs on a GPU)."""
        s2d, d2s, efs, off = (t.to(torch.int64) for t in self.tensors())
        n, E = s2d.numel(), self.num_experts
        if n and (bool((s2d < 0).any()) or bool((s2d >= n).any())):
            bad = int(((s2d < 0) | (s2d >= n)).nonzero()[0])
            raise ValueError(
                f"RoutingMaps.expanded_source_row_to_expanded_dest_row[{bad}] = {int(s2d[bad])} "
                f"is out of range: expected dest rows in [0, T*K = {n})"
            )
        if n and not torch.equal(d2s[s2d], torch.arange(n, device=s2d.device)):
            raise ValueError(
                "RoutingMaps: expanded_dest_row_to_expanded_source_row is not the inverse of "
                "expanded_source_row_to_expanded_dest_row"
            )
        if bool((off[1:] < off[:-1]).any()) or int(off[0]) != 0 or int(off[-1]) > n:
            raise ValueError(
                f"RoutingMaps.expert_first_token_offset = {off.tolist()}: expected ascending "
                f"offsets from 0 to at most T*K = {n}"
            )
        if bool(((efs < -1) | (efs >= E)).any()):
            raise ValueError(f"RoutingMaps.expert_for_source_row: expected experts in [-1, {E})")
        expert_of_dest = torch.searchsorted(off, torch.arange(n, device=off.device), right=True) - 1
        expert_of_dest = torch.where(expert_of_dest >= E, -1, expert_of_dest)
        if n and not torch.equal(efs, expert_of_dest[s2d]):
            raise ValueError(
                "RoutingMaps: expert_for_source_row disagrees with expert_first_token_offset "
                "(each source row's dest row must lie in its expert's range; dropped rows after "
                "offset[E])"
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


def check_maps(maps: object, num_tokens: int, device: torch.device, arg: str) -> RoutingMaps:
    """``maps`` is a :class:`RoutingMaps` for ``num_tokens`` tokens on ``device``."""
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


# --------------------------------------------------------------------------- op
def routing_maps_tables(topk_ids: torch.Tensor, num_experts: int, backend: str):
    """The four tables (:meth:`RoutingMaps.tensors` order) on a resolved ``backend``."""
    if backend == "torch":
        return torch_impl.routing_maps_torch(topk_ids, num_experts)
    if backend == "cupy":
        from .kernels.cupy.routing_maps import routing_maps_cupy as launch
    else:
        launch = routing_maps_triton
    tables = new_tables(topk_ids, num_experts)
    launch(topk_ids, num_experts, *tables)
    return tables


def new_tables(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Uninitialised tables (:meth:`RoutingMaps.tensors` order) for ``topk_ids``'s slots:
    one allocation for the three int32 tables (views), one for the offsets."""
    tables = topk_ids.new_empty(3, topk_ids.numel(), dtype=torch.int32)
    offsets = topk_ids.new_empty(num_experts + 1, dtype=torch.int64)
    return (*tables.unbind(0), offsets)


def _routing_maps_impl(
    topk_ids: torch.Tensor, num_experts: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tables = routing_maps_tables(topk_ids, num_experts, backend)
    # Custom-op outputs may not alias each other: copies under compile only (not the eager path).
    return (*(t.clone() for t in tables[:3]), tables[3])


def _routing_maps_fake(topk_ids, num_experts, backend):
    n = topk_ids.numel()
    i32 = [topk_ids.new_empty(n, dtype=torch.int32) for _ in range(3)]
    return (*i32, topk_ids.new_empty(num_experts + 1, dtype=torch.int64))


_ROUTING_MAPS = Op("routing_maps", _routing_maps_impl, _routing_maps_fake)


def maps_op(topk_ids: torch.Tensor, num_experts: int, backend: str) -> RoutingMaps:
    """Maps on a resolved backend, no checks (internal composition: ``fused_moe``, the layer)."""
    T, K = topk_ids.shape
    if torch.compiler.is_compiling() or needs_dispatcher((topk_ids,)):
        tables = _ROUTING_MAPS.op(topk_ids, num_experts, backend)
    else:
        tables = routing_maps_tables(topk_ids, num_experts, backend)
    return RoutingMaps._built(tables, T, K, num_experts)


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
        num_experts: ``1 <= E <= 2**31 - 1`` (the maps' expert ids are int32, whatever the
            ids' dtype). The kernels hold a counter per expert in one program: Triton
            takes ``E + K + 1 <= 32768`` on an A100/H100/H200 (fewer on GPUs with less shared
            memory), CuPy ``E + K <= opt-in shared memory / 8 bytes``; the reference any ``E``.
        backend: ``"auto"`` (Triton on CUDA, or the CuPy kernels at the sizes where they
            measured faster when CuPy is installed; torch on CPU), ``"triton"``, ``"cupy"`` or
            ``"torch"``.
        check_ids: verify every id is in ``[-1, E)`` and raise ``ValueError`` otherwise.
            Reading the ids synchronises with the host, so the default (``None``) checks CPU
            tensors only, and GPU tensors when ``MOE_ROUTE_CHECK_IDS=1``. Unchecked ids outside
            the range are treated as dropped (``-1``) by the kernels: never out-of-bounds.

    Returns:
        :class:`RoutingMaps` of torch tensors, whichever type ``topk_ids`` had (a CuPy caller
        views a table without a copy: ``cupy.from_dlpack(maps.expert_first_token_offset)``).
        Deterministic: the same ids give the same bits.
    """
    key = _call_key(topk_ids, num_experts, backend, check_ids) if memo_wanted() else None
    call = _CALLS.get(key)
    if call is not None:
        return call(topk_ids)
    E = _checks.check_num_experts(num_experts)
    _checks.check_bool("check_ids", check_ids, optional=True)
    ids = _checks.check_topk_ids(_interop.as_torch(topk_ids), E)
    T, K = ids.shape
    chosen = _cached_maps_backend(ids.device, backend, T, K, E)
    call = MapsCall(ids, E, chosen, _checks.ids_value_check_wanted(ids, check_ids),
                    key is not None)  # fmt: skip
    if token_bucket(T) * K < 2**31:  # the whole bucket fits the int32 rows
        _CALLS.keep(key, call, (ids,))
    return call(ids)


class MapsCall:
    """What :func:`build_routing_maps` decided for one call signature (:func:`_call_key`):
    the backend, whether the ids' values are checked (per call), and where the call needs no
    custom op's dispatch, the kernels' prepared launches."""

    __slots__ = ("E", "backend", "check_values", "launch")

    def __init__(self, ids: torch.Tensor, E: int, backend: str, check_values: bool,
                 eager: bool):  # fmt: skip
        self.E, self.backend, self.check_values, self.launch = E, backend, check_values, None
        if eager and backend == "triton" and not needs_dispatcher((ids,)):
            self.launch = MapsLaunch(ids, E, token_bucket(ids.shape[0]))

    def __call__(self, ids: torch.Tensor) -> RoutingMaps:
        E, launch = self.E, self.launch
        if self.check_values:
            _checks.check_topk_id_values(ids, E)
        if launch is None:
            return maps_op(ids, E, self.backend)
        tables = new_tables(ids, E)
        launch(ids, *tables)
        T, K = ids.shape
        return RoutingMaps._built(tables, T, K, E)


#: :func:`build_routing_maps`'s decisions by call signature
_CALLS = CallMemo()


def _call_key(topk_ids, num_experts, backend, check_ids) -> tuple | None:
    """The signature of a :func:`build_routing_maps` call: what its checks and decisions read
    of the ids (without their row count: the token bucket instead), ``num_experts`` (and its
    type: ``True`` is not 1 here), the backend asked for, ``check_ids`` and the environment
    (None for ids that are not a torch tensor: a CuPy array is viewed first)."""
    try:
        return (token_bucket(topk_ids.shape[0]), rows_key(topk_ids), type(num_experts),
                num_experts, backend, check_ids, memo_env())  # fmt: skip
    except (AttributeError, TypeError, IndexError):
        return None


def _cached_maps_backend(device: torch.device, backend: str, T: int, K: int, E: int) -> str:
    return _bucket_maps_backend(device, backend, token_bucket(T), K, E)


@arch.env_cached
def _bucket_maps_backend(device: torch.device, backend: str, bucket: int, K: int, E: int) -> str:
    """Keyed on the token bucket, the unit :func:`moe_route.arch.maps_backend` decides on."""
    arch.check_backend_name(backend)
    chosen = arch.maps_backend(device, backend, bucket, K, E)
    arch.check_kernel_limits(chosen, E, K, device)  # before any launch
    return chosen

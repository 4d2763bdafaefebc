"""The routing maps in the torch backend: one stable sort of each slot's bin, in Python lists
(a few slots), NumPy (CPU tensors) or torch ops (any device)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .common import _as

# Routing maps in Python lists at small T, NumPy's sort at large T: docs/decisions.md, "Torch
# backend on the CPU".
_PYTHON_MAPS_MAX_SLOTS = 32
_INT16_MAX = 2**15 - 1


# --------------------------------------------------------------------------- routing maps
def routing_maps_torch(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four tables of :func:`moe_route.reference.routing_maps_reference`, by one stable
    sort of each slot's *bin*: its expert, or ``E + k`` for a dropped slot in column ``k``
    (token-major order inside a bin is then the contract's token-then-slot order, and the
    dropped bins ``E + k`` hold the dropped slots in source-row order). Ids outside
    ``[-1, E)`` count as dropped. No host synchronisation (CPU tensors go through NumPy).
    """
    if topk_ids.device.type == "cpu":
        if topk_ids.numel() <= _PYTHON_MAPS_MAX_SLOTS:
            return _routing_maps_python(topk_ids, num_experts)
        if num_experts + topk_ids.shape[1] <= _INT16_MAX:
            return _routing_maps_numpy(topk_ids, num_experts)
    return _routing_maps_sorted(topk_ids, num_experts)


def _routing_maps_sorted(topk_ids: torch.Tensor, E: int):
    """:func:`routing_maps_torch` in torch ops (any device, any E)."""
    T, K = topk_ids.shape
    N = T * K
    device = topk_ids.device
    routed = (topk_ids >= 0) & (topk_ids < E)  # before the int32 cast, which could wrap
    ids = _as(topk_ids, torch.int32)
    dropped_bins = torch.arange(E, E + K, dtype=torch.int32, device=device)
    bins = torch.where(routed, ids, dropped_bins)  # [T, K]: token-major i = t*K + k
    sorted_bins, order = torch.sort(bins.reshape(N), stable=True)
    rows = torch.arange(N, dtype=torch.int32, device=device)
    source_of = rows.view(K, T).t().reshape(N)  # s = k*T + t of token-major slot i
    dest_to_src = source_of[order]
    src_to_dest = torch.empty_like(dest_to_src)
    src_to_dest[dest_to_src] = rows
    expert_for_src = torch.where(routed, ids, -1).t().reshape(N)
    experts = torch.arange(E + 1, dtype=torch.int32, device=device)
    offsets = torch.searchsorted(sorted_bins, experts)  # bins below e: e's first dest row
    return src_to_dest, dest_to_src, expert_for_src, offsets


def _routing_maps_python(topk_ids: torch.Tensor, E: int):
    """:func:`_routing_maps_sorted` on a few slots in Python lists: the same bins and stable
    order, and four tensors built at the end."""
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1).tolist()  # token-major: i = t*K + k
    bins = [e if 0 <= e < E else E + i % K for i, e in enumerate(flat)]
    dest_to_src = [(i % K) * T + i // K for i in sorted(range(T * K), key=bins.__getitem__)]
    src_to_dest = [0] * (T * K)
    for d, s in enumerate(dest_to_src):
        src_to_dest[s] = d
    expert_for_src = [bins[t * K + k] for k in range(K) for t in range(T)]
    counts = [0] * (E + 1)
    for b in bins:
        if b < E:
            counts[b + 1] += 1
    return (
        torch.tensor(src_to_dest, dtype=torch.int32),
        torch.tensor(dest_to_src, dtype=torch.int32),
        torch.tensor([b if b < E else -1 for b in expert_for_src], dtype=torch.int32),
        torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int64),
    )


def _routing_maps_numpy(topk_ids: torch.Tensor, E: int):
    """:func:`_routing_maps_sorted` in NumPy, for CPU tensors with ``E + K`` below 2**15: a
    NumPy call costs a fraction of a torch op's overhead, and int16 bins get NumPy's radix
    sort (stable, linear)."""
    T, K = topk_ids.shape
    N = T * K
    ids = topk_ids.numpy()  # a view, any strides
    routed = (ids >= 0) & (ids < E)
    bins = np.where(routed, ids, np.arange(E, E + K)).astype(np.int16).reshape(N)
    order = np.argsort(bins, kind="stable")
    rows = np.arange(N, dtype=np.int32)
    dest_to_src = rows.reshape(K, T).T.reshape(N)[order]
    src_to_dest = np.empty(N, dtype=np.int32)
    src_to_dest[dest_to_src] = rows
    expert_for_src = np.where(routed, ids, -1).T.astype(np.int32).reshape(N)
    offsets = np.searchsorted(bins[order], np.arange(E + 1, dtype=np.int16))
    return (
        torch.from_numpy(src_to_dest),
        torch.from_numpy(dest_to_src),
        torch.from_numpy(expert_for_src),
        torch.from_numpy(offsets.astype(np.int64, copy=False)),
    )

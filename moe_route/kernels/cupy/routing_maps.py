"""Launcher of ``routing_maps.cu``: the four routing tables from ``topk_ids [T, K]``."""

from __future__ import annotations

import numpy as np
import torch

from . import _nvrtc

ITEMS = 2  # slots per thread per tile: ITEMS in routing_maps.cu
TILE_WARPS = 8  # warps per block of the multi-tile kernels, when shared memory allows
ONE_TILE_WARPS = 32  # a block of up to 1024 threads places up to 2048 slots in one launch
_DEFAULT_SHARED = 48 * 1024  # shared memory a block gets without opting in
_ID_TYPES = {torch.int32: "int", torch.int64: "long long"}


def _placing_shared_bytes(num_bins: int, warps: int) -> int:
    return 4 * num_bins * (1 + warps)  # cursor[num_bins] + warp_counts[warps][num_bins]


def max_num_experts(top_k: int, device: torch.device) -> int:
    """The largest ``num_experts`` these kernels route ``top_k`` slots per token to on
    ``device``: a placing block keeps ``E + K`` bins in shared memory, twice (cursor and one
    warp's counters, 4 bytes each), within the opt-in maximum (e.g. 227 KiB on an H100: 29056
    bins)."""
    return _nvrtc.max_shared_memory(device) // _placing_shared_bytes(1, 1) - top_k


def check_num_experts_supported(num_experts: int, top_k: int, device: torch.device) -> None:
    """Raise ``ValueError`` (before any launch) if the bins do not fit one block on ``device``."""
    most = max_num_experts(top_k, device)
    if num_experts > most:
        raise ValueError(
            f"num_experts={num_experts} with K={top_k}: the CuPy routing-maps kernels keep "
            f"E + K bin counters in shared memory, which on {device} holds E <= {most}; use "
            "backend='triton' or 'reference' for more experts"
        )


def _warps(num_bins: int, most: int) -> int:
    """Warps per placing block: as many as fit the default shared memory, up to ``most``; one
    with opt-in shared memory for very large E (:func:`check_num_experts_supported`)."""
    return max(1, min(most, _DEFAULT_SHARED // (4 * num_bins) - 1))


def routing_maps_cupy(
    topk_ids: torch.Tensor,
    num_experts: int,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Fill the four (preallocated) routing tables from ``topk_ids [T, K]``.

    Up to one block's worth of slots (``32 * ONE_TILE_WARPS * ITEMS``, fewer for large E) runs
    one launch; more run a histogram, a scan over tiles and a placement launch, on tiles of
    ``32 * TILE_WARPS * ITEMS`` slots (see ``routing_maps.cu``).
    """
    T, K = topk_ids.shape
    E = num_experts
    slots = T * K
    if slots == 0:
        offsets.zero_()
        return
    device = topk_ids.device
    num_bins = E + K
    idt = _ID_TYPES[topk_ids.dtype]
    problem = (np.int32(T), np.int32(K), np.int32(E), *_nvrtc.ints(*topk_ids.stride()))
    ptr = _nvrtc.ptr
    if slots <= 32 * ITEMS * _warps(num_bins, ONE_TILE_WARPS):
        threads = 32 * -(-slots // (32 * ITEMS))
        k = _nvrtc.kernel("routing_maps.cu", f"maps_one_tile<{idt}>", device.index)
        args = (ptr(topk_ids), ptr(src_to_dest), ptr(dest_to_src), ptr(expert_for_src),
                ptr(offsets), *problem)  # fmt: skip
        shared = _placing_shared_bytes(num_bins, threads // 32)
        _nvrtc.launch(k, device, (1,), (threads,), args, shared)
        return
    warps = _warps(num_bins, TILE_WARPS)
    tile = 32 * warps * ITEMS
    num_tiles = -(-slots // tile)
    scratch = torch.empty((2 * num_tiles + 1) * num_bins, dtype=torch.int32, device=device)
    tile_counts = scratch[: num_tiles * num_bins]
    tiles_before = scratch[num_tiles * num_bins : 2 * num_tiles * num_bins]
    totals = scratch[2 * num_tiles * num_bins :]
    threads = 32 * warps

    k = _nvrtc.kernel("routing_maps.cu", f"tile_histogram<{idt}>", device.index)
    args = (ptr(topk_ids), ptr(tile_counts), ptr(expert_for_src), *problem)
    _nvrtc.launch(k, device, (num_tiles,), (threads,), args, 4 * num_bins)

    k = _nvrtc.kernel("routing_maps.cu", "bin_scan", device.index)
    args = (ptr(tile_counts), ptr(tiles_before), ptr(totals), *_nvrtc.ints(num_tiles),
            np.int32(num_bins))  # fmt: skip
    _nvrtc.launch(k, device, (-(-num_bins // 32),), (32, 32), args)

    k = _nvrtc.kernel("routing_maps.cu", f"tile_place<{idt}>", device.index)
    args = (ptr(topk_ids), ptr(tiles_before), ptr(totals), ptr(src_to_dest), ptr(dest_to_src),
            ptr(offsets), *problem)  # fmt: skip
    _nvrtc.launch(k, device, (num_tiles,), (threads,), args,
                  _placing_shared_bytes(num_bins, warps))  # fmt: skip

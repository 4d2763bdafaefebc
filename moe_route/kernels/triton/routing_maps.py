"""Routing maps in Triton: per-tile histogram, scan, stable placement by an in-tile sort.

The trick that makes one mechanism handle both routed and dropped slots: every slot gets a
*bin*. A routed slot's bin is its expert ``e``; a dropped slot in column ``k`` gets the virtual
bin ``E + k``. Ordering all ``T*K`` slots by ``(bin, token-major index t*K + k)`` then gives
exactly the contract's permuted order: experts ascending, token then slot inside an expert, and
the dropped slots after every routed row sorted by ``(k, t)``, which is source-row order
``s = k*T + t``.

Small problems (one tile, the decode sizes) run :func:`_routing_maps_one_tile_kernel` in a
single launch: sorting the tile's keys *is* the permutation. Larger ones run three launches:

1. :func:`_tile_histogram_kernel` — program ``p`` counts the bins of tile ``p``;
2. :func:`_tile_scan_kernel` — one program scans the ``[tiles, bins]`` counts into each tile's
   base row per bin and the expert offsets;
3. :func:`_tile_place_kernel` — program ``p`` sorts its tile's keys; the ``j``-th sorted key
   lands at ``base[p, bin] + j``.

No atomics on the outputs, no host synchronisation, no dependence on the launch order of
programs: the maps are the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: sizes picked from a sweep on an H100 (bench/bench_routing.py --sweep): one tile covers
# the decode sizes in a single launch; larger inputs use 1024-slot tiles.
ONE_TILE_MAX = 2048
TILE = 1024


@triton.jit
def _load_bins(ids_ptr, stride_t, stride_k, tile, T, K, E, BLOCK: tl.constexpr):
    """Slots of one tile in token-major order ``i = t*K + k``, with their bins."""
    i = tile * BLOCK + tl.arange(0, BLOCK)
    valid = i < T * K
    t = i // K
    k = i - t * K
    ids = tl.load(ids_ptr + t.to(tl.int64) * stride_t + k * stride_k, mask=valid, other=-1)
    routed = (ids >= 0) & (ids < E)  # ids outside [-1, E) were rejected, or are treated as -1
    expert = tl.where(routed, ids, -1).to(tl.int32)
    bins = tl.where(routed, expert, E + k)
    return i, t, k, valid, routed, expert, bins


@triton.jit
def _routing_maps_one_tile_kernel(
    ids_ptr,
    src_to_dest_ptr,
    dest_to_src_ptr,
    expert_for_src_ptr,
    offsets_ptr,
    T,
    K,
    E,
    stride_t,
    stride_k,
    BLOCK: tl.constexpr,
    OFFSET_BINS: tl.constexpr,
):
    i, t, k, valid, routed, expert, bins = _load_bins(
        ids_ptr, stride_t, stride_k, 0, T, K, E, BLOCK
    )
    tl.store(expert_for_src_ptr + k * T + t, expert, mask=valid)

    # expert_first_token_offset: exclusive scan of the routed histogram.
    counts = tl.histogram(expert, OFFSET_BINS, mask=valid & routed)
    e = tl.arange(0, OFFSET_BINS)
    tl.store(offsets_ptr + e, (tl.cumsum(counts, 0) - counts).to(tl.int64), mask=e <= E)

    # Keys are unique, so the sort is total; padding sorts last.
    key = tl.where(valid, bins, E + K) * BLOCK + i
    key = tl.sort(key)
    dest = tl.arange(0, BLOCK)
    src_i = key % BLOCK
    src_t = src_i // K
    src = (src_i - src_t * K) * T + src_t
    placed = dest < T * K
    tl.store(dest_to_src_ptr + dest, src, mask=placed)
    tl.store(src_to_dest_ptr + src, dest, mask=placed)


@triton.jit
def _tile_histogram_kernel(
    ids_ptr,
    tile_counts_ptr,
    expert_for_src_ptr,
    T,
    K,
    E,
    stride_t,
    stride_k,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    tile = tl.program_id(0)
    _, t, k, valid, _, expert, bins = _load_bins(ids_ptr, stride_t, stride_k, tile, T, K, E, BLOCK)
    tl.store(expert_for_src_ptr + k * T + t, expert, mask=valid)
    counts = tl.histogram(bins, NUM_BINS, mask=valid)
    tl.store(tile_counts_ptr + tile * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit
def _tile_scan_kernel(
    tile_counts_ptr,
    tile_base_ptr,
    offsets_ptr,
    num_tiles,
    E,
    NUM_BINS: tl.constexpr,
    TILES_PER_STEP: tl.constexpr,
):
    """One program. ``tile_base[p, b]`` = first dest row of bin ``b`` in tile ``p`` minus the
    number of tile-``p`` slots in bins below ``b``, so that the ``j``-th sorted key of tile
    ``p`` lands at ``tile_base[p, bin] + j``."""
    b = tl.arange(0, NUM_BINS)
    r = tl.arange(0, TILES_PER_STEP)
    totals = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_tiles, TILES_PER_STEP):
        rows = start + r
        block = tl.load(
            tile_counts_ptr + rows[:, None] * NUM_BINS + b[None, :],
            mask=rows[:, None] < num_tiles,
            other=0,
        )
        totals += tl.sum(block, axis=0)
    bin_start = tl.cumsum(totals, 0) - totals
    # Bins E.. are the dropped slots: bin_start[E] is the number of routed rows.
    tl.store(offsets_ptr + b, bin_start.to(tl.int64), mask=b <= E)

    carry = bin_start
    for start in range(0, num_tiles, TILES_PER_STEP):
        rows = start + r
        in_range = rows[:, None] < num_tiles
        block = tl.load(
            tile_counts_ptr + rows[:, None] * NUM_BINS + b[None, :], mask=in_range, other=0
        )
        before_in_bin = tl.cumsum(block, 0) - block  # earlier tiles of this step, same bin
        before_in_tile = tl.cumsum(block, 1) - block  # lower bins, same tile
        base = carry[None, :] + before_in_bin - before_in_tile
        tl.store(tile_base_ptr + rows[:, None] * NUM_BINS + b[None, :], base, mask=in_range)
        carry += tl.sum(block, axis=0)


@triton.jit
def _tile_place_kernel(
    ids_ptr,
    tile_base_ptr,
    src_to_dest_ptr,
    dest_to_src_ptr,
    T,
    K,
    E,
    stride_t,
    stride_k,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    tile = tl.program_id(0)
    i, _, _, valid, _, _, bins = _load_bins(ids_ptr, stride_t, stride_k, tile, T, K, E, BLOCK)
    local = i - tile * BLOCK
    key = tl.sort(tl.where(valid, bins, E + K) * BLOCK + local)
    j = tl.arange(0, BLOCK)
    placed = tile * BLOCK + j < T * K
    bin_sorted = key // BLOCK
    src_i = tile * BLOCK + key % BLOCK
    src_t = src_i // K
    src = (src_i - src_t * K) * T + src_t
    base = tl.load(tile_base_ptr + tile * NUM_BINS + bin_sorted, mask=placed, other=0)
    dest = base + j
    tl.store(dest_to_src_ptr + dest, src, mask=placed)
    tl.store(src_to_dest_ptr + src, dest, mask=placed)


def routing_maps_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    src_to_dest: torch.Tensor,
    dest_to_src: torch.Tensor,
    expert_for_src: torch.Tensor,
    offsets: torch.Tensor,
    *,
    tile: int | None = None,
) -> None:
    """Fill the four (preallocated) routing tables from ``topk_ids [T, K]``.

    ``tile`` forces the tile size (a power of two; benchmarks sweep it); by default one tile
    covers up to ``ONE_TILE_MAX`` slots in a single launch, else ``TILE``-slot tiles.
    """
    T, K = topk_ids.shape
    E = num_experts
    N = T * K
    if N == 0:
        offsets.zero_()
        return
    st, sk = topk_ids.stride()
    if tile is None:
        tile = triton.next_power_of_2(N) if N <= ONE_TILE_MAX else TILE
    tile = max(tile, 16)
    if tile >= N:
        _routing_maps_one_tile_kernel[(1,)](
            topk_ids, src_to_dest, dest_to_src, expert_for_src, offsets,
            T, K, E, st, sk,
            BLOCK=tile, OFFSET_BINS=triton.next_power_of_2(E + 1),
            num_warps=4 if tile <= 1024 else 8,
        )  # fmt: skip
        return
    num_tiles = triton.cdiv(N, tile)
    num_bins = triton.next_power_of_2(E + K)
    tile_counts = torch.empty(num_tiles, num_bins, dtype=torch.int32, device=topk_ids.device)
    tile_base = torch.empty_like(tile_counts)
    warps = 4 if tile <= 1024 else 8
    _tile_histogram_kernel[(num_tiles,)](
        topk_ids, tile_counts, expert_for_src, T, K, E, st, sk,
        BLOCK=tile, NUM_BINS=num_bins, num_warps=warps,
    )  # fmt: skip
    _tile_scan_kernel[(1,)](
        tile_counts, tile_base, offsets, num_tiles, E,
        NUM_BINS=num_bins, TILES_PER_STEP=max(1, min(64, 8192 // num_bins)), num_warps=8,
    )  # fmt: skip
    _tile_place_kernel[(num_tiles,)](
        topk_ids, tile_base, src_to_dest, dest_to_src, T, K, E, st, sk,
        BLOCK=tile, NUM_BINS=num_bins, num_warps=warps,
    )  # fmt: skip

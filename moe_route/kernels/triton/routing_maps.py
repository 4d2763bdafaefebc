"""Routing maps in Triton: per-tile histogram, scan, stable placement by an in-tile sort.

The trick that makes one mechanism handle both routed and dropped slots: every slot gets a
*bin*. A routed slot's bin is its expert ``e``; a dropped slot in column ``k`` gets the virtual
bin ``E + k``. Ordering all ``T*K`` slots by ``(bin, token-major index t*K + k)`` then gives
exactly the contract's permuted order: experts ascending, token then slot inside an expert, and
the dropped slots after every routed row sorted by ``(k, t)``, which is source-row order
``s = k*T + t``.

Small problems (up to :data:`RANK_MAX` slots: decode and small prefill) run
:func:`_routing_maps_rank_kernel` in a single launch: a slot's row is the number of slots whose
key is smaller, which each program counts for its own slots against all of them (no sort: one
compiled variant serves every size). Larger ones run three launches, each fully parallel:

1. :func:`_tile_histogram_kernel` — program ``p`` counts the bins of tile ``p``;
2. :func:`_bin_scan_kernel` — program ``q`` scans a group of bins over the tiles;
3. :func:`_tile_place_kernel` — program ``p`` sorts its tile's keys; the ``j``-th sorted key
   lands at ``base[p, bin] + j``.

No atomics on the outputs, no host synchronisation, no dependence on the launch order of
programs: the maps are the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import LaunchKey, ThinKernel, cdiv, cuda_index, next_pow2, shared_memory_optin

#: Triton's cap on the elements of one tensor (``triton.language.TRITON_MAX_TENSOR_NUMEL``), on
#: a GPU and under the interpreter alike. A program holds one counter per *bin* — E experts, K
#: dropped-slot bins and the padding bin, rounded up to a power of two — so
#: ``next_power_of_2(E + K + 1)`` may not exceed it (2**20 experts failed with Triton's own
#: "numel exceeds triton maximum tensor numel").
MAX_TENSOR_BINS = 2**20
#: Shared memory per bin on a GPU: ``tl.histogram`` adds its warps' counts in a shared array of
#: one int32 per bin (Triton's HistogramOpToLLVM), and ``tl.gather`` / layout conversions of
#: the ``[bins]`` tensors stage them the same way (scratch buffers are reused, not summed). So a
#: device holds at most ``shared_memory_per_block_optin / 4`` bins: 2**15 on an A100 (163 KiB),
#: H100 or H200 (227 KiB), 2**14 on GPUs with 99 KiB. Derived from the lowering, not yet
#: measured at the limit (tests/test_gpu.py::test_maps_gpu_at_the_expert_limit does).
SHARED_BYTES_PER_BIN = 4


def max_bins(device: torch.device | str = "cpu") -> int:
    """Most bins (a power of two) one program of these kernels holds on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":  # the interpreter: only Triton's tensor cap
        return MAX_TENSOR_BINS
    fit = shared_memory_optin(cuda_index(device)) // SHARED_BYTES_PER_BIN
    return min(MAX_TENSOR_BINS, 1 << (fit.bit_length() - 1))


def max_num_experts(top_k: int, device: torch.device | str = "cpu") -> int:
    """The largest ``num_experts`` these kernels route ``top_k`` slots per token to."""
    return max_bins(device) - top_k - 1


def check_num_experts_supported(
    num_experts: int, top_k: int, device: torch.device | str = "cpu"
) -> None:
    """Raise ``ValueError`` (before any launch) if ``E + K + 1`` bins do not fit one program."""
    most = max_num_experts(top_k, device)
    if num_experts > most:
        raise ValueError(
            f"num_experts={num_experts} with K={top_k}: the Triton routing-maps kernels hold "
            f"E + K + 1 bin counters in one program, at most {max_bins(device)} on {device} "
            f"(so E <= {most}); use backend='reference' for more experts"
        )


# Up to RANK_MAX slots one launch ranks them (T*K comparisons per slot, spread over programs
# of RANK_ROWS slots); larger inputs sort many small tiles, an in-program sort of n keys costing
# ~n log² n (docs/decisions.md, "Routing-maps tiles" and "Cold start").
RANK_MAX = 1024
RANK_ROWS = 64
RANK_CHUNK = 128
TILE = 512


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


@triton.jit(do_not_specialize=["T"])
def _routing_maps_rank_kernel(
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
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    ALL: tl.constexpr,
    OFFSET_BINS: tl.constexpr,
):
    """Program ``p``: the rows of slots ``[p*ROWS, (p+1)*ROWS)``, each the number of slots
    whose ``(bin, i)`` is smaller (the keys are unique: the ranks are the permutation); program
    0 also the expert offsets, from one histogram of the ``T*K <= ALL`` slots."""
    p = tl.program_id(0)
    i, t, k, valid, _, expert, bins = _load_bins(ids_ptr, stride_t, stride_k, p, T, K, E, ROWS)
    tl.store(expert_for_src_ptr + k * T + t, expert, mask=valid)
    N = T * K
    dest = tl.zeros([ROWS], dtype=tl.int32)
    for c in range(0, tl.cdiv(N, CHUNK)):
        chunk = _load_bins(ids_ptr, stride_t, stride_k, c, T, K, E, CHUNK)
        j, valid_j, bins_j = chunk[0], chunk[3], chunk[6]
        before = (bins_j[None, :] < bins[:, None]) | (
            (bins_j[None, :] == bins[:, None]) & (j[None, :] < i[:, None])
        )
        dest += tl.sum((before & valid_j[None, :]).to(tl.int32), axis=1)
    src = k * T + t
    tl.store(dest_to_src_ptr + dest, src, mask=valid)
    tl.store(src_to_dest_ptr + src, dest, mask=valid)
    if p == 0:  # expert_first_token_offset: exclusive scan of the routed histogram
        every = _load_bins(ids_ptr, stride_t, stride_k, 0, T, K, E, ALL)
        counts = tl.histogram(every[5], OFFSET_BINS, mask=every[3] & every[4])
        e = tl.arange(0, OFFSET_BINS)
        tl.store(offsets_ptr + e, (tl.cumsum(counts, 0) - counts).to(tl.int64), mask=e <= E)


@triton.jit(do_not_specialize=["T"])
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
    """Program ``p``: ``tile_counts[p, b]`` = slots of tile ``p`` in bin ``b``."""
    tile = tl.program_id(0)
    _, t, k, valid, _, expert, bins = _load_bins(ids_ptr, stride_t, stride_k, tile, T, K, E, BLOCK)
    tl.store(expert_for_src_ptr + k * T + t, expert, mask=valid)
    counts = tl.histogram(bins, NUM_BINS, mask=valid)
    tl.store(tile_counts_ptr + tile * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit(do_not_specialize=["num_tiles"])
def _bin_scan_kernel(
    tile_counts_ptr,
    tiles_before_ptr,
    totals_ptr,
    num_tiles,
    NUM_BINS: tl.constexpr,
    BINS: tl.constexpr,
    TILES_PER_STEP: tl.constexpr,
):
    """Program ``q`` owns bins ``[q*BINS, (q+1)*BINS)``: for each, the exclusive prefix over
    tiles ``tiles_before[p, b]`` and the total ``totals[b]``."""
    b = tl.program_id(0) * BINS + tl.arange(0, BINS)
    r = tl.arange(0, TILES_PER_STEP)
    carry = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_tiles, TILES_PER_STEP):
        rows = start + r
        in_range = rows[:, None] < num_tiles
        where = rows[:, None] * NUM_BINS + b[None, :]
        block = tl.load(tile_counts_ptr + where, mask=in_range, other=0)
        tl.store(
            tiles_before_ptr + where, tl.cumsum(block, 0) - block + carry[None, :], mask=in_range
        )
        carry += tl.sum(block, axis=0)
    tl.store(totals_ptr + b, carry)


@triton.jit(do_not_specialize=["T"])
def _tile_place_kernel(
    ids_ptr,
    tile_counts_ptr,
    tiles_before_ptr,
    totals_ptr,
    src_to_dest_ptr,
    dest_to_src_ptr,
    offsets_ptr,
    T,
    K,
    E,
    stride_t,
    stride_k,
    BLOCK: tl.constexpr,
    NUM_BINS: tl.constexpr,
):
    """Program ``p`` sorts its tile's keys; the ``j``-th lands at ``base[bin] + j`` where
    ``base[b]`` = first dest row of bin ``b`` + slots of ``b`` in earlier tiles − slots of
    tile ``p`` in bins below ``b`` (those precede it in the sorted tile)."""
    tile = tl.program_id(0)
    i, _, _, valid, _, _, bins = _load_bins(ids_ptr, stride_t, stride_k, tile, T, K, E, BLOCK)
    b = tl.arange(0, NUM_BINS)
    totals = tl.load(totals_ptr + b)
    bin_start = tl.cumsum(totals, 0) - totals  # bin_start[E] = routed rows
    if tile == 0:
        tl.store(offsets_ptr + b, bin_start.to(tl.int64), mask=b <= E)
    row = tl.load(tile_counts_ptr + tile * NUM_BINS + b)
    base = bin_start + tl.load(tiles_before_ptr + tile * NUM_BINS + b) - (tl.cumsum(row, 0) - row)

    local = i - tile * BLOCK
    key = tl.sort(tl.where(valid, bins, E + K) * BLOCK + local)  # padding sorts last
    j = tl.arange(0, BLOCK)
    placed = tile * BLOCK + j < T * K
    dest = tl.gather(base, key // BLOCK, 0) + j
    src_i = tile * BLOCK + key % BLOCK
    src_t = src_i // K
    src = (src_i - src_t * K) * T + src_t
    tl.store(dest_to_src_ptr + dest, src, mask=placed)
    tl.store(src_to_dest_ptr + src, dest, mask=placed)


class MapsLaunch:
    """The maps' launches prepared from the ids' layout (dtype, strides, ``K``), ``E`` and the
    token bucket: what a call of :func:`routing_maps_triton` works out before launching, kept
    by :func:`moe_route.build_routing_maps`'s call memo for every later call of that
    signature. ``tile`` forces the tile size of the three launches (a power of two;
    benchmarks sweep it); by default the one rank launch takes up to ``RANK_MAX`` slots, more
    take ``TILE``-slot tiles. Which follows the token bucket (``T`` rounded up to a power of
    two), not ``T``: every ``T`` of a bucket runs the same kernels."""

    __slots__ = ("E", "K", "key", "num_bins", "rank", "rank_cx", "strides", "tile", "warps")

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, bucket: int, *,
                 tile: int | None = None):  # fmt: skip
        K, E = topk_ids.shape[1], num_experts
        self.rank = tile is None and bucket * K <= RANK_MAX
        self.tile = tile = max(tile or TILE, 16)
        self.K, self.E, self.strides = K, E, topk_ids.stride()
        self.key = LaunchKey((self.rank, tile, K, E, topk_ids.dtype, *self.strides))
        self.warps = 4 if tile <= 1024 else 8
        self.num_bins = next_pow2(E + K + 1)  # the padding bin E+K is gathered too
        self.rank_cx = dict(ROWS=RANK_ROWS, CHUNK=RANK_CHUNK, ALL=RANK_MAX,
                            OFFSET_BINS=next_pow2(E + 1), num_warps=4)  # fmt: skip

    def __call__(self, topk_ids, src_to_dest, dest_to_src, expert_for_src, offsets) -> None:
        T = topk_ids.shape[0]
        K, E, (st, sk), tile = self.K, self.E, self.strides, self.tile
        N = T * K
        if N == 0:
            offsets.zero_()
            return
        if self.rank:
            _RANK.launch(
                self.key, (cdiv(N, RANK_ROWS),),
                (topk_ids, src_to_dest, dest_to_src, expert_for_src, offsets, T, K, E, st, sk),
                self._rank_constexprs,
            )  # fmt: skip
            return
        num_tiles, num_bins, warps = cdiv(N, tile), self.num_bins, self.warps
        scratch = torch.empty(2 * num_tiles * num_bins + num_bins, dtype=torch.int32,
                              device=topk_ids.device)  # fmt: skip
        tile_counts = scratch[: num_tiles * num_bins].view(num_tiles, num_bins)
        tiles_before = scratch[num_tiles * num_bins : 2 * num_tiles * num_bins].view(
            num_tiles, num_bins
        )
        totals = scratch[2 * num_tiles * num_bins :]
        _HISTOGRAM.launch(
            self.key, (num_tiles,),
            (topk_ids, tile_counts, expert_for_src, T, K, E, st, sk),
            lambda: dict(BLOCK=tile, NUM_BINS=num_bins, num_warps=warps),
        )  # fmt: skip
        scan_bins = min(num_bins, 32)
        _SCAN.launch(
            num_bins, (num_bins // scan_bins,),
            (tile_counts, tiles_before, totals, num_tiles),
            lambda: dict(NUM_BINS=num_bins, BINS=scan_bins, TILES_PER_STEP=64, num_warps=4),
        )  # fmt: skip
        _PLACE.launch(
            self.key, (num_tiles,),
            (
                topk_ids, tile_counts, tiles_before, totals, src_to_dest, dest_to_src, offsets,
                T, K, E, st, sk,
            ),
            lambda: dict(BLOCK=tile, NUM_BINS=num_bins, num_warps=warps),
        )  # fmt: skip

    def _rank_constexprs(self) -> dict:
        return dict(self.rank_cx)


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
    """Fill the four (preallocated) routing tables from ``topk_ids [T, K]`` (see
    :class:`MapsLaunch` for ``tile``)."""
    launch = MapsLaunch(topk_ids, num_experts, next_pow2(topk_ids.shape[0]), tile=tile)
    launch(topk_ids, src_to_dest, dest_to_src, expert_for_src, offsets)


_RANK = ThinKernel(_routing_maps_rank_kernel)
_HISTOGRAM = ThinKernel(_tile_histogram_kernel)
_SCAN = ThinKernel(_bin_scan_kernel)
_PLACE = ThinKernel(_tile_place_kernel)

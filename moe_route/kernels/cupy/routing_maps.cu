// Routing maps in CUDA C: per-tile histogram, scan over tiles, stable placement.
//
// Every slot gets a bin: a routed slot's bin is its expert e, a dropped slot in column k gets
// the virtual bin E + k. Ordering the T*K slots by (bin, token-major index i = t*K + k) gives
// the contract's permuted order: experts ascending, token then slot inside an expert, dropped
// slots after every routed row in source-row order s = k*T + t. This is the order of
// moe_route/kernels/triton/routing_maps.py, so both produce the same bits.
//
// A block owns a tile of blockDim.x * ITEMS consecutive slots; in round r = 0..ITEMS-1 thread j
// holds slot first + r * blockDim.x + j (each round one coalesced row of the tile). One tile
// (up to 1024 threads: the decode sizes) runs maps_one_tile in a single launch; more run three
// launches:
//   tile_histogram  block p: tile_counts[p][b] = slots of tile p in bin b
//   bin_scan        per bin b: tiles_before[p][b] = slots of b in tiles < p, totals[b]
//   tile_place      block p: the first slot of bin b in tile p lands at
//                   bin_start[b] + tiles_before[p][b], the next ones after it in slot order
// Shared-memory integer atomics only count (the sum does not depend on their order) and
// nothing depends on the launch order of blocks: the maps are the same bits on every run.
//
// Slot indices are 32-bit (T*K < 2**31 is checked by the caller): a 64-bit division costs
// ~10x more, which shows at decode sizes where a few warps run every instruction back to back.

#include "common.cuh"

// NOTE: slots per thread per tile. Few rounds keep a block short (each round is two block
// barriers) and tiles small enough that large inputs spread over all SMs. On an H200 (E=256,
// K=8) 8 items per thread (2048-slot tiles) with 64-bit slot arithmetic ran the maps at half
// the speed of the Triton kernels; 2 items with 32-bit arithmetic at 1.0-1.44x their speed.
constexpr int ITEMS = 2;
constexpr unsigned FULL_WARP = 0xffffffffu;

// Bin of slot i (token-major) and its expert (-1 if dropped). Ids outside [-1, E) were either
// rejected by the caller or count as dropped: never an out-of-bounds write.
template <typename Id>
__device__ __forceinline__ int slot_bin(const Id* __restrict__ ids, int i, int K, int E,
                                        long long stride_t, long long stride_k, int* expert) {
    const int t = i / K;
    const int k = i - t * K;
    const Id id = ids[t * stride_t + k * stride_k];
    const bool routed = id >= 0 && id < E;
    *expert = routed ? static_cast<int>(id) : -1;
    return routed ? static_cast<int>(id) : E + k;
}

// This thread's bins of the tile starting at slot `first`; slots past the end get the padding
// bin num_bins, counted and placed nowhere. Also writes expert_for_src when it is given.
template <typename Id>
__device__ __forceinline__ void load_tile(const Id* __restrict__ ids, int first, int T, int K,
                                          int E, long long stride_t, long long stride_k,
                                          int (&bins)[ITEMS], int* __restrict__ expert_for_src) {
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const int i = first + r * blockDim.x + threadIdx.x;
        bins[r] = E + K;
        if (i < T * K) {
            int expert;
            bins[r] = slot_bin(ids, i, K, E, stride_t, stride_k, &expert);
            if (expert_for_src != nullptr) {
                const int t = i / K;
                expert_for_src[(i - t * K) * T + t] = expert;
            }
        }
    }
}

__device__ __forceinline__ void count_bins(const int (&bins)[ITEMS], int num_bins, int* hist) {
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        if (bins[r] < num_bins) atomicAdd(&hist[bins[r]], 1);
    }
}

__device__ __forceinline__ int warp_inclusive_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(FULL_WARP, v, d);
        if (lane >= d) v += u;
    }
    return v;
}

// In-place exclusive prefix sum of a[0..n) in shared memory, by the whole block: each thread
// owns a contiguous run of entries, the run sums are scanned across warps.
__device__ void block_exclusive_scan(int* a, int n) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int lo = smaller(static_cast<int>(threadIdx.x) * per, n);
    const int hi = smaller(lo + per, n);
    __syncthreads();  // a[] is complete
    int run = 0;
    for (int b = lo; b < hi; ++b) run += a[b];
    const int inclusive = warp_inclusive_scan(run);
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0;
        warp_sums[lane] = warp_inclusive_scan(v);
    }
    __syncthreads();
    int prefix = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - run;
    for (int b = lo; b < hi; ++b) {
        const int count = a[b];
        a[b] = prefix;
        prefix += count;
    }
    __syncthreads();
}

// Gives this thread's slots of the tile starting at `first` their dest rows and writes both
// maps. cursor[b] is the dest row of the next slot of bin b (advanced here); warp_counts is
// [num_warps][num_bins] of zeros (left zeroed). Per round: slots of the same bin are ranked
// inside a warp with __match_any_sync, then after the slots of that bin in lower warps.
__device__ void place_tile(const int (&bins)[ITEMS], int first, int T, int K, int num_bins,
                           int* cursor, int* warp_counts,
                           int* __restrict__ src_to_dest, int* __restrict__ dest_to_src) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
    for (int r = 0; r < ITEMS; ++r) {
        const int bin = bins[r];
        const bool placed = bin < num_bins;
        const unsigned peers = __match_any_sync(FULL_WARP, bin);
        const int rank = __popc(peers & lanes_below);
        const bool leader = rank == 0;  // lowest lane holding this bin in the warp
        if (placed && leader) warp_counts[warp * num_bins + bin] = __popc(peers);
        __syncthreads();
        if (placed) {
            int dest = cursor[bin] + rank;
            for (int w = 0; w < warp; ++w) dest += warp_counts[w * num_bins + bin];
            const int i = first + r * blockDim.x + threadIdx.x;
            const int t = i / K;
            const int s = (i - t * K) * T + t;
            src_to_dest[s] = dest;
            dest_to_src[dest] = s;
        }
        __syncthreads();
        if (placed && leader) {
            atomicAdd(&cursor[bin], __popc(peers));
            warp_counts[warp * num_bins + bin] = 0;
        }
        __syncwarp();  // the next round's leaders of this warp write warp_counts after the reset
    }
}

// Dynamic shared memory of the placing kernels: cursor[num_bins], warp_counts[warps][num_bins].
__device__ __forceinline__ void zero_shared(int* a, int n) {
    for (int b = threadIdx.x; b < n; b += blockDim.x) a[b] = 0;
}

template <typename Id>
__global__ void maps_one_tile(const Id* __restrict__ ids, int* __restrict__ src_to_dest,
                              int* __restrict__ dest_to_src, int* __restrict__ expert_for_src,
                              long long* __restrict__ offsets, int T, int K, int E,
                              long long stride_t, long long stride_k) {
    extern __shared__ int smem[];
    const int num_bins = E + K;
    int* cursor = smem;
    int* warp_counts = smem + num_bins;
    int bins[ITEMS];
    load_tile(ids, 0, T, K, E, stride_t, stride_k, bins, expert_for_src);
    zero_shared(smem, num_bins * (1 + (blockDim.x >> 5)));
    __syncthreads();
    count_bins(bins, num_bins, cursor);
    block_exclusive_scan(cursor, num_bins);  // cursor[b] = first dest row of bin b
    for (int b = threadIdx.x; b <= E; b += blockDim.x) offsets[b] = cursor[b];
    place_tile(bins, 0, T, K, num_bins, cursor, warp_counts, src_to_dest, dest_to_src);
}

template <typename Id>
__global__ void tile_histogram(const Id* __restrict__ ids, int* __restrict__ tile_counts,
                               int* __restrict__ expert_for_src, int T, int K, int E,
                               long long stride_t, long long stride_k) {
    extern __shared__ int hist[];
    const int num_bins = E + K;
    const int first = blockIdx.x * blockDim.x * ITEMS;
    int bins[ITEMS];
    load_tile(ids, first, T, K, E, stride_t, stride_k, bins, expert_for_src);
    zero_shared(hist, num_bins);
    __syncthreads();
    count_bins(bins, num_bins, hist);
    __syncthreads();
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
        tile_counts[blockIdx.x * static_cast<long long>(num_bins) + b] = hist[b];
    }
}

// Block of 32 x 32 threads for 32 bins: thread (x, y) sums bin x over the y-th chunk of tiles,
// warp y scans the 32 chunk sums of bin y, then thread (x, y) writes the running prefix of
// bin x for each tile of its chunk. Lanes read consecutive bins: coalesced.
__global__ void bin_scan(const int* __restrict__ tile_counts, int* __restrict__ tiles_before,
                         int* __restrict__ totals, long long num_tiles, int num_bins) {
    __shared__ int chunk_sums[32][33];  // [bin][chunk], padded against bank conflicts
    const int x = threadIdx.x;
    const int y = threadIdx.y;
    const int b = blockIdx.x * 32 + x;
    const long long per = (num_tiles + 31) / 32;
    const long long p0 = smaller(y * per, num_tiles);
    const long long p1 = smaller(p0 + per, num_tiles);
    int sum = 0;
    if (b < num_bins) {
        for (long long p = p0; p < p1; ++p) sum += tile_counts[p * num_bins + b];
    }
    chunk_sums[x][y] = sum;
    __syncthreads();
    const int v = chunk_sums[y][x];  // warp y, lane x: chunk x of bin blockIdx.x * 32 + y
    const int inclusive = warp_inclusive_scan(v);
    chunk_sums[y][x] = inclusive - v;
    if (x == 31 && blockIdx.x * 32 + y < num_bins) totals[blockIdx.x * 32 + y] = inclusive;
    __syncthreads();
    if (b >= num_bins) return;
    int prefix = chunk_sums[x][y];
    for (long long p = p0; p < p1; ++p) {
        const int count = tile_counts[p * num_bins + b];
        tiles_before[p * num_bins + b] = prefix;
        prefix += count;
    }
}

template <typename Id>
__global__ void tile_place(const Id* __restrict__ ids, const int* __restrict__ tiles_before,
                           const int* __restrict__ totals, int* __restrict__ src_to_dest,
                           int* __restrict__ dest_to_src, long long* __restrict__ offsets,
                           int T, int K, int E, long long stride_t, long long stride_k) {
    extern __shared__ int smem[];
    const int num_bins = E + K;
    int* cursor = smem;
    int* warp_counts = smem + num_bins;
    const int first = blockIdx.x * blockDim.x * ITEMS;
    int bins[ITEMS];
    load_tile(ids, first, T, K, E, stride_t, stride_k, bins, static_cast<int*>(nullptr));
    zero_shared(warp_counts, num_bins * (blockDim.x >> 5));
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) cursor[b] = totals[b];
    block_exclusive_scan(cursor, num_bins);  // cursor[b] = first dest row of bin b
    const int* before = tiles_before + blockIdx.x * static_cast<long long>(num_bins);
    for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
        if (blockIdx.x == 0 && b <= E) offsets[b] = cursor[b];
        cursor[b] += before[b];
    }
    __syncthreads();
    place_tile(bins, first, T, K, num_bins, cursor, warp_counts, src_to_dest, dest_to_src);
}

// Expand (permute) rows: x_perm[d] = x[t] for every dest row d of token t.
//
// Data flow, a scatter like the Triton kernel (moe_route/kernels/triton/expand.py): block
// (t, c) reads the units [c * blockDim.x, (c + 1) * blockDim.x) of token row x[t] once, one
// unit per thread, and writes that unit to the K dest rows src_to_dest[k * T + t]; dest rows
// of dropped slots (expert_for_src == -1) get zeros. Each dest row has exactly one writer
// (the maps are a permutation): no atomics.
//
// A "unit" V is what one thread moves: 16 bytes (Bytes16) when every row starts on a 16-byte
// boundary and the row length is a multiple of 16 bytes, else one element (2, 4 or 8 bytes,
// read through the column stride). Copying bits needs no dtype: zero bits are +0.0 in every
// float format.

#include "common.cuh"

// Dest rows of up to KCHUNK slots are loaded together, so their latencies overlap.
constexpr int KCHUNK = 8;

// K is a template parameter and indices are 32-bit, as in finalize.cu.
template <typename V, int K>
__global__ void expand_rows(const V* __restrict__ x, V* __restrict__ out,
                            const int* __restrict__ src_to_dest,
                            const int* __restrict__ expert_for_src, int T, int width, int x_row,
                            int x_col, int out_row, int out_col) {
    const int t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const V v = x[static_cast<long long>(t) * x_row + static_cast<long long>(c) * x_col];
    const V zero{};
    const long long column = static_cast<long long>(c) * out_col;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += KCHUNK) {
        int dest[KCHUNK];
        bool routed[KCHUNK];
#pragma unroll
        for (int j = 0; j < KCHUNK; ++j) {
            if (k0 + j < K) {
                const int s = (k0 + j) * T + t;
                dest[j] = src_to_dest[s];
                routed[j] = expert_for_src[s] >= 0;
            }
        }
#pragma unroll
        for (int j = 0; j < KCHUNK; ++j) {
            if (k0 + j < K) {
                out[static_cast<long long>(dest[j]) * out_row + column] = routed[j] ? v : zero;
            }
        }
    }
}

// finalizeMoeRouting, standalone path: out[t] = bias[t] + sum_k w[t, k] * y_perm[dest(k*T + t)].
//
// Data flow: block (t, b) serves token t. Its threads first read the token's slot tables once
// into shared memory (dest row, -1 for a dropped slot, and router weight); then every thread
// walks the units c = b * blockDim.x + threadIdx.x, c + gridDim.y * blockDim.x, ... of the output
// row, one unit of N elements at a time: N * sizeof(TY) = 16 bytes when the rows are 16-byte
// aligned (one 128-bit load per permuted row), else N = 1 read through the strides. For
// k = 0, 1, ..., K - 1 the thread reads row dest[k] of y_perm (KCHUNK rows in flight at once),
// multiplies it by w[t, k] and adds it to an Acc accumulator (float32, float64 when an input is
// float64), k ascending. Dropped slots are skipped: their rows and weights are never read, so
// nothing they hold (NaN included) reaches the output.
// bias ([H] or [T, H], optional) is added once after the sum and the result is rounded once.
//
// This is the arithmetic of moe_route/kernels/triton/finalize.py in the same order, each product
// and sum rounded separately (never fused): both kernels give the same bits. Every output
// element has one owner: no atomics, the same bits on every run.

#include "common.cuh"

// K is a template parameter (one instantiation per top-k, as the Triton kernel's K is a
// constexpr), so the slot loops unroll with no run-time guards; indices are 32-bit, with 64-bit
// products only for memory offsets. KCHUNK permuted rows are loaded together, so their
// latencies overlap; more rows in flight per thread cost registers, so fewer threads fit on an
// SM. The slot tables come from shared memory: no thread waits on a global load of them between
// its row loads, and the blocks of a token each read them once (finalize.py holds the measured
// launch settings).
template <typename TY, typename TW, typename TB, typename Acc, int N, int K, int KCHUNK>
__global__ void finalize_rows(const TY* __restrict__ y, const TW* __restrict__ w,
                              const int* __restrict__ src_to_dest,
                              const int* __restrict__ expert_for_src, const TB* __restrict__ bias,
                              TY* __restrict__ out, int T, int width, int y_row, int y_col,
                              int w_t, int w_k, int bias_t, int bias_col, int out_row,
                              int out_col) {
    const int t = blockIdx.x;
    __shared__ int slot_dest[K];
    __shared__ Acc slot_weight[K];
    for (int k = threadIdx.x; k < K; k += blockDim.x) {  // K may exceed the block
        const int s = k * T + t;
        const bool routed = expert_for_src[s] >= 0;
        slot_dest[k] = routed ? src_to_dest[s] : -1;
        slot_weight[k] =
            routed ? widen<Acc>(w[static_cast<long long>(t) * w_t + static_cast<long long>(k) * w_k])
                   : Acc{};
    }
    __syncthreads();
    const int* dest = slot_dest;  // read where used: shared-memory broadcasts, few registers
    const Acc* weight = slot_weight;
    const int step = gridDim.y * blockDim.x;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < width; c += step) {
        const long long h = static_cast<long long>(c) * N;  // first column of this unit
        Acc acc[N] = {};
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += KCHUNK) {
            Vec<TY, N> rows[KCHUNK];
#pragma unroll
            for (int j = 0; j < KCHUNK; ++j) {
                if (k0 + j < K && dest[k0 + j] >= 0) {
                    const TY* row = y + static_cast<long long>(dest[k0 + j]) * y_row + h * y_col;
                    rows[j] = *reinterpret_cast<const Vec<TY, N>*>(row);
                }
            }
#pragma unroll
            for (int j = 0; j < KCHUNK; ++j) {
                if (k0 + j >= K || dest[k0 + j] < 0) continue;
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    acc[i] = add_rn(acc[i], mul_rn(weight[k0 + j], widen<Acc>(rows[j].v[i])));
                }
            }
        }
        if (bias != nullptr) {
            const TB* row = bias + static_cast<long long>(t) * bias_t + h * bias_col;
            const Vec<TB, N> b = *reinterpret_cast<const Vec<TB, N>*>(row);
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] = add_rn(acc[i], widen<Acc>(b.v[i]));
        }
        Vec<TY, N> o;
#pragma unroll
        for (int i = 0; i < N; ++i) round_to(acc[i], o.v[i]);
        *reinterpret_cast<Vec<TY, N>*>(out + static_cast<long long>(t) * out_row + h * out_col) = o;
    }
}

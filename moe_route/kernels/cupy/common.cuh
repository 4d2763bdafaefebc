// Device code shared by the CuPy/NVRTC kernels: storage types, conversions, 16-byte vector IO,
// and float arithmetic that no compiler flag can change.
//
// NVRTC sees no system headers, so nothing here includes one. Two defaults would break the
// bit-for-bit agreement of finalize with the Triton kernel: CuPy compiles with -ftz=true
// (float32 subnormals flushed to zero) and NVRTC contracts a * b + c into one FMA. The float32
// products, sums and conversions below are therefore inline PTX with an explicit rounding
// mode (round to nearest even, subnormals kept, never fused).
#pragma once

// 16-bit floats travel as their bits; the kernels only widen them to float and round back.
struct bf16_t {
    unsigned short bits;
};
struct f16_t {
    unsigned short bits;
};

// ------------------------------------------------------------------------- widen (exact)
__device__ __forceinline__ float value(bf16_t v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}
__device__ __forceinline__ float value(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float value(float v) { return v; }
__device__ __forceinline__ double value(double v) { return v; }

__device__ __forceinline__ float as_acc(float v, float) { return v; }
__device__ __forceinline__ double as_acc(double v, double) { return v; }
__device__ __forceinline__ float as_acc(double v, float) {  // a float64 bias, float32 sums
    float f;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(v));
    return f;
}
__device__ __forceinline__ double as_acc(float v, double) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v));  // a cast would flush subnormals (-ftz)
    return d;
}

// The accumulator type Acc is float, or double when y_perm or the weights are double (the rule
// of the Triton kernel and the reference); widening is exact, except a double bias into float.
template <typename Acc, typename T>
__device__ __forceinline__ Acc widen(T v) {
    return as_acc(value(v), Acc{});
}

// ------------------------------------------------------------------------- round once
__device__ __forceinline__ void round_to(float v, float& out) { out = v; }
__device__ __forceinline__ void round_to(float v, f16_t& out) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
}
__device__ __forceinline__ void round_to(float v, bf16_t& out) {
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
#else  // the same bits (round to nearest even, NaN -> the canonical 0x7fff) in integer steps
    const unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out.bits = 0x7fff;
        return;
    }
    out.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
__device__ __forceinline__ void round_to(double v, double& out) { out = v; }
__device__ __forceinline__ void round_to(double v, float& out) {
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(out) : "d"(v));
}
// double -> 16-bit float with a single rounding: truncate to float, and set the lowest bit if
// anything was cut off ("round to odd"); float keeps 13+ more bits than bf16/fp16, so rounding
// that float to nearest even then gives the correctly rounded result of the double.
template <typename T>
__device__ __forceinline__ void round_to(double v, T& out) {
    float f;
    asm("cvt.rz.f32.f64 %0, %1;" : "=f"(f) : "d"(v));
    if (as_acc(f, 0.0) != v) f = __uint_as_float(__float_as_uint(f) | 1u);
    round_to(f, out);
}

// ------------------------------------------------------------------------- arithmetic
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename T>
__device__ __forceinline__ T smaller(T a, T b) {
    return a < b ? a : b;
}

// ------------------------------------------------------------------------- vectors
// 16 bytes moved by one 128-bit load or store (NVRTC's built-in vector types are not relied on).
struct alignas(16) Bytes16 {
    unsigned int word[4];
};

// N consecutive elements, aligned to their size up to 16 bytes: a load or a store of a 16-byte
// Vec is one 128-bit memory instruction (a 32-byte one, two). N = 1 is the scalar case.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
    T v[N];
};

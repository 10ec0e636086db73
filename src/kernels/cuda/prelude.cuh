// prelude.cuh: shared helpers for every CUDA kernel file.
//
// The Rust side prepends this text to each .cu file (source = prelude + "\n" + file) and
// compiles the result with NVRTC. No #include anywhere: the runtime machine may have only
// libnvrtc, no CUDA headers. Everything used here (__shfl_xor_sync, __uint_as_float, expf,
// ...) is an NVRTC builtin.
//
// Conventions shared by all kernels:
//   * f16 and bf16 values are stored as raw `unsigned short` bits.
//   * Activations are f32, row-major.
//   * Every kernel is extern "C" __global__ with plain pointer / int / float / long long
//     arguments; launch configurations are documented above each kernel.
//   * Helpers named block_* need blockDim.x to be a multiple of 32 (whole warps) and at most
//     1024, with every thread of the block calling them (they contain __syncthreads).

// ---------------------------------------------------------------------------------------
// f16 / bf16 conversions (bit patterns in unsigned short)
// ---------------------------------------------------------------------------------------

// IEEE half bits -> f32 (exact).
__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> IEEE half bits, round to nearest even (overflow -> inf, NaN stays NaN).
__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// bf16 bits -> f32 (exact): the bf16 bits are the high half of the f32.
__device__ __forceinline__ float bf16_to_float(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN. Same rule as the Rust
// `half` crate's bf16::from_f32.
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// ---------------------------------------------------------------------------------------
// Small numeric helpers
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ float neg_inf_f32() { return __int_as_float(0xff800000); }

// (float)q - k, exactly, for integers 0 <= q, k < 2^22, called as
// small_uint_to_float(q, MAGIC_2P23 + k), without an int->float conversion instruction:
// 0x4B000000 | q is the float 2^23 + q, and subtracting 2^23 + k is exact.
// (Conversions run at quarter rate; this is one logic op and one FADD.)
#define MAGIC_2P23 8388608.0f
__device__ __forceinline__ float small_uint_to_float(unsigned int q, float bias) {
    return __uint_as_float(0x4B000000u | q) - bias;
}

// Little-endian loads of 16 / 32 bits from a byte pointer that is only 2-byte aligned.
__device__ __forceinline__ unsigned int load_u16(const unsigned char* p) {
    return (unsigned int)(*(const unsigned short*)p);
}
__device__ __forceinline__ unsigned int load_u32_a2(const unsigned char* p) {
    const unsigned short* s = (const unsigned short*)p;
    return (unsigned int)s[0] | ((unsigned int)s[1] << 16);
}

// ---------------------------------------------------------------------------------------
// Warp and block reductions
// ---------------------------------------------------------------------------------------

// Sum / max over the 32 lanes of a warp; every lane gets the result. All 32 lanes must call.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum / max over the whole block; every thread gets the result. `scratch` is a __shared__
// array of at least 32 floats. blockDim.x must be a multiple of 32 (<= 1024) and every thread
// must call. Starts with a __syncthreads, so the same scratch may be reused by consecutive
// calls, and any shared-memory writes made before the call are visible after it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? scratch[lane] : neg_inf_f32();
    return warp_max(v);
}

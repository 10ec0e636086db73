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

// ---------------------------------------------------------------------------------------
// Tensor-core product of one warp: m16n8k16, f16 operands, f32 accumulation
// ---------------------------------------------------------------------------------------

// d (4 floats) += A (16 x 16) * B (16 x 8), every lane of the warp calling, in the fragment
// layout of PTX's mma.m16n8k16 (g = lane / 4, t = lane % 4; each register two f16 values,
// the lower index in the low half):
//   a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]    d[2], d[3] = D[g+8][2t, 2t+1]
// On sm_80 and later it is one mma.sync instruction; elsewhere (and on the CPU emulator) the
// same sums from the other lanes' registers by shuffles.
__device__ __forceinline__ void mma_16816(float* d, const unsigned int* a, const unsigned int* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
    for (int k = 0; k < 16; k++) {
        const int hi = k >= 8 ? 1 : 0;       // which register pair holds column k
        const int src = (k & 7) >> 1;        // the t of the lanes holding column / row k
        const int shift = (k & 1) * 16;      // which half
        // A[g][k] and A[g+8][k], from lane g * 4 + src.
        const unsigned int top = __shfl_sync(0xffffffffu, a[2 * hi], g * 4 + src);
        const unsigned int bottom = __shfl_sync(0xffffffffu, a[2 * hi + 1], g * 4 + src);
        // B[k][2t] and B[k][2t+1], from lanes (2t) * 4 + src and (2t + 1) * 4 + src.
        const unsigned int left = __shfl_sync(0xffffffffu, b[hi], (2 * t) * 4 + src);
        const unsigned int right = __shfl_sync(0xffffffffu, b[hi], (2 * t + 1) * 4 + src);
        const float a0 = half_to_float((unsigned short)(top >> shift));
        const float a1 = half_to_float((unsigned short)(bottom >> shift));
        const float b0 = half_to_float((unsigned short)(left >> shift));
        const float b1 = half_to_float((unsigned short)(right >> shift));
        d[0] = fmaf(a0, b0, d[0]);
        d[1] = fmaf(a0, b1, d[1]);
        d[2] = fmaf(a1, b0, d[2]);
        d[3] = fmaf(a1, b1, d[3]);
    }
#endif
}

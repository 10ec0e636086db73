// ops.cu: element-wise and per-row operations on f32 activations (row-major).
// Compiled as prelude.cuh + "\n" + this file.
//
// Element-wise kernels below use a grid-stride loop, so any grid size >= 1 is correct; the
// suggested launch is block = 256 threads, grid = min(ceil(n / 256), 65535) (or larger: the
// grid-stride loop makes every choice correct, gridDim.x up to 2^31 - 1).

// The fast path of rms_norm and add_rms_norm: a thread's values of the row kept in registers
// as float4s, each input's loads all issued before any is used. The strided loop of the
// general path waits for one load a pass (it stores x between loads, which it may not
// reorder): a 4096-wide row on 256 threads took sixteen round trips to memory, then sixteen
// more for w.
#define NORM_VEC 8

// Whether a row takes the fast path: cols a multiple of 4, at most 4 * NORM_VEC per thread,
// every pointer 16-byte aligned (uniform over the CTA).
__device__ __forceinline__ bool norm_vec_path(int cols, const void* a, const void* b,
                                              const void* c, const void* d) {
    const unsigned long long bits = (unsigned long long)a | (unsigned long long)b |
                                    (unsigned long long)c | (unsigned long long)d;
    return (cols & 3) == 0 && cols <= 4 * NORM_VEC * (int)blockDim.x && (bits & 15) == 0;
}

// One row: v = xr (+ ar when ar != nullptr, then written back to sum_to when that is not
// nullptr), outr = v / sqrt(mean(v^2) + eps) * w.
__device__ __forceinline__ void rms_norm_row_vec(const float* xr, const float* ar, float* sum_to,
                                                 const float* w, float* outr, int cols,
                                                 float eps, float* scratch) {
    const int n4 = cols >> 2;
    float4 v[NORM_VEC], a[NORM_VEC];
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            v[k] = ((const float4*)xr)[i];
            if (ar != nullptr) a[k] = ((const float4*)ar)[i];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            if (ar != nullptr) {
                v[k] = make_float4(v[k].x + a[k].x, v[k].y + a[k].y, v[k].z + a[k].z,
                                   v[k].w + a[k].w);
                if (sum_to != nullptr) ((float4*)sum_to)[i] = v[k];
            }
            ss = fmaf(v[k].x, v[k].x, ss);
            ss = fmaf(v[k].y, v[k].y, ss);
            ss = fmaf(v[k].z, v[k].z, ss);
            ss = fmaf(v[k].w, v[k].w, ss);
        }
    }
    ss = block_sum(ss, scratch);
    const float rms = sqrtf(ss / (float)cols + eps);
    float4 wv[NORM_VEC];
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) wv[k] = ((const float4*)w)[i];
    }
#pragma unroll
    for (int k = 0; k < NORM_VEC; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            ((float4*)outr)[i] = make_float4(v[k].x / rms * wv[k].x, v[k].y / rms * wv[k].y,
                                             v[k].z / rms * wv[k].z, v[k].w / rms * wv[k].w);
        }
    }
}

// rms_norm
// Launch: grid = (rows, 1, 1), block = (T, 1, 1) with T a multiple of 32, 32 <= T <= 1024
//         (256 suggested; 32..128 for small cols such as a per-head q/k norm with
//         cols = head_dim), dynamic shared memory = 0.
// Computes, for row r = blockIdx.x (x, out are [rows, cols], w is [cols]):
//   ms = sum_c x[r, c]^2 / cols   (f32, threads' partial sums combined by a tree)
//   rms = sqrtf(ms + eps)
//   out[r, c] = x[r, c] / rms * w[c]
// (the same form as the CPU engine's rms_norm; = x * rsqrt(ms + eps) * w up to rounding).
// In place (out == x) is allowed: each element is read and written by the same thread, and
// all reads for the sum finish before any write.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int cols,
                                    float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * cols;
    const float* xr = x + base;
    float* outr = out + base;
    if (norm_vec_path(cols, xr, w, outr, xr)) {
        rms_norm_row_vec(xr, nullptr, nullptr, w, outr, cols, eps, scratch);
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = xr[c];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float rms = sqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        outr[c] = xr[c] / rms * w[c];
    }
}

// add_rms_norm
// Launch: grid = (rows, 1, 1), block = (T, 1, 1) with T a multiple of 32, 32 <= T <= 1024
//         (256 suggested), dynamic shared memory = 0.
// Computes, for row r = blockIdx.x (x, add, out are [rows, cols], w is [cols]):
//   if add != nullptr: x[r, c] += add[r, c] for all c (the updated row is written back to x);
//   then out[r, :] = rms_norm(x[r, :]) exactly as the rms_norm kernel above.
// out must not overlap add; out == x is allowed (then x ends up normalised).
extern "C" __global__ void add_rms_norm(float* x, const float* add, const float* w, float* out,
                                        int cols, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * cols;
    float* xr = x + base;
    float* outr = out + base;
    const float* ar = add != nullptr ? add + base : nullptr;
    if (norm_vec_path(cols, xr, ar, w, outr)) {
        rms_norm_row_vec(xr, ar, xr, w, outr, cols, eps, scratch);
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = xr[c];
        if (add != nullptr) {
            v += add[base + c];
            xr[c] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float rms = sqrtf(ss / (float)cols + eps);
    // Same thread, same element as in the first loop: reads its own write.
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        outr[c] = xr[c] / rms * w[c];
    }
}

// add_in_place
// Launch: element-wise (see top of file), n = number of elements (64-bit).
// Computes x[i] += y[i] for 0 <= i < n.
extern "C" __global__ void add_in_place(float* x, const float* y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] += y[i];
    }
}

// add_bias
// Launch: element-wise (see top of file), n = rows * cols.
// Computes y[r, c] += b[c] for r < rows, c < cols (y is [rows, cols], b is [cols]).
extern "C" __global__ void add_bias(float* y, const float* b, int rows, int cols) {
    const long long n = (long long)rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] += b[i % cols];
    }
}

// silu_mul
// Launch: element-wise (see top of file), n = rows * width.
// Computes, for r < rows, i < width:
//   g = gate[r * gate_stride + i], u = up[r * up_stride + i]
//   out[r * width + i] = g / (1 + expf(-g)) * u
// (gate and up may be two column ranges of one fused [rows, 2*width] buffer: pass pointers
// offset to the first column of each and the buffer's row stride; every access is a scalar
// f32 one, so such an offset needs no alignment beyond 4 bytes.) out must not overlap
// gate/up unless it is exactly one of them with the same stride == width.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, int rows,
                                    int width, int gate_stride, int up_stride) {
    const long long n = (long long)rows * width;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long r = i / width;
        const long long c = i - r * width;
        const float g = gate[r * gate_stride + c];
        const float u = up[r * up_stride + c];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

// rotary
// Launch: element-wise over n = tokens * heads * (head_dim / 2) rotation pairs (see top of
//         file: block 256, grid = min(ceil(n / 256), 65535); grid-stride loop).
// x is [tokens, heads, head_dim] (in place), head_dim even, inv_freq is [head_dim / 2],
// positions is [tokens]. For token t, head h, i < head_dim / 2:
//   angle = (float)positions[t] * inv_freq[i]        (f32; sincosf = full-precision
//                                                     cosf/sinf, not the fast intrinsics)
//   neox == 0: pair (a, b) = (x[t, h, 2i], x[t, h, 2i + 1])
//   neox != 0: pair (a, b) = (x[t, h, i],  x[t, h, i + head_dim / 2])
//   (a, b) <- (a cos - b sin, a sin + b cos)
extern "C" __global__ void rotary(float* x, const unsigned int* positions, const float* inv_freq,
                                  int tokens, int heads, int head_dim, int neox) {
    const int half = head_dim / 2;
    const long long n = (long long)tokens * heads * half;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += stride) {
        const long long th = idx / half;        // t * heads + h
        const int i = (int)(idx - th * half);   // pair index
        const long long t = th / heads;
        const float angle = (float)positions[t] * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);  // full-precision sinf / cosf (not __sinf / __cosf)
        float* head = x + th * head_dim;
        const int ia = neox ? i : 2 * i;
        const int ib = neox ? i + half : 2 * i + 1;
        const float a = head[ia];
        const float b = head[ib];
        head[ia] = a * c - b * s;
        head[ib] = a * s + b * c;
    }
}

// copy_columns
// Launch: element-wise (see top of file), n = rows * width.
// Computes dst[r * width + c] = src[r * src_stride + src_offset + c] for r < rows, c < width
// (dst is a dense [rows, width] matrix; e.g. splitting a fused q/k/v projection output).
extern "C" __global__ void copy_columns(const float* src, float* dst, int rows, int src_stride,
                                        int src_offset, int width) {
    const long long n = (long long)rows * width;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long r = i / width;
        const long long c = i - r * width;
        dst[i] = src[r * src_stride + src_offset + c];
    }
}

// gather_rows
// Launch: element-wise (see top of file), n = n_rows * width.
// Computes dst[i * width + c] = src[rows[i] * width + c] for i < n_rows, c < width
// (src is [_, width], every rows[i] a valid row of it; dst is a dense [n_rows, width] matrix;
// e.g. picking the hidden states of some tokens). dst must not overlap src.
extern "C" __global__ void gather_rows(const float* src, const unsigned int* rows, float* dst,
                                       int n_rows, int width) {
    const long long n = (long long)n_rows * width;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long r = i / width;
        const long long c = i - r * width;
        dst[i] = src[(long long)rows[r] * width + c];
    }
}

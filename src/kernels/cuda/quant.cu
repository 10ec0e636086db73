// quant.cu: dequantization and matrix-vector products for the GGML weight formats.
// Compiled as prelude.cuh + "\n" + this file.
//
// Weights are raw GGML blocks exactly as stored in GGUF: a [rows, cols] matrix is row-major,
// each row cols / QK consecutive blocks (little endian):
//   q4_0  32 values, 18 bytes: f16 d; u8 qs[16]
//         value j < 16 = ((qs[j] & 0xF) - 8) * d, value j + 16 = ((qs[j] >> 4) - 8) * d
//   q4_1  32 values, 20 bytes: f16 d; f16 m; u8 qs[16]; value = nibble * d + m (same order)
//   q5_0  32 values, 22 bytes: f16 d; u8 qh[4] (little-endian u32); u8 qs[16]
//         value j < 16 = ((qs[j] & 0xF) | (bit j of qh) << 4) - 16) * d,
//         value j + 16 = ((qs[j] >> 4) | (bit j + 16 of qh) << 4) - 16) * d
//   q8_0  32 values, 34 bytes: f16 d; i8 qs[32]; value = qs[j] * d
//   q4_k  256 values, 144 bytes: f16 d; f16 dmin; u8 scales[12]; u8 qs[128]
//         (ggml get_scale_min_k4 for the 6-bit scale / min of the 8 sub-blocks of 32; 64-value
//         chunk c uses qs[32c..32c+32]: low nibbles -> sub-block 2c, high -> 2c + 1;
//         value = d * sc * q - dmin * m)
//   q6_k  256 values, 210 bytes: u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d
//         (ggml dequantize_row_q6_K)
//   f32, f16, bf16: plain row-major values.
//
// Requirements shared by all kernels here (the Rust side must assert them):
//   * cols % QK == 0 for the quantized formats (QK = 32, or 256 for q4_k / q6_k).
//   * w, x, out and y are 16-byte aligned (any cudaMalloc'd pointer; an offset into a buffer
//     must be a multiple of 16 bytes).
//   * Dense formats (f32, f16, bf16) accept any cols; cols % 16 == 0 takes the vectorised path,
//     other widths a simple scalar path.
//
// Implementation: each format defines "units" of 16 values of one block; a unit is decoded
// by one thread (Fmt::unit below) into two runs of 8 consecutive columns. The same unit code
// serves dequant_rows_*, dequant_f16_* and matvec_*, so the dequant kernels test the matvec's
// decoding too.

#define MAX_MATVEC_BATCH 8  // matvec_* support batch 1..=MAX_MATVEC_BATCH
#define MV_ROWS 4           // output rows per CTA of matvec_*

// ---------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------
// Each format struct has:
//   QK     values per block
//   BYTES  bytes per block
//   UNITS  units (of 16 values) per block, UNITS * 16 == QK
//   DENSE  true for f32 / f16 / bf16 (ESIZE = bytes per value), false for quantized
//   AFFINE true when values carry an offset (q4_1, q4_k)
//   unit(bp, u, q, a0, a1, b0, b1, c0, c1): decodes unit u (0 <= u < UNITS) of the block at
//       bp into two runs of 8 values: value i of run k (k = 0, 1) is a_k * q[8k + i] + b_k
//       (b_k == 0 when !AFFINE), at column c_k + i of the block (c0, c1 multiples of 8).
//       q holds the raw quantized integers (offset already removed) as exact floats, or the
//       values themselves for dense formats (a = 1, b = 0).
//   elem(row, c) (dense only): value c of a row starting at byte pointer row.

// Byte k (0..3) of a little-endian word.
__device__ __forceinline__ unsigned int byte_of(unsigned int w, int k) { return (w >> (8 * k)) & 0xffu; }

// The 4 bytes of w as exact floats minus k: out[i] = (float)byte_i(w) - k, called with
// bias = MAGIC_2P23 + k (0 <= k < 2^22). __byte_perm builds the word 0x4B0000bb = the float
// 2^23 + bb, so this is one PRMT and one FADD per value (no int->float conversion).
__device__ __forceinline__ void bytes_to_floats(unsigned int w, float bias, float* out) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[i] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | (unsigned int)i)) - bias;
    }
}

// Bits 0..3 of t moved to bit 4 of bytes 0..3 (the four shifted copies t << 4, t << 11,
// t << 18, t << 25 do not overlap, so the product has no carries).
__device__ __forceinline__ unsigned int spread_bits_to_bit4(unsigned int t) {
    return (t * 0x02040810u) & 0x10101010u;
}

#define LOW_NIBBLES(w) ((w) & 0x0F0F0F0Fu)
#define HIGH_NIBBLES(w) (((w) >> 4) & 0x0F0F0F0Fu)

struct FmtQ4_0 {
    static constexpr int QK = 32, BYTES = 18, UNITS = 2, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = false;
    // Unit u: qs[8u .. 8u + 8]; low nibbles -> columns 8u + i, high -> 16 + 8u + i;
    // value = (nibble - 8) * d.
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const float d = half_to_float((unsigned short)load_u16(bp));
        const unsigned int w0 = load_u32_a2(bp + 2 + 8 * u);
        const unsigned int w1 = load_u32_a2(bp + 6 + 8 * u);
        bytes_to_floats(LOW_NIBBLES(w0), MAGIC_2P23 + 8.0f, q);
        bytes_to_floats(LOW_NIBBLES(w1), MAGIC_2P23 + 8.0f, q + 4);
        bytes_to_floats(HIGH_NIBBLES(w0), MAGIC_2P23 + 8.0f, q + 8);
        bytes_to_floats(HIGH_NIBBLES(w1), MAGIC_2P23 + 8.0f, q + 12);
        a0 = a1 = d;
        b0 = b1 = 0.0f;
        c0 = 8 * u;
        c1 = 16 + 8 * u;
    }
};

struct FmtQ4_1 {
    static constexpr int QK = 32, BYTES = 20, UNITS = 2, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = true;
    // Unit u: qs[8u .. 8u + 8]; low nibbles -> columns 8u + i, high -> 16 + 8u + i;
    // value = nibble * d + m.
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const unsigned int dm = *(const unsigned int*)bp;  // 4-byte aligned (20-byte blocks)
        const float d = half_to_float((unsigned short)(dm & 0xffffu));
        const float m = half_to_float((unsigned short)(dm >> 16));
        const unsigned int w0 = *(const unsigned int*)(bp + 4 + 8 * u);
        const unsigned int w1 = *(const unsigned int*)(bp + 8 + 8 * u);
        bytes_to_floats(LOW_NIBBLES(w0), MAGIC_2P23, q);
        bytes_to_floats(LOW_NIBBLES(w1), MAGIC_2P23, q + 4);
        bytes_to_floats(HIGH_NIBBLES(w0), MAGIC_2P23, q + 8);
        bytes_to_floats(HIGH_NIBBLES(w1), MAGIC_2P23, q + 12);
        a0 = a1 = d;
        b0 = b1 = m;
        c0 = 8 * u;
        c1 = 16 + 8 * u;
    }
};

struct FmtQ5_0 {
    static constexpr int QK = 32, BYTES = 22, UNITS = 2, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = false;
    // Unit u: qs[8u .. 8u + 8]; value j = 8u + i is (low nibble | bit j of qh << 4) - 16 at
    // column j, value j + 16 is (high nibble | bit j + 16 of qh << 4) - 16 at column j + 16;
    // times d.
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const float d = half_to_float((unsigned short)load_u16(bp));
        const unsigned int qh = load_u32_a2(bp + 2);
        const unsigned int w0 = load_u32_a2(bp + 6 + 8 * u);
        const unsigned int w1 = load_u32_a2(bp + 10 + 8 * u);
        const int j0 = 8 * u;
        bytes_to_floats(LOW_NIBBLES(w0) | spread_bits_to_bit4((qh >> j0) & 0xFu),
                        MAGIC_2P23 + 16.0f, q);
        bytes_to_floats(LOW_NIBBLES(w1) | spread_bits_to_bit4((qh >> (j0 + 4)) & 0xFu),
                        MAGIC_2P23 + 16.0f, q + 4);
        bytes_to_floats(HIGH_NIBBLES(w0) | spread_bits_to_bit4((qh >> (j0 + 16)) & 0xFu),
                        MAGIC_2P23 + 16.0f, q + 8);
        bytes_to_floats(HIGH_NIBBLES(w1) | spread_bits_to_bit4((qh >> (j0 + 20)) & 0xFu),
                        MAGIC_2P23 + 16.0f, q + 12);
        a0 = a1 = d;
        b0 = b1 = 0.0f;
        c0 = 8 * u;
        c1 = 16 + 8 * u;
    }
};

struct FmtQ8_0 {
    static constexpr int QK = 32, BYTES = 34, UNITS = 2, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = false;
    // Unit u: qs[16u .. 16u + 16] -> columns 16u + i; value = qs * d.
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const float d = half_to_float((unsigned short)load_u16(bp));
        const unsigned char* qs = bp + 2 + 16 * u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            // int8 b as (b ^ 0x80) - 128, exactly.
            bytes_to_floats(load_u32_a2(qs + 4 * k) ^ 0x80808080u, MAGIC_2P23 + 128.0f, q + 4 * k);
        }
        a0 = a1 = d;
        b0 = b1 = 0.0f;
        c0 = 16 * u;
        c1 = 16 * u + 8;
    }
};

struct FmtQ4_K {
    static constexpr int QK = 256, BYTES = 144, UNITS = 16, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = true;
    // Unit u: chunk c = u / 4, bytes qs[32c + 8(u % 4) .. + 8] (= qs[8u .. 8u + 8]);
    // low nibbles -> columns 64c + 8(u % 4) + i (sub-block 2c), high nibbles -> 32 columns
    // further (sub-block 2c + 1); value = d * sc * nibble - dmin * m of the sub-block.
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const uint4 hdr = *(const uint4*)bp;  // d, dmin, scales[0..12]; blocks are 16-byte aligned
        const uint2 qv = *(const uint2*)(bp + 16 + 8 * u);
        const int c = u >> 2;
        // get_scale_min_k4 for four sub-blocks at a time: byte j of (scw, mw) for j < 4, or
        // byte j - 4 for j >= 4.
        unsigned int scw, mw;
        if (c < 2) {  // sub-blocks 0..3
            scw = hdr.y & 0x3f3f3f3fu;  // q[j] & 63
            mw = hdr.z & 0x3f3f3f3fu;   // q[j + 4] & 63
        } else {      // sub-blocks 4..7
            // (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
            scw = (hdr.w & 0x0f0f0f0fu) | ((hdr.y >> 2) & 0x30303030u);
            // (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
            mw = ((hdr.w >> 4) & 0x0f0f0f0fu) | ((hdr.z >> 2) & 0x30303030u);
        }
        const int k0 = 2 * (c & 1);  // byte of sub-block 2c in the words; 2c + 1 is k0 + 1
        const float d = half_to_float((unsigned short)(hdr.x & 0xffffu));
        const float dmin = half_to_float((unsigned short)(hdr.x >> 16));
        a0 = d * (float)byte_of(scw, k0);
        b0 = -(dmin * (float)byte_of(mw, k0));
        a1 = d * (float)byte_of(scw, k0 + 1);
        b1 = -(dmin * (float)byte_of(mw, k0 + 1));
        bytes_to_floats(LOW_NIBBLES(qv.x), MAGIC_2P23, q);
        bytes_to_floats(LOW_NIBBLES(qv.y), MAGIC_2P23, q + 4);
        bytes_to_floats(HIGH_NIBBLES(qv.x), MAGIC_2P23, q + 8);
        bytes_to_floats(HIGH_NIBBLES(qv.y), MAGIC_2P23, q + 12);
        c0 = 64 * c + 8 * (u & 3);
        c1 = c0 + 32;
    }
};

struct FmtQ6_K {
    static constexpr int QK = 256, BYTES = 210, UNITS = 16, ESIZE = 0;
    static constexpr bool DENSE = false, AFFINE = false;
    // Unit u: half n = u / 8, kp = (u / 4) % 2, l0 = 8 (u % 4). For l = l0 + i (i < 8), in
    // ggml's dequantize_row_q6_K terms (ql, qh, sc already advanced to half n):
    //   kp = 0: q1 (ql[l] low nibble, qh[l] bits 0-1, sc[is])     -> column 128n + l
    //           q3 (ql[l] high nibble, qh[l] bits 4-5, sc[is + 4]) -> column 128n + l + 64
    //   kp = 1: q2 (ql[l+32] low, qh[l] bits 2-3, sc[is + 2])      -> column 128n + l + 32
    //           q4 (ql[l+32] high, qh[l] bits 6-7, sc[is + 6])     -> column 128n + l + 96
    // with is = l / 16 = l0 / 16 (the same for all 8 values); value = d * sc * (q - 32).
    static __device__ __forceinline__ void unit(const unsigned char* bp, int u, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const int n = u >> 3;
        const int kp = (u >> 2) & 1;
        const int l0 = (u & 3) * 8;
        const unsigned char* ql = bp + 64 * n + 32 * kp + l0;
        const unsigned char* qh = bp + 128 + 32 * n + l0;
        const signed char* sc = (const signed char*)(bp + 192) + 8 * n + (l0 >> 4) + 2 * kp;
        const float d = half_to_float((unsigned short)load_u16(bp + 208));
        const int sh = 2 * kp;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const unsigned int lw = load_u32_a2(ql + 4 * k);
            const unsigned int hw = load_u32_a2(qh + 4 * k);
            const unsigned int lo = LOW_NIBBLES(lw) | (((hw >> sh) & 0x03030303u) << 4);
            const unsigned int hi = HIGH_NIBBLES(lw) | (((hw >> (sh + 4)) & 0x03030303u) << 4);
            bytes_to_floats(lo, MAGIC_2P23 + 32.0f, q + 4 * k);
            bytes_to_floats(hi, MAGIC_2P23 + 32.0f, q + 8 + 4 * k);
        }
        a0 = d * (float)sc[0];
        a1 = d * (float)sc[4];
        b0 = b1 = 0.0f;
        c0 = 128 * n + 32 * kp + l0;
        c1 = c0 + 64;
    }
};

struct FmtF32 {
    static constexpr int QK = 16, BYTES = 64, UNITS = 1, ESIZE = 4;
    static constexpr bool DENSE = true, AFFINE = false;
    static __device__ __forceinline__ void unit(const unsigned char* bp, int, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const float4* p = (const float4*)bp;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float4 f = p[k];
            q[4 * k] = f.x;
            q[4 * k + 1] = f.y;
            q[4 * k + 2] = f.z;
            q[4 * k + 3] = f.w;
        }
        a0 = a1 = 1.0f;
        b0 = b1 = 0.0f;
        c0 = 0;
        c1 = 8;
    }
    static __device__ __forceinline__ float elem(const unsigned char* row, int c) {
        return ((const float*)row)[c];
    }
};

struct FmtF16 {
    static constexpr int QK = 16, BYTES = 32, UNITS = 1, ESIZE = 2;
    static constexpr bool DENSE = true, AFFINE = false;
    static __device__ __forceinline__ void unit(const unsigned char* bp, int, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const uint4* p = (const uint4*)bp;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint4 v = p[k];
            const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                q[8 * k + 2 * i] = half_to_float((unsigned short)(w[i] & 0xffffu));
                q[8 * k + 2 * i + 1] = half_to_float((unsigned short)(w[i] >> 16));
            }
        }
        a0 = a1 = 1.0f;
        b0 = b1 = 0.0f;
        c0 = 0;
        c1 = 8;
    }
    static __device__ __forceinline__ float elem(const unsigned char* row, int c) {
        return half_to_float(((const unsigned short*)row)[c]);
    }
};

struct FmtBF16 {
    static constexpr int QK = 16, BYTES = 32, UNITS = 1, ESIZE = 2;
    static constexpr bool DENSE = true, AFFINE = false;
    static __device__ __forceinline__ void unit(const unsigned char* bp, int, float* q, float& a0,
                                                float& a1, float& b0, float& b1, int& c0, int& c1) {
        const uint4* p = (const uint4*)bp;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint4 v = p[k];
            const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                q[8 * k + 2 * i] = __uint_as_float(w[i] << 16);
                q[8 * k + 2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
            }
        }
        a0 = a1 = 1.0f;
        b0 = b1 = 0.0f;
        c0 = 0;
        c1 = 8;
    }
    static __device__ __forceinline__ float elem(const unsigned char* row, int c) {
        return bf16_to_float(((const unsigned short*)row)[c]);
    }
};

// The 16 dequantized values of a unit: v[i] = a * q + b (a * q when !AFFINE).
template <class F>
__device__ __forceinline__ void unit_values(const unsigned char* bp, int u, float* v, int& c0,
                                            int& c1) {
    float a0, a1, b0, b1;
    F::unit(bp, u, v, a0, a1, b0, b1, c0, c1);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if constexpr (F::AFFINE) {
            v[i] = fmaf(a0, v[i], b0);
            v[8 + i] = fmaf(a1, v[8 + i], b1);
        } else {
            v[i] = a0 * v[i];
            v[8 + i] = a1 * v[8 + i];
        }
    }
}

// Dense rows that are not a whole number of 16-value units take the scalar paths.
template <class F>
__device__ __forceinline__ bool use_scalar_path(int cols) {
    return F::DENSE && (cols % F::QK) != 0;
}

// Bytes of one row of a [rows, cols] matrix.
template <class F>
__device__ __forceinline__ long long row_bytes_of(int cols) {
    return F::DENSE ? (long long)cols * F::ESIZE : (long long)(cols / F::QK) * F::BYTES;
}

// Scalar value (row, c) of a dense format (used only on the scalar paths).
template <class F>
__device__ __forceinline__ float dense_elem(const unsigned char* row, int c) {
    if constexpr (F::DENSE) {
        return F::elem(row, c);
    } else {
        return 0.0f;
    }
}

// ---------------------------------------------------------------------------------------
// dequant_rows_*: embedding lookup
// ---------------------------------------------------------------------------------------
template <class F>
__device__ __forceinline__ void dequant_rows_impl(const unsigned char* __restrict__ w,
                                                  const unsigned int* __restrict__ rows, int n_rows,
                                                  int cols, float* __restrict__ out) {
    const long long row_bytes = row_bytes_of<F>(cols);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (use_scalar_path<F>(cols)) {
        const long long n = (long long)n_rows * cols;
        for (long long i = first; i < n; i += stride) {
            const long long r = i / cols;
            const int c = (int)(i - r * cols);
            out[i] = dense_elem<F>(w + (long long)rows[r] * row_bytes, c);
        }
        return;
    }
    const long long units_per_row = (long long)(cols / F::QK) * F::UNITS;
    const long long n = (long long)n_rows * units_per_row;
    for (long long i = first; i < n; i += stride) {
        const long long r = i / units_per_row;
        const int ur = (int)(i - r * units_per_row);  // unit within the row
        const int blk = ur / F::UNITS;
        const int u = ur - blk * F::UNITS;
        float v[16];
        int c0, c1;
        unit_values<F>(w + (long long)rows[r] * row_bytes + (long long)blk * F::BYTES, u, v, c0, c1);
        float* o = out + r * cols + (long long)blk * F::QK;
        *(float4*)(o + c0) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4*)(o + c0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
        *(float4*)(o + c1) = make_float4(v[8], v[9], v[10], v[11]);
        *(float4*)(o + c1 + 4) = make_float4(v[12], v[13], v[14], v[15]);
    }
}

// ---------------------------------------------------------------------------------------
// dequant_f16_*: whole matrix to f16
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned int pack_half2(float a, float b) {
    return (unsigned int)float_to_half(a) | ((unsigned int)float_to_half(b) << 16);
}

template <class F>
__device__ __forceinline__ void dequant_f16_impl(const unsigned char* __restrict__ w,
                                                 unsigned short* __restrict__ out, int rows,
                                                 int cols) {
    const long long row_bytes = row_bytes_of<F>(cols);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (use_scalar_path<F>(cols)) {
        const long long n = (long long)rows * cols;
        for (long long i = first; i < n; i += stride) {
            const long long r = i / cols;
            const int c = (int)(i - r * cols);
            out[i] = float_to_half(dense_elem<F>(w + r * row_bytes, c));
        }
        return;
    }
    const long long units_per_row = (long long)(cols / F::QK) * F::UNITS;
    const long long n = (long long)rows * units_per_row;
    for (long long i = first; i < n; i += stride) {
        const long long r = i / units_per_row;
        const int ur = (int)(i - r * units_per_row);
        const int blk = ur / F::UNITS;
        const int u = ur - blk * F::UNITS;
        float v[16];
        int c0, c1;
        unit_values<F>(w + r * row_bytes + (long long)blk * F::BYTES, u, v, c0, c1);
        unsigned short* o = out + r * cols + (long long)blk * F::QK;
        *(uint4*)(o + c0) = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]),
                                       pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
        *(uint4*)(o + c1) = make_uint4(pack_half2(v[8], v[9]), pack_half2(v[10], v[11]),
                                       pack_half2(v[12], v[13]), pack_half2(v[14], v[15]));
    }
}

// ---------------------------------------------------------------------------------------
// matvec_*: y[b, r] = sum_c W[r, c] * x[b, c]
// ---------------------------------------------------------------------------------------
// Design (decode is memory-bound): a CTA of 128 threads computes MV_ROWS = 4 consecutive
// output rows for every batch row. The threads of the CTA stride over the 16-value units of
// the row(s) (thread t takes units t, t + 128, ...), so a warp reads 32 consecutive units =
// contiguous block bytes (coalesced), every weight byte is read once per call, and the
// per-thread partial sums are reduced by warp shuffles and then across the 4 warps in shared
// memory. x is read straight from global memory (float4 loads through L1/L2: x is at most
// 8 x 32768 floats = 1 MiB and is shared by every CTA, so it stays cached); no shared-memory
// staging, so any cols works. To cut x traffic, one thread handles R rows per pass with the
// same x values: R = 4 for batch 1, 2 for batch 2..4, 1 above, and the CTA makes
// MV_ROWS / R passes (re-reading x, not W). Per unit and row the thread computes
// a0 * sum(q * x) + a1 * sum(q * x) over the two 8-value runs (+ b_k * sum(x) for q4_1 /
// q4_k, the sums of x shared by the R rows): about 2 FP ops and ~1.5 integer ops per weight.
// Accumulation is f32.

// acc += a0 * sum_{i<8} q[i] x[i] + a1 * sum_{i<8} q[8+i] x[8+i] (+ b0 * xs0 + b1 * xs1).
template <class F>
__device__ __forceinline__ float unit_dot(const float* q, const float* xv, float a0, float a1,
                                          float b0, float b1, float xs0, float xs1, float acc) {
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        s0 = fmaf(q[i], xv[i], s0);
        s1 = fmaf(q[8 + i], xv[8 + i], s1);
    }
    acc = fmaf(a0, s0, acc);
    acc = fmaf(a1, s1, acc);
    if constexpr (F::AFFINE) {
        acc = fmaf(b0, xs0, acc);
        acc = fmaf(b1, xs1, acc);
    }
    return acc;
}

// The 16 x values of a unit (columns c0 .. c0 + 7 and c1 .. c1 + 7 from xr) and, for AFFINE
// formats, the sums of each run.
template <class F>
__device__ __forceinline__ void load_x_unit(const float* __restrict__ xr, int c0, int c1,
                                            float* xv, float& xs0, float& xs1) {
    const float4 a0 = __ldg((const float4*)(xr + c0));
    const float4 a1 = __ldg((const float4*)(xr + c0 + 4));
    const float4 a2 = __ldg((const float4*)(xr + c1));
    const float4 a3 = __ldg((const float4*)(xr + c1 + 4));
    xv[0] = a0.x; xv[1] = a0.y; xv[2] = a0.z; xv[3] = a0.w;
    xv[4] = a1.x; xv[5] = a1.y; xv[6] = a1.z; xv[7] = a1.w;
    xv[8] = a2.x; xv[9] = a2.y; xv[10] = a2.z; xv[11] = a2.w;
    xv[12] = a3.x; xv[13] = a3.y; xv[14] = a3.z; xv[15] = a3.w;
    xs0 = 0.0f;
    xs1 = 0.0f;
    if constexpr (F::AFFINE) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            xs0 += xv[i];
            xs1 += xv[8 + i];
        }
    }
}

template <class F, int B>
__device__ __forceinline__ void matvec_impl(const unsigned char* __restrict__ w,
                                            const float* __restrict__ x, float* __restrict__ y,
                                            int rows, int cols,
                                            float (*red)[MAX_MATVEC_BATCH][32]) {
    constexpr int R = (B == 1) ? 4 : ((B <= 4) ? 2 : 1);
    constexpr int PASSES = MV_ROWS / R;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    const int row0 = blockIdx.x * MV_ROWS;
    const long long row_bytes = row_bytes_of<F>(cols);
    const bool scalar = use_scalar_path<F>(cols);
    const int nunits = scalar ? 0 : (cols / F::QK) * F::UNITS;

#pragma unroll 1
    for (int p = 0; p < PASSES; p++) {
        const int rbase = row0 + p * R;
        if (rbase >= rows) break;  // uniform over the CTA
        const unsigned char* wr[R];
#pragma unroll
        for (int r = 0; r < R; r++) wr[r] = w + (long long)min(rbase + r, rows - 1) * row_bytes;
        float acc[R][B];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int b = 0; b < B; b++) acc[r][b] = 0.0f;

        if (!scalar) {
            for (int uu = threadIdx.x; uu < nunits; uu += blockDim.x) {
                const int blk = uu / F::UNITS;
                const int u = uu - blk * F::UNITS;
                const long long boff = (long long)blk * F::BYTES;
                const float* xb = x + (long long)blk * F::QK;
                if constexpr (B == 1) {
                    // x-stationary: the unit's 16 x values once, then one weight row at a time.
                    float q[16], xv[16], a0, a1, b0, b1, xs0, xs1;
                    int c0, c1;
                    F::unit(wr[0] + boff, u, q, a0, a1, b0, b1, c0, c1);
                    load_x_unit<F>(xb, c0, c1, xv, xs0, xs1);
                    acc[0][0] = unit_dot<F>(q, xv, a0, a1, b0, b1, xs0, xs1, acc[0][0]);
#pragma unroll
                    for (int r = 1; r < R; r++) {
                        F::unit(wr[r] + boff, u, q, a0, a1, b0, b1, c0, c1);  // same c0, c1
                        acc[r][0] = unit_dot<F>(q, xv, a0, a1, b0, b1, xs0, xs1, acc[r][0]);
                    }
                } else {
                    // w-stationary: the unit of all R rows, then x one batch row at a time.
                    float q[R][16], a0[R], a1[R], b0[R], b1[R];
                    int c0 = 0, c1 = 0;
#pragma unroll
                    for (int r = 0; r < R; r++)
                        F::unit(wr[r] + boff, u, q[r], a0[r], a1[r], b0[r], b1[r], c0, c1);
#pragma unroll
                    for (int b = 0; b < B; b++) {
                        float xv[16], xs0, xs1;
                        load_x_unit<F>(xb + (long long)b * cols, c0, c1, xv, xs0, xs1);
#pragma unroll
                        for (int r = 0; r < R; r++)
                            acc[r][b] = unit_dot<F>(q[r], xv, a0[r], a1[r], b0[r], b1[r], xs0,
                                                    xs1, acc[r][b]);
                    }
                }
            }
        } else {
            // Dense rows with cols % 16 != 0: one column per thread per step.
            for (int c = threadIdx.x; c < cols; c += blockDim.x) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const float wv = dense_elem<F>(wr[r], c);
#pragma unroll
                    for (int b = 0; b < B; b++)
                        acc[r][b] = fmaf(wv, x[(long long)b * cols + c], acc[r][b]);
                }
            }
        }

#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int b = 0; b < B; b++) {
                const float s = warp_sum(acc[r][b]);
                if (lane == 0) red[p * R + r][b][warp] = s;
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < MV_ROWS * B; i += blockDim.x) {
        const int rr = i / B;
        const int b = i - rr * B;
        const int row = row0 + rr;
        if (row < rows) {
            float s = 0.0f;
            for (int k = 0; k < nwarps; k++) s += red[rr][b][k];
            y[(long long)b * rows + row] = s;
        }
    }
}

template <class F>
__device__ __forceinline__ void matvec_dispatch(const unsigned char* __restrict__ w,
                                                const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int cols,
                                                int batch) {
    __shared__ float red[MV_ROWS][MAX_MATVEC_BATCH][32];
    switch (batch) {
        case 1: matvec_impl<F, 1>(w, x, y, rows, cols, red); break;
        case 2: matvec_impl<F, 2>(w, x, y, rows, cols, red); break;
        case 3: matvec_impl<F, 3>(w, x, y, rows, cols, red); break;
        case 4: matvec_impl<F, 4>(w, x, y, rows, cols, red); break;
        case 5: matvec_impl<F, 5>(w, x, y, rows, cols, red); break;
        case 6: matvec_impl<F, 6>(w, x, y, rows, cols, red); break;
        case 7: matvec_impl<F, 7>(w, x, y, rows, cols, red); break;
        case 8: matvec_impl<F, 8>(w, x, y, rows, cols, red); break;
        default: break;  // batch outside 1..=8: nothing is written (the caller must assert)
    }
}

// ---------------------------------------------------------------------------------------
// matmul_tc_*: y[b, r] = sum_c W[r, c] * x[b, c] on tensor cores, for decode batches
// ---------------------------------------------------------------------------------------
// Design: the matrix-vector kernel reads x once per weight unit and batch row, so above one
// row it is bound by x's traffic, not the weights'. Here a CTA of 4 warps owns TC_BM = 32
// output rows and BN (8, 16 or 32) batch rows and walks the columns in tiles of TC_BK = 256:
// each tile's weights are decoded once (the same unit code as the other kernels) to f16 in
// shared memory, x's tile (already f16) beside them, and the warps split the tile's 16 k-steps
// (warp w takes steps w, w + 4, ...), each step 2 x BN / 8 mma.m16n8k16 over the whole output
// tile; the four warps' sums meet in shared memory at the end. Rows of shared memory are
// padded by 8 halves so a fragment's 32 lanes read 32 different banks. A grid with fewer CTAs
// than the device has room for splits the columns into gridDim.z slices, each writing its
// partial sums to its own [batch, rows] plane of y (summed by sum_slices).
#define TC_BM 32
#define TC_BK 256
#define TC_LD (TC_BK + 8)  // halves per row of a shared-memory tile

template <class F, int BN>
__device__ __forceinline__ void matmul_tc_impl(const unsigned char* __restrict__ w,
                                               const unsigned short* __restrict__ xh,
                                               float* __restrict__ y, int rows, int cols,
                                               int batch, int tiles_per_slice, float4* smem) {
    unsigned short* ws = (unsigned short*)smem;
    unsigned short* xs = ws + TC_BM * TC_LD;
    constexpr int NT = BN / 8;           // n-tiles of 8 batch rows
    constexpr int UNITS = TC_BK / 16;    // 16-value units per tile row
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * TC_BM;
    const int n0 = blockIdx.y * BN;
    const int ktiles = (cols + TC_BK - 1) / TC_BK;
    const int kt0 = blockIdx.z * tiles_per_slice;
    const int kt1 = min(ktiles, kt0 + tiles_per_slice);
    const long long row_bytes = row_bytes_of<F>(cols);
    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][j][i] = 0.0f;

    for (int kt = kt0; kt < kt1; kt++) {
        const int k0 = kt * TC_BK;
        const int units = min(TC_BK, cols - k0) / 16;  // cols % 16 == 0
        for (int i = threadIdx.x; i < TC_BM * UNITS; i += blockDim.x) {
            const int r = i / UNITS;
            const int uu = i - r * UNITS;
            unsigned short* o = ws + r * TC_LD;
            if (uu < units && row0 + r < rows) {
                const int ub = uu / F::UNITS;  // block within the tile
                const int u = uu - ub * F::UNITS;
                const unsigned char* bp =
                    w + (long long)(row0 + r) * row_bytes + (long long)(k0 / F::QK + ub) * F::BYTES;
                float v[16];
                int c0, c1;
                unit_values<F>(bp, u, v, c0, c1);
                o += ub * F::QK;
                *(uint4*)(o + c0) = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]),
                                               pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
                *(uint4*)(o + c1) = make_uint4(pack_half2(v[8], v[9]), pack_half2(v[10], v[11]),
                                               pack_half2(v[12], v[13]), pack_half2(v[14], v[15]));
            } else {
                // Past the matrix: zeros (a row's units cover its 16-column runs either way).
                *(uint4*)(o + 16 * uu) = make_uint4(0u, 0u, 0u, 0u);
                *(uint4*)(o + 16 * uu + 8) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        for (int i = threadIdx.x; i < BN * (TC_BK / 8); i += blockDim.x) {
            const int n = i / (TC_BK / 8);
            const int c8 = (i - n * (TC_BK / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (n0 + n < batch && c8 < units * 16)
                v = *(const uint4*)(xh + (long long)(n0 + n) * cols + k0 + c8);
            *(uint4*)(xs + n * TC_LD + c8) = v;
        }
        __syncthreads();
        for (int ks = warp; ks < UNITS; ks += 4) {  // warp-uniform
            const int kk = ks * 16;
            unsigned int a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const unsigned short* ar = ws + (m * 16 + g) * TC_LD + kk + 2 * t;
                a[m][0] = *(const unsigned int*)ar;
                a[m][1] = *(const unsigned int*)(ar + 8 * TC_LD);
                a[m][2] = *(const unsigned int*)(ar + 8);
                a[m][3] = *(const unsigned int*)(ar + 8 * TC_LD + 8);
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const unsigned short* br = xs + (j * 8 + g) * TC_LD + kk + 2 * t;
                const unsigned int b[2] = {*(const unsigned int*)br, *(const unsigned int*)(br + 8)};
                mma_16816(acc[0][j], a[0], b);
                mma_16816(acc[1][j], a[1], b);
            }
        }
        __syncthreads();
    }

    // The warps' sums: red[warp][j][lane], j the fragment value, then each thread sums the
    // values j = warp, warp + 4, ... of its lane over the warps.
    constexpr int VALS = 2 * NT * 4;
    float* red = (float*)smem;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                red[(warp * VALS + (m * NT + j) * 4 + i) * 32 + lane] = acc[m][j][i];
    __syncthreads();
    float* plane = y + (long long)blockIdx.z * batch * rows;
    for (int v = warp; v < VALS; v += 4) {
        float s = 0.0f;
        for (int k = 0; k < 4; k++) s += red[(k * VALS + v) * 32 + lane];
        const int m = v / (NT * 4);
        const int j = (v / 4) % NT;
        const int i = v % 4;
        const int r = row0 + m * 16 + g + (i >= 2 ? 8 : 0);
        const int n = n0 + j * 8 + 2 * t + (i & 1);
        if (r < rows && n < batch) plane[(long long)n * rows + r] = s;
    }
}

template <class F>
__device__ __forceinline__ void matmul_tc_dispatch(const unsigned char* __restrict__ w,
                                                   const unsigned short* __restrict__ xh,
                                                   float* __restrict__ y, int rows, int cols,
                                                   int batch, int bn, int tiles_per_slice) {
    // The weight tile, then x's tile for the largest BN; reused for the warps' sums at the end.
    __shared__ float4 smem[(TC_BM + 32) * TC_LD * 2 / 16];
    switch (bn) {
        case 8: matmul_tc_impl<F, 8>(w, xh, y, rows, cols, batch, tiles_per_slice, smem); break;
        case 16: matmul_tc_impl<F, 16>(w, xh, y, rows, cols, batch, tiles_per_slice, smem); break;
        case 32: matmul_tc_impl<F, 32>(w, xh, y, rows, cols, batch, tiles_per_slice, smem); break;
        default: break;  // any other bn: nothing is written (the caller must assert)
    }
}

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------
// For every format F in {f32, f16, bf16, q4_0, q4_1, q5_0, q8_0, q4_k, q6_k}:
//
// dequant_rows_F(const unsigned char* w, const unsigned int* rows, int n_rows, int cols,
//                float* out)
//   Launch: block = 256 threads, grid = min(ceil(n_work / 256), 65535) (any grid >= 1 is
//           correct: grid-stride loop), dynamic shared memory = 0, where
//           n_work = n_rows * cols / 16 (n_rows * cols for a dense format with cols % 16 != 0).
//   Computes out[i, c] = W[rows[i], c] (f32) for i < n_rows, c < cols; W is [_, cols] in
//   format F, out is [n_rows, cols] f32. (Embedding lookup.)
//
// dequant_f16_F(const unsigned char* w, unsigned short* out, int rows, int cols)   (F != f16)
//   Launch: as dequant_rows_F with n_work = rows * cols / 16.
//   Computes out[r, c] = f16(W[r, c]) (round to nearest even) for the whole [rows, cols]
//   matrix, out row-major f16.
//
// matvec_F(const unsigned char* w, const float* x, float* y, int rows, int cols, int batch)
//   Launch: grid = (ceil(rows / 4), 1, 1) (MV_ROWS = 4 output rows per CTA),
//           block = (128, 1, 1) (any multiple of 32 up to 1024 is correct; 128 is the tuned
//           choice), dynamic shared memory = 0 (4 KiB static).
//   Computes y[b, r] = sum_c W[r, c] * x[b, c] for b < batch, r < rows; W is [rows, cols] in
//   format F, x is f32 [batch, cols], y is f32 [batch, rows]. 1 <= batch <= 8
//   (MAX_MATVEC_BATCH); for any other batch nothing is written. f32 accumulation; the order of
//   the sum differs from a sequential one (rounding only).
//   Why this launch: with 4 rows per CTA a 4096-row matrix gives 1024 CTAs, about one wave
//   on a 132-SM H100/H200 (72-80 registers per thread -> 6-7 resident CTAs = 24-28 warps per
//   SM); at batch 1 each thread has 4 rows' loads in flight per unit (~1.1 KiB per warp for
//   q4_k), enough to cover DRAM latency. 128 threads stride over a row's units so each warp
//   load instruction touches one contiguous run of block bytes; a 4-warp CTA keeps the
//   cross-warp reduction to one shared-memory step.
//
// matmul_tc_F(const unsigned char* w, const unsigned short* xh, float* y, int rows, int cols,
//             int batch, int bn, int tiles_per_slice)
//   Launch: grid = (ceil(rows / 32), ceil(batch / bn), slices), block = (128, 1, 1) (four
//           warps, as the kernel assumes), dynamic shared memory = 0 (33 KiB static), where
//           slices = ceil(ceil(cols / 256) / tiles_per_slice).
//   Computes, for slice z = blockIdx.z, y[z, b, r] = sum over c in columns
//   [256 z tiles_per_slice, 256 (z + 1) tiles_per_slice) of W[r, c] * x[b, c], for b < batch,
//   r < rows; W is [rows, cols] in format F, xh is x in f16 bits [batch, cols], y is f32
//   [slices, batch, rows]. bn is 8, 16 or 32 (batch rows per CTA); any other bn writes
//   nothing. cols % 16 == 0 (the dense formats too). f16 products, f32 accumulation.
//
// f32_to_f16 / f32_to_bf16 / f16_to_f32 at the end of the file.

#define QUANT_KERNELS(name, Fmt)                                                                \
    extern "C" __global__ void dequant_rows_##name(const unsigned char* __restrict__ w,         \
                                                   const unsigned int* __restrict__ rows,       \
                                                   int n_rows, int cols,                        \
                                                   float* __restrict__ out) {                   \
        dequant_rows_impl<Fmt>(w, rows, n_rows, cols, out);                                     \
    }                                                                                           \
    extern "C" __global__ void matvec_##name(const unsigned char* __restrict__ w,               \
                                             const float* __restrict__ x, float* __restrict__ y, \
                                             int rows, int cols, int batch) {                   \
        matvec_dispatch<Fmt>(w, x, y, rows, cols, batch);                                       \
    }                                                                                           \
    extern "C" __global__ void matmul_tc_##name(const unsigned char* __restrict__ w,            \
                                                const unsigned short* __restrict__ xh,          \
                                                float* __restrict__ y, int rows, int cols,      \
                                                int batch, int bn, int tiles_per_slice) {       \
        matmul_tc_dispatch<Fmt>(w, xh, y, rows, cols, batch, bn, tiles_per_slice);              \
    }

#define DEQUANT_F16_KERNEL(name, Fmt)                                                           \
    extern "C" __global__ void dequant_f16_##name(const unsigned char* __restrict__ w,          \
                                                  unsigned short* __restrict__ out, int rows,   \
                                                  int cols) {                                   \
        dequant_f16_impl<Fmt>(w, out, rows, cols);                                              \
    }

QUANT_KERNELS(f32, FmtF32)
QUANT_KERNELS(f16, FmtF16)
QUANT_KERNELS(bf16, FmtBF16)
QUANT_KERNELS(q4_0, FmtQ4_0)
QUANT_KERNELS(q4_1, FmtQ4_1)
QUANT_KERNELS(q5_0, FmtQ5_0)
QUANT_KERNELS(q8_0, FmtQ8_0)
QUANT_KERNELS(q4_k, FmtQ4_K)
QUANT_KERNELS(q6_k, FmtQ6_K)

DEQUANT_F16_KERNEL(f32, FmtF32)
DEQUANT_F16_KERNEL(bf16, FmtBF16)
DEQUANT_F16_KERNEL(q4_0, FmtQ4_0)
DEQUANT_F16_KERNEL(q4_1, FmtQ4_1)
DEQUANT_F16_KERNEL(q5_0, FmtQ5_0)
DEQUANT_F16_KERNEL(q8_0, FmtQ8_0)
DEQUANT_F16_KERNEL(q4_k, FmtQ4_K)
DEQUANT_F16_KERNEL(q6_k, FmtQ6_K)

// f32_to_f16(const float* x, unsigned short* y, int n)
//   Launch: element-wise: block = 256, grid = min(ceil(n / 256), 65535) (any grid >= 1;
//           grid-stride loop), dynamic shared memory = 0.
//   Computes y[i] = f16 bits of x[i], round to nearest even, for i < n.
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                      int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = float_to_half(x[i]);
    }
}

// f32_to_bf16(const float* x, unsigned short* y, int n)
//   Launch: as f32_to_f16.
//   Computes y[i] = bf16 bits of x[i], round to nearest even (NaN stays NaN), for i < n.
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                       int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = float_to_bf16(x[i]);
    }
}

// f16_to_f32(const unsigned short* x, float* y, int n)
//   Launch: as f32_to_f16.
//   Computes y[i] = f32 value of the f16 bits x[i] (exact; inf and NaN stay inf and NaN), for
//   i < n.
extern "C" __global__ void f16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y,
                                      int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = half_to_float(x[i]);
    }
}

// sum_slices(const float* parts, float* y, int slices, int n)
//   Launch: as f32_to_f16.
//   Computes y[i] = sum over z < slices of parts[z * n + i], in order of z, for i < n (the
//   column slices of matmul_tc_*).
extern "C" __global__ void sum_slices(const float* __restrict__ parts, float* __restrict__ y,
                                      int slices, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = 0.0f;
        for (int z = 0; z < slices; z++) s += parts[(long long)z * n + i];
        y[i] = s;
    }
}

// sampling.cu: per-row statistics of the logits, computed on the device so only a few
// numbers per row come back to the host. Compiled as prelude.cuh + "\n" + this file.

// row_softmax_stats
// Launch: grid = (rows, 1, 1), block = (T, 1, 1) with T a multiple of 32, 32 <= T <= 1024
//         (1024 suggested for vocabularies of ~32k..256k), dynamic shared memory = 0.
// logits is [rows, vocab]; for row r = blockIdx.x, with x = logits[r, :]:
//   m                   = max_c x[c]  (NaN values are ignored; -inf if there is no
//                         non-NaN value)
//   out_argmax[r]       = the lowest c with x[c] == m (0 if every value is NaN)
//   out_max_logit[r]    = m
//   Z                   = sum_c exp(max(x[c] - m, -88))
//   out_logsumexp[r]    = m + log(Z)
//   out_entropy[r]      = log(Z) - sum_c exp(d_c) * d_c / Z,  d_c = max(x[c] - m, -88)
//                       = -sum_c p_c log p_c of the softmax, in nats.
// The offsets are floored at -88 as in the CPU engine, so a -inf (masked) or NaN logit
// carries a weight of ~6e-39 (no probability, no NaN). If m is not finite (all -inf / NaN, or
// a +inf logit) the row's logsumexp is m and its entropy is 0. Sums are f32 (per-thread
// partial sums over vocab / T values, then a tree over the block). Any output pointer may be
// nullptr to skip that output.
extern "C" __global__ void row_softmax_stats(const float* logits, int vocab, float* out_max_logit,
                                             float* out_logsumexp, float* out_entropy,
                                             int* out_argmax) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const float* x = logits + (long long)row * vocab;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    const int NO_INDEX = 0x7fffffff;

    // Pass 1: max and the lowest index holding it. (best, idx) pairs combine by: larger
    // value wins, equal values keep the lower index. NaN never compares greater or equal, so
    // it is skipped.
    float best = neg_inf_f32();
    int idx = NO_INDEX;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        const float v = x[c];
        if (v > best || (v == best && c < idx)) {
            best = v;
            idx = c;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) {
            best = ov;
            idx = oi;
        }
    }
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    best = (lane < nwarps) ? s_val[lane] : neg_inf_f32();
    idx = (lane < nwarps) ? s_idx[lane] : NO_INDEX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) {
            best = ov;
            idx = oi;
        }
    }
    const float m = best;  // identical in every thread

    // Pass 2: Z and sum of exp(d) * d (skipped when m is not finite).
    float z = 0.0f;
    float zd = 0.0f;
    const bool finite = isfinite(m);
    if (finite) {
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float d = fmaxf(x[c] - m, -88.0f);  // fmaxf(NaN, -88) = -88
            const float e = expf(d);
            z += e;
            zd = fmaf(e, d, zd);
        }
    }
    z = block_sum(z, scratch);
    zd = block_sum(zd, scratch);

    if (threadIdx.x == 0) {
        float lse = m;
        float entropy = 0.0f;
        if (finite) {
            const float lz = logf(z);
            lse = m + lz;
            entropy = lz - zd / z;
        }
        if (out_max_logit != nullptr) out_max_logit[row] = m;
        if (out_logsumexp != nullptr) out_logsumexp[row] = lse;
        if (out_entropy != nullptr) out_entropy[row] = entropy;
        if (out_argmax != nullptr) out_argmax[row] = (idx == NO_INDEX) ? 0 : idx;
    }
}

// attention.cu: paged KV cache (f16) writes and causal paged attention.
// Compiled as prelude.cuh + "\n" + this file.
//
// Cache layout, per layer, for K and V separately (f16 bits as unsigned short):
//   cache[num_blocks][num_kv_heads][block_size][head_dim]
// so element (block b, kv head h, slot s, dim d) is at
//   ((b * num_kv_heads + h) * block_size + s) * head_dim + d        (64-bit arithmetic).
// Cache base pointers must be 16-byte aligned (any cudaMalloc'd pointer is).

// kv_write_f16
// Launch: element-wise over n = tokens * num_kv_heads * head_dim; block = 256,
//         grid = min(ceil(n / 256), 65535) or any grid >= 1 (grid-stride loop);
//         dynamic shared memory = 0.
// k and v are f32 [tokens, num_kv_heads, head_dim]. For token t with b = token_block[t] and
// s = token_slot[t] (0 <= s < block_size):
//   k_cache[b, h, s, d] = f16(k[t, h, d]),  v_cache[b, h, s, d] = f16(v[t, h, d])
// (round to nearest even). A token with b < 0 is skipped (padding).
extern "C" __global__ void kv_write_f16(unsigned short* k_cache, unsigned short* v_cache,
                                        const float* k, const float* v, const int* token_block,
                                        const int* token_slot, int tokens, int num_kv_heads,
                                        int head_dim, int block_size) {
    const long long per_token = (long long)num_kv_heads * head_dim;
    const long long n = (long long)tokens * per_token;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long t = i / per_token;
        const long long hd = i - t * per_token;  // h * head_dim + d
        const long long h = hd / head_dim;
        const long long d = hd - h * head_dim;
        const int b = token_block[t];
        if (b < 0) continue;
        const int s = token_slot[t];
        const long long dst = (((long long)b * num_kv_heads + h) * block_size + s) * head_dim + d;
        k_cache[dst] = float_to_half(k[i]);
        v_cache[dst] = float_to_half(v[i]);
    }
}

// qkv_rotary_write_f16
// Launch: grid = (ceil(tokens * (heads + 2 * kv_heads) / 4), 1, 1), block = (128, 1, 1),
//         dynamic shared memory = 0.
// What follows a stacked q/k/v projection before attention, in one launch (where it took a
// column copy for each of q, k and v, a norm for each of q and k, two rotaries and the K/V
// write). qkv is [tokens, stride] f32: token t's q heads at columns 0 .., its K heads after
// them, its V heads after those, head_dim values each. Warp w of CTA b takes row r = 4b + w
// of the tokens * (heads + 2 * kv_heads) heads, token t = r / (heads + 2 * kv_heads):
//   q head h:  x = qkv[t, h], normalised by q_norm where it is not null (as rms_norm over
//              head_dim: x / sqrtf(mean(x^2) + q_eps) * q_norm), rotated as rotary does at
//              positions[t], into q[t, h, :] (q is [tokens, heads, head_dim]);
//   K head j:  the same with k_norm and k_eps, written as f16 to
//              k_cache[token_block[t], j, token_slot[t], :] (as kv_write_f16);
//   V head j:  written as f16 to v_cache there.
// A token with token_block[t] < 0 (padding) writes no K/V.
// Requirements: head_dim a multiple of 32, at most 256, and of 64 when neox != 0.
#define QKV_MAX_PER_LANE 8
extern "C" __global__ void qkv_rotary_write_f16(
    const float* qkv, int stride, const float* q_norm, float q_eps, const float* k_norm,
    float k_eps, const unsigned int* positions, const float* inv_freq, int neox,
    const int* token_block, const int* token_slot, float* q, unsigned short* k_cache,
    unsigned short* v_cache, int tokens, int heads, int kv_heads, int head_dim,
    int block_size) {
    const int lane = threadIdx.x & 31;
    const int per_token = heads + 2 * kv_heads;
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int n = head_dim >> 5;  // values a lane: dims lane, lane + 32, ...
    if (r >= (long long)tokens * per_token || (head_dim & 31) != 0 || n > QKV_MAX_PER_LANE ||
        (neox && (head_dim & 63) != 0)) {
        return;  // uniform over the warp; no CTA barrier follows
    }
    const long long t = r / per_token;
    const int h = (int)(r - t * per_token);
    const bool is_q = h < heads;
    const bool is_k = !is_q && h < heads + kv_heads;
    const float* x = qkv + t * stride + (long long)h * head_dim;
    float v[QKV_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < QKV_MAX_PER_LANE; j++) v[j] = j < n ? x[lane + 32 * j] : 0.0f;
    const float* w = is_q ? q_norm : (is_k ? k_norm : nullptr);
    if (w != nullptr) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < QKV_MAX_PER_LANE; j++) ss = fmaf(v[j], v[j], ss);
        ss = warp_sum(ss);
        const float rms = sqrtf(ss / (float)head_dim + (is_q ? q_eps : k_eps));
#pragma unroll
        for (int j = 0; j < QKV_MAX_PER_LANE; j++)
            if (j < n) v[j] = v[j] / rms * w[lane + 32 * j];
    }
    if (is_q || is_k) {
        const float pos = (float)positions[t];
        if (neox) {
            // Pairs (i, i + head_dim / 2): dims lane + 32j and lane + 32(j + n / 2), one lane.
#pragma unroll
            for (int j = 0; j < QKV_MAX_PER_LANE / 2; j++) {
                if (j < n / 2) {
                    float s, c;
                    sincosf(pos * inv_freq[lane + 32 * j], &s, &c);
                    const float a = v[j], b = v[j + n / 2];
                    v[j] = a * c - b * s;
                    v[j + n / 2] = a * s + b * c;
                }
            }
        } else {
            // Pairs (2i, 2i + 1): neighbouring lanes, the even one holding a.
#pragma unroll
            for (int j = 0; j < QKV_MAX_PER_LANE; j++) {
                if (j < n) {
                    const float other = __shfl_xor_sync(0xffffffffu, v[j], 1);
                    float s, c;
                    sincosf(pos * inv_freq[(lane + 32 * j) >> 1], &s, &c);
                    v[j] = (lane & 1) == 0 ? v[j] * c - other * s : other * s + v[j] * c;
                }
            }
        }
    }
    if (is_q) {
        float* out = q + (t * heads + h) * head_dim;
#pragma unroll
        for (int j = 0; j < QKV_MAX_PER_LANE; j++)
            if (j < n) out[lane + 32 * j] = v[j];
        return;
    }
    const int b = token_block[t];
    if (b < 0) return;
    const int j_head = is_k ? h - heads : h - heads - kv_heads;
    const long long dst =
        (((long long)b * kv_heads + j_head) * block_size + token_slot[t]) * head_dim;
    unsigned short* cache = is_k ? k_cache : v_cache;
#pragma unroll
    for (int j = 0; j < QKV_MAX_PER_LANE; j++)
        if (j < n) cache[dst + lane + 32 * j] = float_to_half(v[j]);
}

#define PA_MAX_HEAD_DIM 256
#define PA_MAX_WARPS 16

// Loads VEC consecutive f16 values (VEC in {1, 2, 4, 8}; p aligned to 2 * VEC bytes) as f32.
template <int VEC>
__device__ __forceinline__ void load_half_vec(const unsigned short* p, float* out) {
    if (VEC == 1) {
        out[0] = half_to_float(p[0]);
    } else if (VEC == 2) {
        const unsigned int u = *(const unsigned int*)p;
        out[0] = half_to_float((unsigned short)(u & 0xffffu));
        out[1] = half_to_float((unsigned short)(u >> 16));
    } else if (VEC == 4) {
        const uint2 u = *(const uint2*)p;
        out[0] = half_to_float((unsigned short)(u.x & 0xffffu));
        out[1] = half_to_float((unsigned short)(u.x >> 16));
        out[2] = half_to_float((unsigned short)(u.y & 0xffffu));
        out[3] = half_to_float((unsigned short)(u.y >> 16));
    } else {
        const uint4 u = *(const uint4*)p;
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = half_to_float((unsigned short)(w[i] & 0xffffu));
            out[2 * i + 1] = half_to_float((unsigned short)(w[i] >> 16));
        }
    }
}

// One CTA per (token, head). The context positions 0..=pos are cut into tiles of 32; warp w
// takes tiles w, w + W, w + 2W, ... In a tile, lane l scores position tile * 32 + l (a full
// q.k over head_dim), then the warp updates its online-softmax state (running max m, per-lane
// partial sum l, output accumulator acc) and accumulates the tile's V rows, lane l owning
// output dims (l + 32 i) * VEC .. + VEC for i < NC. The W warp states are merged at the end
// through shared memory.
//   NC, VEC: NC = 1, VEC = head_dim / 32 when head_dim is 32, 64, 128 or 256; else NC = 8,
//            VEC = 1 (any head_dim <= 256).
//   K8:      head_dim % 8 == 0, so K rows are read 16 bytes at a time.
template <int NC, int VEC, bool K8>
__device__ __forceinline__ void paged_attention_body(
    const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, float* __restrict__ out,
    const int* __restrict__ block_tables, const int* __restrict__ table_start,
    const int* __restrict__ token_pos, const int* __restrict__ token_seq, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, float* q_s, float* m_s,
    float* l_s, float (*acc_s)[PA_MAX_HEAD_DIM]) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;

    const int t = blockIdx.x / num_heads;
    const int h = blockIdx.x - t * num_heads;
    const int kvh = h / (num_heads / num_kv_heads);
    const int seq = token_seq[t];
    const int n = token_pos[t] + 1;  // attends to positions 0 .. n - 1
    const int* table = block_tables + table_start[seq];

    const long long head_off = ((long long)t * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = q[head_off + d];
    __syncthreads();

    const long long slab = (long long)block_size * head_dim;       // one (block, kv head)
    const long long block_stride = (long long)num_kv_heads * slab;  // one block
    const long long kv_off = (long long)kvh * slab;

    float m = neg_inf_f32();  // running max of this warp (same in all lanes)
    float l = 0.0f;           // this lane's share of the running sum of exp(score - m)
    float acc[NC * VEC];
#pragma unroll
    for (int i = 0; i < NC * VEC; i++) acc[i] = 0.0f;

    for (int tile = warp; tile * 32 < n; tile += nwarps) {
        // Scores: lane scores position p.
        const int p = tile * 32 + lane;
        const bool valid = p < n;
        long long row = 0;  // element offset of position p's K / V row
        float score = neg_inf_f32();
        if (valid) {
            const int blk = table[p / block_size];
            const int slot = p - (p / block_size) * block_size;
            row = (long long)blk * block_stride + kv_off + (long long)slot * head_dim;
            const unsigned short* kr = k_cache + row;
            float dot = 0.0f;
            if (K8) {
#pragma unroll 4
                for (int d = 0; d < head_dim; d += 8) {
                    float kf[8];
                    load_half_vec<8>(kr + d, kf);
                    const float4 qa = *(const float4*)(q_s + d);
                    const float4 qb = *(const float4*)(q_s + d + 4);
                    dot = fmaf(qa.x, kf[0], dot);
                    dot = fmaf(qa.y, kf[1], dot);
                    dot = fmaf(qa.z, kf[2], dot);
                    dot = fmaf(qa.w, kf[3], dot);
                    dot = fmaf(qb.x, kf[4], dot);
                    dot = fmaf(qb.y, kf[5], dot);
                    dot = fmaf(qb.z, kf[6], dot);
                    dot = fmaf(qb.w, kf[7], dot);
                }
            } else {
                for (int d = 0; d < head_dim; d++) dot = fmaf(q_s[d], half_to_float(kr[d]), dot);
            }
            score = dot * scale;
        }
        // Online softmax update. Lane 0 of every tile is valid (tile * 32 < n), so tile_max
        // and m_new are finite for finite inputs; the first update has m = -inf, corr = 0.
        const float tile_max = warp_max(score);
        const float m_new = fmaxf(m, tile_max);
        const float corr = expf(m - m_new);
        const float pexp = valid ? expf(score - m_new) : 0.0f;
        l = fmaf(l, corr, pexp);
#pragma unroll
        for (int i = 0; i < NC * VEC; i++) acc[i] *= corr;
        m = m_new;

        // Weighted V rows of the tile's valid positions (cnt is warp-uniform).
        const int cnt = min(32, n - tile * 32);
        for (int j0 = 0; j0 < cnt; j0 += 8) {
#pragma unroll
            for (int jj = 0; jj < 8; jj++) {
                const int j = j0 + jj;
                if (j < cnt) {
                    const float pj = __shfl_sync(0xffffffffu, pexp, j);
                    const long long rj = __shfl_sync(0xffffffffu, row, j);
                    const unsigned short* vr = v_cache + rj;
#pragma unroll
                    for (int c = 0; c < NC; c++) {
                        const int d0 = (lane + 32 * c) * VEC;
                        if (NC == 1 || d0 < head_dim) {
                            float vf[VEC];
                            load_half_vec<VEC>(vr + d0, vf);
#pragma unroll
                            for (int e = 0; e < VEC; e++) acc[c * VEC + e] = fmaf(pj, vf[e], acc[c * VEC + e]);
                        }
                    }
                }
            }
        }
    }

    // Publish this warp's state. A warp without tiles has m = -inf, l = 0, acc = 0.
    l = warp_sum(l);
    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const int d0 = (lane + 32 * c) * VEC;
        if (NC == 1 || d0 < head_dim) {
#pragma unroll
            for (int e = 0; e < VEC; e++) acc_s[warp][d0 + e] = acc[c * VEC + e];
        }
    }
    __syncthreads();

    // Merge: out[d] = sum_w acc_w[d] e^(m_w - M) / sum_w l_w e^(m_w - M), M = max_w m_w.
    float mx = neg_inf_f32();
    for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, m_s[w]);
    float total = 0.0f;
    for (int w = 0; w < nwarps; w++) {
        if (m_s[w] != neg_inf_f32()) total += l_s[w] * expf(m_s[w] - mx);
    }
    // total > 0 whenever n >= 1; a token with position < 0 (n <= 0) gets zeros.
    const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < nwarps; w++) {
            if (m_s[w] != neg_inf_f32()) o = fmaf(acc_s[w][d], expf(m_s[w] - mx), o);
        }
        out[head_off + d] = o * inv_total;
    }
}

// paged_attention_f16
// Launch: grid = (tokens * num_heads, 1, 1)  [blockIdx.x = t * num_heads + h],
//         block = (32 * W, 1, 1) with 1 <= W <= 16 warps (128 suggested; 256 or 512 when
//         tokens * num_heads is small against the SM count and contexts are long, i.e.
//         decode), dynamic shared memory = 0 (about 17.5 KB static).
// Requirements: head_dim <= 256 (PA_MAX_HEAD_DIM; 64 and 128 are the fast common cases,
//   any head_dim <= 256 works), num_heads % num_kv_heads == 0, block_size >= 1, caches
//   16-byte aligned. A CTA whose head_dim or blockDim is out of range writes nothing; a token
//   with token_pos[t] < 0 gets out[t, :, :] = 0.
// Inputs: q, out are f32 [tokens, num_heads, head_dim]; k_cache, v_cache are one layer's
//   f16 caches (layout at the top of this file). Token t belongs to sequence
//   s = token_seq[t], is at position p = token_pos[t], and its sequence's block ids are
//   block_tables[table_start[s] + j] for positions j * block_size .. (j + 1) * block_size - 1.
//   The K/V of the token itself (and of all positions <= p) must already be in the cache.
// Computes, for head h (kv head g = h / (num_heads / num_kv_heads)) and j in 0..=p:
//   score_j = scale * sum_d q[t, h, d] * K[j, g, d]
//   out[t, h, :] = sum_j softmax(score)_j * V[j, g, :]
// in f32 with an online (running max) softmax per warp, the warps' states merged exactly.
extern "C" __global__ void paged_attention_f16(const float* q, const unsigned short* k_cache,
                                               const unsigned short* v_cache, float* out,
                                               const int* block_tables, const int* table_start,
                                               const int* token_pos, const int* token_seq,
                                               int tokens, int num_heads, int num_kv_heads,
                                               int head_dim, int block_size, float scale) {
    __shared__ __align__(16) float q_s[PA_MAX_HEAD_DIM];
    __shared__ float m_s[PA_MAX_WARPS];
    __shared__ float l_s[PA_MAX_WARPS];
    __shared__ __align__(16) float acc_s[PA_MAX_WARPS][PA_MAX_HEAD_DIM];
    if (head_dim > PA_MAX_HEAD_DIM || head_dim <= 0 || blockDim.x > 32 * PA_MAX_WARPS ||
        (blockDim.x & 31) != 0 || (int)blockIdx.x >= tokens * num_heads) {
        return;  // uniform over the CTA
    }
    const bool k8 = (head_dim & 7) == 0;
#define PA_CALL(NC, VEC, K8)                                                                   \
    paged_attention_body<NC, VEC, K8>(q, k_cache, v_cache, out, block_tables, table_start,    \
                                      token_pos, token_seq, num_heads, num_kv_heads, head_dim, \
                                      block_size, scale, q_s, m_s, l_s, acc_s)
    if (head_dim == 32) {
        PA_CALL(1, 1, true);
    } else if (head_dim == 64) {
        PA_CALL(1, 2, true);
    } else if (head_dim == 128) {
        PA_CALL(1, 4, true);
    } else if (head_dim == 256) {
        PA_CALL(1, 8, true);
    } else if (k8) {
        PA_CALL(8, 1, true);
    } else {
        PA_CALL(8, 1, false);
    }
#undef PA_CALL
}

// ---------------------------------------------------------------------------------------
// paged_attention_tiles_f16, attention_merge
// ---------------------------------------------------------------------------------------
// One CTA per (tile, KV head, part of the group, split of the context): its PT_ROWS query rows
// are the heads of one GQA group (or PT_ROWS of them: a group of more heads is cut into parts)
// for up to PT_ROWS / heads consecutive tokens of one sequence, so every K and V row the CTA
// stages in shared memory (f16 -> f32, PT_POS positions at a time) serves all of them, where
// paged_attention_f16 has each (token, head) read its whole context alone. Where the tiles
// alone are too few CTAs for the device (a decode step, an extend over long contexts), each
// takes one split of the context and leaves its softmax state for attention_merge. Warp w
// owns rows 4w .. 4w + 3 throughout: in the scores lane l takes position base + l for the
// four rows (a float4 of K against four broadcast float4s of q a step), the warp keeps the
// rows' online-softmax state, and in the weighted sums lane l owns output dims
// l * VEC .. + VEC of the four rows.
#define PT_ROWS 16
#define PT_POS 32
#define PT_THREADS 128
#define PT_MAX_HEAD_DIM 128

// Fewest positions a split of the context covers (two of a CTA's runs).
#define PT_MIN_SPLIT 64

// Where a tile CTA works: its tile's first token, KV head, part of the group, and split of
// the context (1 of splits: all of it).
struct TileSpan {
    int first, kvh, part, split, splits;
};

template <int HD>
__device__ __forceinline__ void paged_attention_tiles_body(
    const float* __restrict__ q, const unsigned short* __restrict__ k_cache,
    const unsigned short* __restrict__ v_cache, float* __restrict__ out,
    float* __restrict__ part_out, const int* __restrict__ block_tables,
    const int* __restrict__ table_start, const int* __restrict__ token_pos,
    const int* __restrict__ token_seq, TileSpan span, int tokens, int num_heads,
    int num_kv_heads, int block_size, float scale, float* q_s, float* k_s, float* v_s,
    float (*p_s)[PT_POS]) {
    constexpr int VEC = HD / 32;  // output dims per lane
    constexpr int KS = HD + 4;    // K row stride in shared memory: conflict-free float4 reads
    constexpr int RW = PT_ROWS / (PT_THREADS / 32);  // rows per warp
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int group = num_heads / num_kv_heads;
    const int gh = min(group, PT_ROWS);
    const int tq = PT_ROWS / gh;
    const int first = span.first, kvh = span.kvh;
    const int seq = token_seq[first];
    int count = 0;  // the tile's tokens: consecutive, of one sequence
    int n_end = 0;  // positions 0 .. n_end - 1 are attended by some row
    while (count < tq && first + count < tokens && token_seq[first + count] == seq) {
        n_end = max(n_end, token_pos[first + count] + 1);
        count++;
    }
    // This CTA's positions: lo .. hi - 1. A split's length follows from the tile's own
    // context (so one launch, and a recorded one replayed at other lengths, serves any
    // context): runs of PT_POS, at least PT_MIN_SPLIT, splits after the context empty.
    int lo = 0, hi = n_end;
    if (span.splits > 1) {
        const int per = (n_end + span.splits - 1) / span.splits;
        const int len = max(PT_MIN_SPLIT, (per + PT_POS - 1) / PT_POS * PT_POS);
        lo = min(n_end, span.split * len);
        hi = min(n_end, lo + len);
    }
    const int* table = block_tables + table_start[seq];

    // Row r: token first + r / gh, head kvh * group + part * gh + r % gh, when both are there.
    auto row_exists = [&](int r) { return r / gh < count && span.part * gh + r % gh < group; };
    auto row_index = [&](int r) {  // (token, head) of the row
        return (long long)(first + r / gh) * num_heads + kvh * group + span.part * gh + r % gh;
    };
    for (int i = threadIdx.x; i < PT_ROWS * HD; i += PT_THREADS) {
        const int r = i / HD;
        q_s[i] = row_exists(r) ? q[row_index(r) * HD + (i - r * HD)] : 0.0f;
    }
    // Each row's position (-1 where the row is not there: every score masked).
    int pos_r[RW];
    float m[RW], l[RW], acc[RW][VEC];
#pragma unroll
    for (int i = 0; i < RW; i++) {
        const int r = warp * RW + i;
        pos_r[i] = row_exists(r) ? token_pos[first + r / gh] : -1;
        m[i] = neg_inf_f32();
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; e++) acc[i][e] = 0.0f;
    }

    for (int base = lo; base < hi; base += PT_POS) {
        __syncthreads();  // the previous tile's reads are done (and q_s is written)
        for (int i = threadIdx.x; i < PT_POS * (HD / 8); i += PT_THREADS) {
            const int p = i / (HD / 8);
            const int c = (i - p * (HD / 8)) * 8;
            const int pos = base + p;
            float kf[8], vf[8];
            if (pos < hi) {
                const int blk = table[pos / block_size];
                const int slot = pos - (pos / block_size) * block_size;
                const long long row =
                    (((long long)blk * num_kv_heads + kvh) * block_size + slot) * HD + c;
                load_half_vec<8>(k_cache + row, kf);
                load_half_vec<8>(v_cache + row, vf);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) kf[e] = vf[e] = 0.0f;
            }
            float* kd = k_s + p * KS + c;
            float* vd = v_s + p * HD + c;
            *(float4*)kd = make_float4(kf[0], kf[1], kf[2], kf[3]);
            *(float4*)(kd + 4) = make_float4(kf[4], kf[5], kf[6], kf[7]);
            *(float4*)vd = make_float4(vf[0], vf[1], vf[2], vf[3]);
            *(float4*)(vd + 4) = make_float4(vf[4], vf[5], vf[6], vf[7]);
        }
        __syncthreads();

        // Scores of position base + lane for the warp's rows.
        float s[RW];
#pragma unroll
        for (int i = 0; i < RW; i++) s[i] = 0.0f;
        const float* kr = k_s + lane * KS;
#pragma unroll 8
        for (int d = 0; d < HD; d += 4) {
            const float4 k4 = *(const float4*)(kr + d);
#pragma unroll
            for (int i = 0; i < RW; i++) {
                const float4 q4 = *(const float4*)(q_s + (warp * RW + i) * HD + d);
                s[i] = fmaf(q4.x, k4.x, s[i]);
                s[i] = fmaf(q4.y, k4.y, s[i]);
                s[i] = fmaf(q4.z, k4.z, s[i]);
                s[i] = fmaf(q4.w, k4.w, s[i]);
            }
        }
        const int pos = base + lane;
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const bool masked = pos >= hi || pos > pos_r[i];
            const float sc = masked ? neg_inf_f32() : s[i] * scale;
            const float m_new = fmaxf(m[i], warp_max(sc));
            float corr = 1.0f, p = 0.0f;
            if (m_new != neg_inf_f32()) {  // warp-uniform
                corr = expf(m[i] - m_new);  // 0 on the row's first scores (m = -inf)
                p = masked ? 0.0f : expf(sc - m_new);
            }
            l[i] = fmaf(l[i], corr, p);
            m[i] = m_new;
            p_s[warp * RW + i][lane] = p;
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[i][e] *= corr;
        }
        __syncthreads();  // the warp's weights are in p_s

        // Weighted V rows of the tile's positions.
        const int cnt = min(PT_POS, hi - base);
        for (int j = 0; j < cnt; j++) {
            float vv[VEC];
            const float* vr = v_s + j * HD + lane * VEC;
            if constexpr (VEC == 4) {
                const float4 v4 = *(const float4*)vr;
                vv[0] = v4.x; vv[1] = v4.y; vv[2] = v4.z; vv[3] = v4.w;
            } else {
                const float2 v2 = *(const float2*)vr;
                vv[0] = v2.x; vv[1] = v2.y;
            }
#pragma unroll
            for (int i = 0; i < RW; i++) {
                const float w = p_s[warp * RW + i][j];
#pragma unroll
                for (int e = 0; e < VEC; e++) acc[i][e] = fmaf(w, vv[e], acc[i][e]);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RW; i++) {
        const float total = warp_sum(l[i]);
        const int r = warp * RW + i;
        if (!row_exists(r)) continue;  // warp-uniform
        if (span.splits == 1) {
            // A row without positions (a padding token) gets zeros.
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            float* o = out + row_index(r) * HD + lane * VEC;
#pragma unroll
            for (int e = 0; e < VEC; e++) o[e] = acc[i][e] * inv;
        } else {
            float* o = part_out + (row_index(r) * span.splits + span.split) * (HD + 2);
#pragma unroll
            for (int e = 0; e < VEC; e++) o[lane * VEC + e] = acc[i][e];
            if (lane == 0) {
                o[HD] = m[i];
                o[HD + 1] = total;
            }
        }
    }
}

// paged_attention_tiles_f16
// Launch: grid = (tiles * num_kv_heads * parts * splits, 1, 1) with parts = ceil(group /
//         PT_ROWS), group = num_heads / num_kv_heads, and blockIdx.x = ((tile * num_kv_heads
//         + kv head) * parts + part) * splits + split; block = (PT_THREADS, 1, 1); dynamic
//         shared memory = 0 (about 43 KB static).
// Requirements: head_dim 64 or 128 (a CTA over another writes nothing), num_heads %
//   num_kv_heads == 0, block_size >= 1, caches 16-byte aligned. tile_first[i] is the first
//   token of tile i: tiles cover the tokens, each at most PT_ROWS / min(group, PT_ROWS)
//   consecutive tokens of one sequence (the tile ends early where its sequence does).
//   splits >= 1: with splits > 1, a tile whose tokens attend n positions cuts them into
//   runs of max(PT_MIN_SPLIT, ceil(n / splits) rounded up to PT_POS), split k taking run k
//   (none where k runs cover them already).
// Inputs as paged_attention_f16's. With splits == 1 the result is its too (a token with
//   token_pos[t] < 0 gets zeros) and part is not read or written (nullptr will do). With
//   splits > 1, split k of row (t, h) leaves in
//   part[((t * num_heads + h) * splits + k) * (head_dim + 2) ..]: head_dim unnormalised
//   sums of exp(score - m) * V over its positions, then m (their largest score; -inf for
//   none), then the sum of exp(score - m); attention_merge makes out of them.
extern "C" __global__ void paged_attention_tiles_f16(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache, float* out,
    float* part, const int* block_tables, const int* table_start, const int* token_pos,
    const int* token_seq, const int* tile_first, int tiles, int splits, int tokens,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale) {
    __shared__ __align__(16) float q_s[PT_ROWS * PT_MAX_HEAD_DIM];
    __shared__ __align__(16) float k_s[PT_POS * (PT_MAX_HEAD_DIM + 4)];
    __shared__ __align__(16) float v_s[PT_POS * PT_MAX_HEAD_DIM];
    __shared__ float p_s[PT_ROWS][PT_POS];
    if (blockDim.x != PT_THREADS || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        num_heads <= 0 || block_size <= 0 || splits < 1) {
        return;  // uniform over the CTA
    }
    const int group = num_heads / num_kv_heads;
    const int parts = (group + PT_ROWS - 1) / PT_ROWS;
    if ((long long)blockIdx.x >= (long long)tiles * num_kv_heads * parts * splits) return;
    int b = blockIdx.x;
    TileSpan span;
    span.split = b % splits;
    b /= splits;
    span.part = b % parts;
    b /= parts;
    span.kvh = b % num_kv_heads;
    span.first = tile_first[b / num_kv_heads];
    span.splits = splits;
#define PT_CALL(HD)                                                                          \
    paged_attention_tiles_body<HD>(q, k_cache, v_cache, out, part, block_tables, table_start, \
                                   token_pos, token_seq, span, tokens, num_heads,             \
                                   num_kv_heads, block_size, scale, q_s, k_s, v_s, p_s)
    if (head_dim == 64) {
        PT_CALL(64);
    } else if (head_dim == 128) {
        PT_CALL(128);
    }
#undef PT_CALL
}

// attention_merge
// Launch: grid = (rows, 1, 1) with rows = tokens * num_heads, block = (128, 1, 1), dynamic
//         shared memory = 0.
// Combines the splits paged_attention_tiles_f16 left in part (layout there) into
//   out[row, d] = sum_k acc_k[d] e^(m_k - M) / sum_k l_k e^(m_k - M),  M = max_k m_k,
// over the splits with positions (m_k > -inf); a row with none gets zeros.
extern "C" __global__ void attention_merge(const float* __restrict__ part, float* __restrict__ out,
                                           int rows, int splits, int head_dim) {
    if ((int)blockIdx.x >= rows) return;
    const float* p = part + (long long)blockIdx.x * splits * (head_dim + 2);
    float mx = neg_inf_f32();
    for (int k = 0; k < splits; k++) mx = fmaxf(mx, p[k * (head_dim + 2) + head_dim]);
    float total = 0.0f;
    for (int k = 0; k < splits; k++) {
        const float mk = p[k * (head_dim + 2) + head_dim];
        if (mk != neg_inf_f32()) total += p[k * (head_dim + 2) + head_dim + 1] * expf(mk - mx);
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int k = 0; k < splits; k++) {
            const float mk = p[k * (head_dim + 2) + head_dim];
            if (mk != neg_inf_f32()) o = fmaf(p[k * (head_dim + 2) + d], expf(mk - mx), o);
        }
        out[(long long)blockIdx.x * head_dim + d] = o * inv;
    }
}

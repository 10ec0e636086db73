"""attention.cu: kv_write_f16 (bit for bit), paged_attention_f16 and (head dims 64 and 128)
paged_attention_tiles_f16 against a numpy (f64) softmax attention over the same f16 cache:
head dims 32 / 36 / 64 / 80 / 128 / 256, grouped heads (up to 20 a KV head), block sizes
3..32, 1..16 warps, scattered block tables, several sequences in one launch, prefills and
extends cut into tiles, a padding token (position -1) and large scores (online-softmax
rescaling)."""

import numpy as np

from harness import Checks, kernel


def run_case(c, rng, head_dim, num_heads, num_kv_heads, block_size, warps, seq_lens, queries,
             qscale=1.0):
    kv_write = kernel("attention.cu", "kv_write_f16", "ppppppiiii")
    attention = kernel("attention.cu", "paged_attention_f16", "ppppppppiiiiif")
    what = (f"head_dim={head_dim} heads={num_heads}/{num_kv_heads} block_size={block_size} "
            f"warps={warps}")

    # Block tables: each sequence's blocks, taken from a shuffled pool, concatenated.
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    pool = rng.permutation(num_blocks).astype(np.int32)
    tables, starts, used = [], [], 0
    for n in seq_lens:
        nb = (n + block_size - 1) // block_size
        starts.append(len(tables))
        tables += list(pool[used:used + nb])
        used += nb
    block_tables = np.array(tables, np.int32)
    table_start = np.array(starts, np.int32)

    # Every position of every sequence written by one kv_write_f16 launch, plus one padding
    # token (block -1) that must be skipped.
    seq_pos = [(s, p) for s, n in enumerate(seq_lens) for p in range(n)]
    tokens = len(seq_pos) + 1
    k_all = rng.standard_normal((tokens, num_kv_heads, head_dim)).astype(np.float32)
    v_all = rng.standard_normal((tokens, num_kv_heads, head_dim)).astype(np.float32)
    token_block = np.array([block_tables[table_start[s] + p // block_size] for s, p in seq_pos]
                           + [-1], np.int32)
    token_slot = np.array([p % block_size for _, p in seq_pos] + [0], np.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = np.zeros(shape, np.uint16)
    v_cache = np.zeros(shape, np.uint16)
    kv_write(3, 64, k_cache, v_cache, k_all, v_all, token_block, token_slot, tokens,
             num_kv_heads, head_dim, block_size)
    k_ref = np.zeros(shape, np.float16)
    v_ref = np.zeros(shape, np.float16)
    for t in range(tokens - 1):
        k_ref[token_block[t], :, token_slot[t], :] = k_all[t].astype(np.float16)
        v_ref[token_block[t], :, token_slot[t], :] = v_all[t].astype(np.float16)
    c.true(f"kv_write_f16 {what}", np.array_equal(k_cache, k_ref.view(np.uint16))
           and np.array_equal(v_cache, v_ref.view(np.uint16)))

    # Queries: (sequence, position) pairs.
    token_seq = np.array([s for s, _ in queries], np.int32)
    token_pos = np.array([p for _, p in queries], np.int32)
    nt = len(queries)
    q = (rng.standard_normal((nt, num_heads, head_dim)) * qscale).astype(np.float32)
    out = np.full((nt, num_heads, head_dim), np.nan, np.float32)
    scale = 1.0 / np.sqrt(head_dim)
    attention(nt * num_heads, 32 * warps, q, k_cache, v_cache, out, block_tables, table_start,
              token_pos, token_seq, nt, num_heads, num_kv_heads, head_dim, block_size,
              np.float32(scale))

    kf, vf = k_ref.astype(np.float64), v_ref.astype(np.float64)
    group = num_heads // num_kv_heads
    want = np.zeros(out.shape)
    for t in range(nt):
        s, p = token_seq[t], token_pos[t]
        if p < 0:
            continue  # padding: zeros
        pos = np.arange(p + 1)
        blk = block_tables[table_start[s] + pos // block_size]
        slot = pos % block_size
        for h in range(num_heads):
            kk, vv = kf[blk, h // group, slot, :], vf[blk, h // group, slot, :]
            sc = scale * (kk @ q[t, h].astype(np.float64))
            e = np.exp(sc - sc.max())
            want[t, h] = (e / e.sum()) @ vv
    err = float(np.max(np.abs(out - want)))
    ok = err < 2e-5 * max(1.0, qscale) and np.isfinite(out).all()
    c.true(f"paged_attention_f16 {what} queries={nt} qscale={qscale}", ok, f"err {err:.3g}")
    if head_dim not in (64, 128):
        return

    # The same queries through the tiled kernel: tiles of consecutive queries of one
    # sequence at consecutive positions, at most 16 / min(group, 16) tokens each; the whole
    # context in one CTA, then split in 2, 3 and 40 (each tile's runs as long as its own
    # context needs, at least 64 positions: most of the 40 empty) and merged after.
    tiles_kernel = kernel("attention.cu", "paged_attention_tiles_f16", "ppppppppppiiiiiiif")
    merge = kernel("attention.cu", "attention_merge", "ppiii")
    gh = min(group, 16)
    tq, parts = 16 // gh, -(-group // gh)
    firsts = []
    for t in range(nt):
        run = t - firsts[-1] if firsts else tq
        same = t > 0 and token_seq[t] == token_seq[t - 1] and token_pos[t] == token_pos[t - 1] + 1
        if not same or run >= tq:
            firsts.append(t)
    tile_first = np.array(firsts, np.int32)
    for splits in (1, 2, 3, 40):
        out_t = np.full(out.shape, np.nan, np.float32)
        part = np.full((nt * num_heads, splits, head_dim + 2), np.nan, np.float32)
        tiles_kernel(len(firsts) * num_kv_heads * parts * splits, 128, q, k_cache, v_cache,
                     out_t, part, block_tables, table_start, token_pos, token_seq, tile_first,
                     len(firsts), splits, nt, num_heads, num_kv_heads, head_dim,
                     block_size, np.float32(scale))
        if splits > 1:
            c.true(f"paged_attention_tiles_f16 splits leave out alone {what}",
                   np.isnan(out_t).all() and not np.isnan(part).any())
            merge(nt * num_heads, 128, part, out_t, nt * num_heads, splits, head_dim)
        err = float(np.max(np.abs(out_t - want)))
        ok = err < 2e-5 * max(1.0, qscale) and np.isfinite(out_t).all()
        c.true(f"paged_attention_tiles_f16 {what} queries={nt} tiles={len(firsts)} "
               f"splits={splits} qscale={qscale}", ok, f"err {err:.3g}")


def main():
    c = Checks()
    rng = np.random.default_rng(11)
    run_case(c, rng, 64, 4, 2, 16, 4, [41, 6, 73],
             [(0, 40), (1, 0), (1, 1), (1, 5), (2, 70), (2, 72), (2, 31), (0, 32)])
    run_case(c, rng, 128, 2, 1, 5, 2, [100, 33],
             [(0, 99), (1, 32), (1, 0), (0, 64), (0, 63), (0, 95)])
    run_case(c, rng, 128, 2, 2, 16, 16, [300], [(0, 299), (0, 10)])
    run_case(c, rng, 80, 3, 1, 7, 4, [50], [(0, 49), (0, 0), (0, 31), (0, 32)])
    run_case(c, rng, 256, 2, 1, 16, 8, [70], [(0, 69), (0, 3)])
    run_case(c, rng, 32, 2, 1, 3, 1, [40], [(0, 39), (0, 33)])
    run_case(c, rng, 36, 2, 2, 4, 4, [45], [(0, 44), (0, 1)])
    run_case(c, rng, 64, 1, 1, 16, 4, [10], [(0, 9), (0, -1)])
    run_case(c, rng, 128, 4, 1, 16, 8, [1000], [(0, 999), (0, 500)], qscale=30.0)
    run_case(c, rng, 64, 2, 1, 32, 4, [600], [(0, 599)], qscale=100.0)
    # Prefills and extends: runs of consecutive positions, several sequences, group sizes
    # 1..20 (parts of a group of more than 16 heads), tiles cut short where a run ends.
    run_case(c, rng, 128, 8, 2, 16, 4, [70, 45],
             [(0, p) for p in range(70)] + [(1, p) for p in range(37, 45)])
    run_case(c, rng, 64, 14, 2, 16, 4, [100, 20, 9],
             [(0, p) for p in range(60, 100)] + [(1, p) for p in range(20)] + [(2, 8)])
    run_case(c, rng, 64, 3, 3, 5, 4, [50], [(0, p) for p in range(50)])
    run_case(c, rng, 128, 20, 1, 16, 4, [40], [(0, p) for p in range(33, 40)] + [(0, -1)])
    run_case(c, rng, 64, 7, 1, 32, 4, [300], [(0, p) for p in range(250, 300)], qscale=30.0)
    c.finish()


if __name__ == "__main__":
    main()

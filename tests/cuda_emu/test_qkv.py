"""attention.cu: qkv_rotary_write_f16 (a stacked q/k/v projection's per-head norms, rotary
and K/V write in one launch) against numpy (f64): both rotary layouts, with and without q/k
norms, head dims 32 / 64 / 128 / 256, grouped heads, rows wider than q/k/v (a stride), a
padding token whose K/V are not written, scattered cache slots."""

import numpy as np

from harness import Checks, kernel


def rotate(x, pos, inv_freq, neox):
    """x: [heads, head_dim] (f64), rotated at position pos."""
    half = x.shape[1] // 2
    ang = pos * inv_freq.astype(np.float64)
    cos, sin = np.cos(ang), np.sin(ang)
    out = x.copy()
    if neox:
        a, b = x[:, :half], x[:, half:]
        out[:, :half], out[:, half:] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[:, 0::2], x[:, 1::2]
        out[:, 0::2], out[:, 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def norm(x, w, eps):
    """Each row of x ([heads, head_dim], f64) normalised by w, or x where w is None."""
    if w is None:
        return x
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w


def run_case(c, rng, head_dim, heads, kv_heads, neox, norms, block_size, extra_cols):
    fused = kernel("attention.cu", "qkv_rotary_write_f16", "pipfpfppipppppiiiii")
    what = (f"head_dim={head_dim} heads={heads}/{kv_heads} neox={neox} norms={norms} "
            f"block_size={block_size} stride+{extra_cols}")
    tokens = 5
    width = (heads + 2 * kv_heads) * head_dim
    stride = width + extra_cols
    qkv = (rng.standard_normal((tokens, stride)) * 2).astype(np.float32)
    q_norm = rng.standard_normal(head_dim).astype(np.float32) if norms else None
    k_norm = rng.standard_normal(head_dim).astype(np.float32) if norms else None
    eps = 1e-6
    positions = rng.integers(0, 4000, tokens).astype(np.uint32)
    inv_freq = (1e6 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    num_blocks = 7
    slots = rng.permutation(num_blocks * block_size)[:tokens]
    token_block = (slots // block_size).astype(np.int32)
    token_slot = (slots % block_size).astype(np.int32)
    token_block[3] = -1  # padding: no K/V written
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = np.zeros(shape, np.uint16)
    v_cache = np.zeros(shape, np.uint16)
    q = np.full((tokens, heads, head_dim), np.nan, np.float32)
    rows = tokens * (heads + 2 * kv_heads)
    fused((rows + 3) // 4, 128, qkv, stride, q_norm, eps, k_norm, eps, positions, inv_freq,
          int(neox), token_block, token_slot, q, k_cache, v_cache, tokens, heads, kv_heads,
          head_dim, block_size)

    q_want = np.zeros(q.shape)
    k_want = np.zeros(shape)
    v_want = np.zeros(shape)
    for t in range(tokens):
        row = qkv[t, :width].astype(np.float64)
        qs = row[:heads * head_dim].reshape(heads, head_dim)
        ks = row[heads * head_dim:(heads + kv_heads) * head_dim].reshape(kv_heads, head_dim)
        vs = row[(heads + kv_heads) * head_dim:].reshape(kv_heads, head_dim)
        q_want[t] = rotate(norm(qs, q_norm, eps), float(positions[t]), inv_freq, neox)
        if token_block[t] >= 0:
            k_want[token_block[t], :, token_slot[t]] = rotate(
                norm(ks, k_norm, eps), float(positions[t]), inv_freq, neox)
            v_want[token_block[t], :, token_slot[t]] = vs
    # Angles reach 4000 radians: f32's position times frequency is off by up to 2e-4 there.
    c.close(f"qkv_rotary_write_f16 q {what}", q, q_want, 2e-3)
    k_got = k_cache.view(np.float16).astype(np.float64)
    v_got = v_cache.view(np.float16).astype(np.float64)
    c.close(f"qkv_rotary_write_f16 k {what}", k_got, k_want, 3e-3)
    c.close(f"qkv_rotary_write_f16 v {what}", v_got, v_want, 1e-3)
    c.true(f"qkv_rotary_write_f16 padding writes no K/V {what}",
           np.count_nonzero(k_cache) == np.count_nonzero(k_want.astype(np.float16))
           and np.count_nonzero(v_cache) == np.count_nonzero(v_want.astype(np.float16)))


def main():
    c = Checks()
    rng = np.random.default_rng(5)
    # Qwen3 (neox, q/k norms, four heads a KV head), Qwen2 (neox), Llama (pairs), and other
    # head sizes.
    run_case(c, rng, 128, 4, 1, True, True, 16, 0)
    run_case(c, rng, 64, 14, 2, True, False, 16, 8)
    run_case(c, rng, 64, 4, 2, False, False, 5, 0)
    run_case(c, rng, 32, 3, 1, False, True, 4, 3)
    run_case(c, rng, 256, 2, 1, True, True, 8, 0)
    run_case(c, rng, 128, 2, 2, False, True, 16, 0)
    c.finish()


if __name__ == "__main__":
    main()

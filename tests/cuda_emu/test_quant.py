"""quant.cu: dequant_rows_*, dequant_f16_*, matvec_* (small matrices, every batch 1..=8) for
every format against gguf-py's dequantize and numpy; f32_to_f16 / f32_to_bf16 / f16_to_f32
bit for bit against numpy."""

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from harness import Checks, elementwise_grid, kernel

# (name, type, values per block, bytes per block, offsets of the block's f16 scales)
QUANT_FORMATS = [
    ("q4_0", Q.Q4_0, 32, 18, [0]),
    ("q4_1", Q.Q4_1, 32, 20, [0, 2]),
    ("q5_0", Q.Q5_0, 32, 22, [0]),
    ("q8_0", Q.Q8_0, 32, 34, [0]),
    ("q4_k", Q.Q4_K, 256, 144, [0, 2]),
    ("q6_k", Q.Q6_K, 256, 210, [208]),
]


def make_quant(rng, rows, cols, qk, nbytes, f16_offs):
    """Random blocks (every byte random) with small finite f16 scales, [rows, bytes]."""
    nb = cols // qk
    raw = rng.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)
    for off in f16_offs:
        vals = (rng.standard_normal((rows, nb)) * 0.05).astype(np.float16)
        raw[:, :, off:off + 2] = vals.view(np.uint8).reshape(rows, nb, 2)
    return np.ascontiguousarray(raw.reshape(rows, nb * nbytes))


def make_dense(rng, name, rows, cols):
    """A dense matrix's bytes and its exact f32 values."""
    v = rng.standard_normal((rows, cols)).astype(np.float32)
    if name == "f32":
        return v.view(np.uint8).reshape(rows, cols * 4).copy(), v
    if name == "f16":
        h = v.astype(np.float16)
        return h.view(np.uint8).reshape(rows, cols * 2).copy(), h.astype(np.float32)
    b = (v.view(np.uint32) >> 16).astype(np.uint16)  # bf16: the high half of an f32
    exact = (b.astype(np.uint32) << 16).view(np.float32)
    return b.view(np.uint8).reshape(rows, cols * 2).copy(), exact


def matvec_err(k, rng, w, ref, rows, cols, batch, block):
    """Runs matvec for one batch; the worst error relative to sum |x| |W|, and whether the
    row past the output is untouched."""
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    y = np.full((batch + 1, rows), np.nan, dtype=np.float32)
    k((rows + 3) // 4, block, w, x, y, rows, cols, batch)
    ref64 = ref.astype(np.float64)
    want = x.astype(np.float64) @ ref64.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(ref64).T
    got = y[:batch]
    err = float(np.max(np.abs(got - want) / (scale + 1e-30)))
    if not np.isfinite(got).all():
        err = float("inf")
    return err, bool(np.isnan(y[batch]).all())


def differ(same):
    return "" if same.all() else f"{int((~same).sum())} differ"


def main():
    c = Checks()
    rng = np.random.default_rng(1234)
    cases = []
    for (name, qt, qk, nbytes, offs) in QUANT_FORMATS:
        for cols in ([qk, 3 * qk] if qk == 256 else [32, 96, 160]):
            w = make_quant(rng, 9, cols, qk, nbytes, offs)
            ref = dequantize(w, qt).astype(np.float32).reshape(9, cols)
            cases.append((name, w, ref, cols))
    for name in ["f32", "f16", "bf16"]:
        for cols in [16, 48, 37, 5]:  # 37 and 5: the scalar paths
            w, ref = make_dense(rng, name, 9, cols)
            cases.append((name, w, ref, cols))

    for (name, w, ref, cols) in cases:
        rows = w.shape[0]
        dense_scalar = name in ("f32", "f16", "bf16") and cols % 16 != 0

        # dequant_rows: a small grid (grid-stride loop) and the documented launch.
        k = kernel("quant.cu", f"dequant_rows_{name}", "ppiip")
        idx = np.array([3, 0, 8, 3, 5], dtype=np.uint32)
        n_work = len(idx) * cols if dense_scalar else len(idx) * cols // 16
        for grid, block in [(2, 64), (elementwise_grid(n_work), 256)]:
            out = np.full((len(idx) + 1, cols), np.nan, dtype=np.float32)
            k(grid, block, w, idx, len(idx), cols, out)
            what = f"dequant_rows_{name} cols={cols} grid={grid} block={block}"
            c.close(what, out[:-1], ref[idx], 2e-6)
            c.true(f"{what} writes nothing past out", np.isnan(out[-1]).all())

        # dequant_f16: against the f32 values rounded to f16 by numpy.
        if name != "f16":
            k = kernel("quant.cu", f"dequant_f16_{name}", "ppii")
            out16 = np.full((rows + 1, cols), 0x7e00, dtype=np.uint16)
            k(3, 32, w, out16, rows, cols)
            got = out16[:-1].view(np.float16).astype(np.float32)
            c.close(f"dequant_f16_{name} cols={cols}", got,
                    ref.astype(np.float16).astype(np.float32), 1e-3)
            c.true(f"dequant_f16_{name} cols={cols} writes nothing past out",
                   (out16[-1] == 0x7e00).all())

        # matvec: every batch 1..=8, two block sizes.
        k = kernel("quant.cu", f"matvec_{name}", "pppiii")
        errs, clean = [], True
        for batch in range(1, 9):
            err, untouched = matvec_err(k, rng, w, ref, rows, cols, batch,
                                        128 if batch % 2 else 64)
            errs.append(err)
            clean &= untouched
        c.true(f"matvec_{name} cols={cols} batch 1..=8", max(errs) < 1e-5,
               f"worst err {max(errs):.3g}")
        c.true(f"matvec_{name} cols={cols} writes nothing past y", clean)
        # A batch outside 1..=8 writes nothing.
        y = np.full((1, rows), 7.0, dtype=np.float32)
        x = np.ones((9, cols), dtype=np.float32)
        k((rows + 3) // 4, 128, w, x, y, rows, cols, 9)
        c.true(f"matvec_{name} cols={cols} batch=9 writes nothing", (y == 7.0).all())

    # f32 -> f16 / bf16, with the edge cases (overflow, ties, subnormals, NaN, inf).
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 6e-5,
                        2.0 ** -25, 3 * 2.0 ** -26, 3.4e38, 1.00048828125, 1.0014648],
                       dtype=np.float32)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 100, special,
                        rng.integers(0, 2 ** 32, 4000, dtype=np.uint32).view(np.float32)])
    n = len(x)
    for kname in ["f32_to_f16", "f32_to_bf16"]:
        y = np.full(n + 1, 0x1234, dtype=np.uint16)
        kernel("quant.cu", kname, "ppi")(2, 64, x, y, n)
        if kname == "f32_to_f16":
            with np.errstate(over="ignore", invalid="ignore"):
                want = x.astype(np.float16).view(np.uint16)
            nan_ok = ((y[:n] & 0x7c00) == 0x7c00) & ((y[:n] & 0x3ff) != 0)
        else:
            u = x.view(np.uint32).astype(np.uint64)
            want = ((u + 0x7fff + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            want = np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), want)
            nan_ok = y[:n] == want
        same = np.where(np.isnan(x), nan_ok, y[:n] == want)
        c.true(f"{kname} bit-exact ({n} values)", same.all(), differ(same))
        c.true(f"{kname} writes nothing past y", y[n] == 0x1234)

    # f16 -> f32: every one of the 65536 bit patterns, small grid and documented launch.
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    for grid, block in [(3, 64), (elementwise_grid(len(h)), 256)]:
        y = np.full(len(h) + 1, 5.0, dtype=np.float32)
        kernel("quant.cu", "f16_to_f32", "ppi")(grid, block, h, y, len(h))
        nan = np.isnan(want)
        same = np.where(nan, np.isnan(y[:-1]), y[:-1].view(np.uint32) == want.view(np.uint32))
        what = f"f16_to_f32 grid={grid} block={block}"
        c.true(f"{what} all 65536 patterns", same.all(), differ(same))
        c.true(f"{what} writes nothing past y", y[-1] == 5.0)
    # n smaller than the buffer: only the first n are written.
    y = np.full(300, 5.0, dtype=np.float32)
    kernel("quant.cu", "f16_to_f32", "ppi")(1, 256, h[:300], y, 257)
    c.true("f16_to_f32 n=257 stops at n",
           (y[:257].view(np.uint32) == want[:257].view(np.uint32)).all() and (y[257:] == 5.0).all())
    c.finish()


if __name__ == "__main__":
    main()

"""quant.cu: matmul_tc_* (the tensor-core product of decode batches) for every format, with
partial row tiles, a partial last column tile, every batch-tile width (8, 16, 32), several
batch tiles and column slices, against gguf-py's dequantize and numpy; sum_slices against
numpy."""

import numpy as np
from gguf.quants import dequantize

from harness import Checks, elementwise_grid, kernel
from test_quant import QUANT_FORMATS, make_dense, make_quant


def run_tc(k, w, values, rows, cols, batch, bn, tiles_per_slice, rng):
    """One launch; the worst error relative to sum |x| |W| (both rounded to f16, as the kernel
    multiplies them), and whether the plane past the slices is untouched."""
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    xh = x.astype(np.float16)
    ktiles = (cols + 255) // 256
    slices = (ktiles + tiles_per_slice - 1) // tiles_per_slice
    y = np.full((slices + 1, batch, rows), np.nan, dtype=np.float32)
    grid = ((rows + 31) // 32, (batch + bn - 1) // bn, slices)
    k(grid, 128, w, xh.view(np.uint16), y, rows, cols, batch, bn, tiles_per_slice)
    wh = values.astype(np.float16).astype(np.float64)
    want = xh.astype(np.float64) @ wh.T
    scale = np.abs(xh.astype(np.float64)) @ np.abs(wh).T
    got = y[:slices].astype(np.float64).sum(axis=0)
    err = float(np.max(np.abs(got - want) / (scale + 1e-30)))
    if not np.isfinite(got).all():
        err = float("inf")
    return err, bool(np.isnan(y[slices]).all())


def main():
    c = Checks()
    rng = np.random.default_rng(4321)
    cases = []
    for (name, qt, qk, nbytes, offs) in QUANT_FORMATS:
        cols = 512 if qk == 256 else 352  # 352: a last tile of 96 columns
        w = make_quant(rng, 37, cols, qk, nbytes, offs)
        cases.append((name, w, dequantize(w, qt).astype(np.float32).reshape(37, cols), cols))
    for name in ["f32", "f16", "bf16"]:
        for cols in [48, 272]:
            w, values = make_dense(rng, name, 37, cols)
            cases.append((name, w, values, cols))
    # (The emulated tensor-core step is slow: every format once with two column tiles in one
    # slice, a few more for the batch-tile widths and for slices.)
    for name, w, values, cols in cases:
        k = kernel("quant.cu", f"matmul_tc_{name}", "pppiiiii")
        shapes = [(13, 16, 2)]
        if name in ("q4_k", "q4_0", "bf16") and cols != 48:
            shapes += [(3, 8, 1), (33, 32, 1)]
        for batch, bn, tiles in shapes:
            err, untouched = run_tc(k, w, values, 37, cols, batch, bn, tiles, rng)
            c.true(f"matmul_tc_{name} 37x{cols} batch={batch} bn={bn} tiles/slice={tiles}",
                   err < 1e-5 and untouched,
                   f"err {err:.3g}" + ("" if untouched else ", wrote past its slices"))

    k = kernel("quant.cu", "sum_slices", "ppii")
    for slices, n in [(1, 5), (3, 1000), (7, 70000)]:
        parts = rng.standard_normal((slices, n)).astype(np.float32)
        y = np.full(n + 1, np.nan, dtype=np.float32)
        k(elementwise_grid(n), 256, parts, y, slices, n)
        want = np.zeros(n, dtype=np.float32)
        for z in range(slices):
            want += parts[z]  # in order of z, in f32, as the kernel sums
        c.true(f"sum_slices {slices}x{n}", np.array_equal(y[:n], want) and np.isnan(y[n]))
    c.finish()


if __name__ == "__main__":
    main()

"""ops.cu: rms_norm (also in place), add_rms_norm (with and without add, out == x),
add_in_place, add_bias, silu_mul on a fused [rows, 2w] buffer, rotary (both layouts),
copy_columns and gather_rows, against numpy (f64)."""

import numpy as np

from harness import Checks, elementwise_grid, kernel


def rms_ref(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w


def main():
    c = Checks()
    rng = np.random.default_rng(7)
    rms_norm = kernel("ops.cu", "rms_norm", "pppif")
    add_rms_norm = kernel("ops.cu", "add_rms_norm", "ppppif")

    # The register path (cols a multiple of 4, at most 32 a thread) and the strided one
    # (4096 on 32 threads, 37, 1).
    for cols, block in [(576, 256), (37, 32), (128, 64), (4096, 1024), (1, 32), (4096, 256),
                        (4096, 32), (5120, 256), (1028, 32)]:
        rows = 3
        x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
        w = rng.standard_normal(cols).astype(np.float32)
        out = np.zeros_like(x)
        rms_norm(rows, block, x, w, out, cols, 1e-6)
        c.close(f"rms_norm cols={cols} block={block}", out, rms_ref(x, w, 1e-6), 2e-6)
        xi = x.copy()
        rms_norm(rows, block, xi, w, xi, cols, 1e-6)
        c.equal(f"rms_norm in place cols={cols}", xi, out)

        a = rng.standard_normal((rows, cols)).astype(np.float32)
        x2, out2 = x.copy(), np.zeros_like(x)
        add_rms_norm(rows, block, x2, a, w, out2, cols, 1e-5)
        c.equal(f"add_rms_norm x += add cols={cols}", x2, x + a)
        c.close(f"add_rms_norm out cols={cols}", out2, rms_ref(x + a, w, 1e-5), 2e-6)
        x3, out3 = x.copy(), np.zeros_like(x)
        add_rms_norm(rows, block, x3, None, w, out3, cols, 1e-5)
        c.close(f"add_rms_norm add=nullptr cols={cols}", out3, rms_ref(x, w, 1e-5), 2e-6)
        c.equal(f"add_rms_norm add=nullptr leaves x cols={cols}", x3, x)
        x4 = x.copy()
        add_rms_norm(rows, block, x4, a, w, x4, cols, 1e-5)
        c.close(f"add_rms_norm out == x cols={cols}", x4, rms_ref(x + a, w, 1e-5), 2e-6)

    # Rows that are not 16-byte aligned take the strided path: rows of 4 + 4k floats offset
    # by one float.
    cols = 64
    xb = (rng.standard_normal((2, cols + 1)) * 3).astype(np.float32)
    xo = xb[:, 1:].copy()
    w = rng.standard_normal(cols).astype(np.float32)
    flat = np.concatenate([[0.0], xo.ravel()]).astype(np.float32)
    outb = np.zeros(2 * cols + 1, np.float32)
    view = flat[1:]
    assert view.ctypes.data % 16 != 0
    rms_norm(2, 32, view, w, outb[1:], cols, 1e-6)
    c.close("rms_norm rows not 16-byte aligned", outb[1:].reshape(2, cols),
            rms_ref(xo, w, 1e-6), 2e-6)

    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    x0 = x.copy()
    kernel("ops.cu", "add_in_place", "ppq")(2, 64, x, y, n)
    c.equal("add_in_place", x, x0 + y)

    rows, cols = 7, 33
    yb = rng.standard_normal((rows, cols)).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    y0 = yb.copy()
    kernel("ops.cu", "add_bias", "ppii")(1, 64, yb, b, rows, cols)
    c.equal("add_bias", yb, y0 + b)

    # silu_mul on a fused buffer: gate = columns [off, off + width), up = the next width.
    silu_mul = kernel("ops.cu", "silu_mul", "pppiiii")
    for rows, width, off in [(5, 70, 3), (4, 64, 0)]:
        stride = off + 2 * width
        fused = (rng.standard_normal((rows, stride)) * 4).astype(np.float32)
        gate, up = fused[:, off:off + width], fused[:, off + width:]
        flat = fused.reshape(-1)
        out = np.zeros((rows, width), np.float32)
        silu_mul(3, 32, flat[off:], flat[off + width:], out, rows, width, stride, stride)
        g64 = gate.astype(np.float64)
        c.close(f"silu_mul fused rows={rows} width={width} offset={off}", out,
                g64 / (1 + np.exp(-g64)) * up, 1e-6)

    rotary = kernel("ops.cu", "rotary", "pppiiii")
    for neox in [0, 1]:
        for hd in [64, 8, 128]:
            tokens, heads = 4, 3
            x = rng.standard_normal((tokens, heads, hd)).astype(np.float32)
            pos = np.array([0, 7, 1000, 31], dtype=np.uint32)
            exponent = np.arange(0, hd, 2, dtype=np.float32) / hd
            inv = (1.0 / (10000.0 ** exponent)).astype(np.float32)
            xr = x.copy()
            rotary(2, 64, xr, pos, inv, tokens, heads, hd, neox)
            ang = (pos[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)
            cs, sn = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
            want = x.astype(np.float64).copy()
            half = hd // 2
            if neox:
                a, bb = want[..., :half].copy(), want[..., half:].copy()
                want[..., :half], want[..., half:] = a * cs - bb * sn, a * sn + bb * cs
            else:
                a, bb = want[..., 0::2].copy(), want[..., 1::2].copy()
                want[..., 0::2], want[..., 1::2] = a * cs - bb * sn, a * sn + bb * cs
            c.close(f"rotary neox={neox} head_dim={hd}", xr, want, 2e-6)

    rows, stride, off, width = 6, 50, 13, 20
    src = rng.standard_normal((rows, stride)).astype(np.float32)
    dst = np.zeros((rows, width), np.float32)
    kernel("ops.cu", "copy_columns", "ppiiii")(1, 32, src, dst, rows, stride, off, width)
    c.equal("copy_columns", dst, src[:, off:off + width])

    # gather_rows: repeated and unordered rows, odd widths, a grid smaller than the work and
    # the documented launch; the row past dst stays untouched.
    gather_rows = kernel("ops.cu", "gather_rows", "pppii")
    for src_rows, width, picks in [(9, 37, [8, 0, 3, 3, 7]), (5, 1, [4, 0, 1]),
                                   (300, 896, [299, 0, 150, 1]), (4, 64, [2])]:
        src = rng.standard_normal((src_rows, width)).astype(np.float32)
        rows_ = np.array(picks, dtype=np.uint32)
        n = len(picks) * width
        for grid, block in [(1, 32), (elementwise_grid(n), 256)]:
            dst = np.full((len(picks) + 1, width), np.nan, np.float32)
            gather_rows(grid, block, src, rows_, dst, len(picks), width)
            what = f"gather_rows {len(picks)} of {src_rows}x{width} grid={grid} block={block}"
            c.equal(what, dst[:-1], src[rows_])
            c.true(f"{what} writes nothing past dst", np.isnan(dst[-1]).all())
    c.finish()


if __name__ == "__main__":
    main()

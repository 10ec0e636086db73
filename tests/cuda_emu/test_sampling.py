"""sampling.cu: row_softmax_stats (max, lowest argmax, logsumexp, entropy) against numpy
(f64): random rows, ties, masked (-inf) and NaN logits, all-masked / all-NaN / uniform /
peaked rows, block sizes 32 / 256 / 1024, nullptr outputs, a 151936-entry vocabulary."""

import numpy as np

from harness import Checks, kernel


def reference(row):
    """(max, argmax, logsumexp, entropy) as the kernel documents them."""
    r = row.astype(np.float64)
    ok = ~np.isnan(r)
    m = r[ok].max() if ok.any() else -np.inf
    am = int(np.argmax(np.where(ok, r, -np.inf) == m)) if ok.any() else 0
    if not np.isfinite(m):
        return m, am, m, 0.0
    d = np.maximum(np.where(ok, r - m, -88.0), -88.0)
    e = np.exp(d)
    z = e.sum()
    return m, am, m + np.log(z), np.log(z) - (e * d).sum() / z


def matches(got, want, lse_tol, ent_tol):
    (m, am, lse, ent), (wm, wam, wlse, went) = got, want
    same_m = m == wm or (np.isnan(m) and np.isnan(wm))
    if np.isfinite(wlse):
        same_lse = abs(lse - wlse) <= lse_tol * max(1, abs(wlse))
    else:
        same_lse = lse == wlse
    return same_m and am == wam and same_lse and abs(ent - went) <= ent_tol * max(1, abs(went))


def show(got):
    m, am, lse, ent = got
    return f"max {float(m):g} argmax {int(am)} logsumexp {float(lse):g} entropy {float(ent):g}"


def main():
    c = Checks()
    rng = np.random.default_rng(3)
    stats = kernel("sampling.cu", "row_softmax_stats", "pipppp")
    vocab = 1000
    rows = [("random", (rng.standard_normal(vocab) * 3).astype(np.float32)) for _ in range(4)]
    r = np.zeros(vocab, np.float32)
    r[5] = r[700] = 2
    r[3] = 1
    rows.append(("tie -> lowest index", r))
    r = np.full(vocab, -np.inf, np.float32)
    r[3] = r[900] = 0.5
    r[10] = np.nan
    rows.append(("two finite, masked, NaN", r))
    rows.append(("all -inf", np.full(vocab, -np.inf, np.float32)))
    rows.append(("uniform", np.zeros(vocab, np.float32)))
    rows.append(("all NaN", np.full(vocab, np.nan, np.float32)))
    r = np.zeros(vocab, np.float32)
    r[999] = 100
    rows.append(("peaked", r))
    logits = np.stack([r for _, r in rows])
    n = len(rows)
    for block in [32, 256, 1024]:
        mx, lse, ent = (np.zeros(n, np.float32) for _ in range(3))
        am = np.full(n, -5, np.int32)
        stats(n, block, logits, vocab, mx, lse, ent, am)
        for i, (label, row) in enumerate(rows):
            got = (mx[i], am[i], lse[i], ent[i])
            c.true(f"row_softmax_stats block={block} {label}",
                   matches(got, reference(row), 1e-5, 2e-5), show(got))

    # nullptr outputs: only the entropy.
    ent = np.full(n, 9.0, np.float32)
    stats(n, 64, logits, vocab, None, None, ent, None)
    want = np.array([reference(r)[3] for _, r in rows])
    c.true("row_softmax_stats nullptr outputs skipped",
           np.allclose(ent, want, rtol=2e-5, atol=2e-5))

    big = (rng.standard_normal(151936) * 5).astype(np.float32)[None, :]
    out = [np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.float32),
           np.zeros(1, np.int32)]
    stats(1, 1024, big, 151936, *out)
    got = (out[0][0], out[3][0], out[1][0], out[2][0])
    c.true("row_softmax_stats vocab=151936 block=1024",
           matches(got, reference(big[0]), 1e-5, 1e-4), show(got))
    c.finish()


if __name__ == "__main__":
    main()

"""quant.cu: matvec_* of every quantized format on a wider matrix (37 rows, 1024 or 1120
columns: many units per thread, a partial last CTA) for batches 1, 2, 3, 4, 5 and 8, against
gguf-py's dequantize and numpy."""

import numpy as np
from gguf.quants import dequantize

from harness import Checks, kernel
from test_quant import QUANT_FORMATS, make_quant, matvec_err


def main():
    c = Checks()
    rng = np.random.default_rng(99)
    for (name, qt, qk, nbytes, offs) in QUANT_FORMATS:
        rows, cols = 37, (1024 if qk == 256 else 1024 + 96)
        w = make_quant(rng, rows, cols, qk, nbytes, offs)
        ref = dequantize(w, qt).astype(np.float32).reshape(rows, cols)
        k = kernel("quant.cu", f"matvec_{name}", "pppiii")
        for batch in [1, 2, 3, 4, 5, 8]:
            err, untouched = matvec_err(k, rng, w, ref, rows, cols, batch, 128)
            c.true(f"matvec_{name} {rows}x{cols} batch={batch}", err < 1e-5 and untouched,
                   f"err {err:.3g}" + ("" if untouched else ", wrote past y"))
    c.finish()


if __name__ == "__main__":
    main()

"""What every test file shares: launching an emulated kernel from numpy arrays, and checks
that print one line each ("ok   name detail" or "FAIL name detail").

The libraries come from $CUDA_EMU_BUILD_DIR when run.py set it (it builds every kernel file
once, first); a test file run alone builds what it needs into build.DEFAULT_BUILD_DIR.
"""

import ctypes
import os
import sys

import numpy as np

import build

_libs = {}

# Argument kinds in a signature string: p pointer (a numpy array, or None for nullptr),
# i int, q long long, f float.
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_longlong, "f": ctypes.c_float}


def _lib(fname):
    if fname not in _libs:
        build_dir = os.environ.get("CUDA_EMU_BUILD_DIR")
        if build_dir:
            so = os.path.join(build_dir, fname + ".so")
        else:
            so, warnings = build.build(fname)
            if warnings:
                print(warnings, file=sys.stderr)
        _libs[fname] = ctypes.CDLL(so)
    return _libs[fname]


def kernel(fname, name, sig):
    """The kernel `name` of kernel file `fname` as a function (grid, block, *args); `sig`
    gives the kinds of its arguments, one letter each (see _CTYPES), and must match the
    kernel's C signature."""
    addr = ctypes.c_void_p.in_dll(_lib(fname), "L_" + name).value
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 4, *[_CTYPES[c] for c in sig])(addr)

    def call(grid, block, *args):
        """`grid`: the number of blocks, or an (x, y, z) tuple."""
        assert len(args) == len(sig), f"{name}: {len(args)} arguments for {len(sig)}"
        conv = []
        for kind, a in zip(sig, args):
            if kind == "p":
                if a is not None:
                    assert isinstance(a, np.ndarray) and a.flags.c_contiguous, name
                conv.append(None if a is None else ctypes.c_void_p(a.ctypes.data))
            else:
                conv.append(a)
        gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
        fn(gx, gy, gz, block, *conv)

    return call


def elementwise_grid(n):
    """The suggested element-wise launch's grid for n elements (block 256)."""
    return max(1, min((n + 255) // 256, 65535))


class Checks:
    """Counts and prints checks; `finish` exits non-zero if any failed."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def true(self, name, ok, detail=""):
        ok = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{'  ' + detail if detail else ''}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        return ok

    def close(self, name, got, want, tol):
        """max |got - want| / (|want| + 1) <= tol, and got all finite."""
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        err = float(np.max(np.abs(got - want) / (np.abs(want) + 1.0))) if want.size else 0.0
        return self.true(name, err <= tol and np.isfinite(got).all(), f"err {err:.3g}")

    def equal(self, name, got, want):
        """Same shape, same values (bit for bit for equal dtypes)."""
        got = np.asarray(got)
        want = np.asarray(want)
        ok = got.shape == want.shape and np.array_equal(got, want)
        bad = int(np.sum(got != want)) if got.shape == want.shape else -1
        return self.true(name, ok, "" if ok else f"{bad} differ")

    def finish(self):
        print(f"# {self.passed} passed, {self.failed} failed", flush=True)
        sys.exit(1 if self.failed else 0)

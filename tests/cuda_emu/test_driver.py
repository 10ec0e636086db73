"""The emulated driver (driver.cpp) and cuBLASLt (cublaslt.cpp) that tests/cuda_parity.rs runs
the CUDA backend on: called through ctypes as cudarc calls them, against what a device does
(a capture records instead of running, a replay runs again, host copies invalidate a capture)
and the checks it adds (poisoned new memory, copies inside allocations, guard zones). The
checks that abort the process run in a child process each.
"""

import ctypes
import os
import subprocess
import sys

import numpy as np

import build
from harness import Checks

c = Checks()
BUILD_DIR = os.environ.get("CUDA_EMU_BUILD_DIR", build.DEFAULT_BUILD_DIR)
if not os.environ.get("CUDA_EMU_BUILD_DIR"):
    build.build("ops.cu", BUILD_DIR)
    build.build_driver(BUILD_DIR)
DRIVER = os.path.join(BUILD_DIR, "driver")
cu = ctypes.CDLL(os.path.join(DRIVER, "libcuda.so"))
lt = ctypes.CDLL(os.path.join(DRIVER, "libcublasLt.so"))
u64, vp = ctypes.c_uint64, ctypes.c_void_p
SUCCESS, CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED = 0, 900, 901


def alloc(n, stream=None):
    d = u64()
    assert cu.cuMemAllocAsync(ctypes.byref(d), ctypes.c_size_t(n), vp(stream)) == SUCCESS
    return d.value


def htod(d, a, stream=None):
    return cu.cuMemcpyHtoDAsync_v2(u64(d), a.ctypes.data_as(vp), ctypes.c_size_t(a.nbytes),
                                   vp(stream))


def dtoh(a, d):
    assert cu.cuMemcpyDtoHAsync_v2(a.ctypes.data_as(vp), u64(d), ctypes.c_size_t(a.nbytes),
                                   None) == SUCCESS
    return a


def new_stream():
    s = vp()
    assert cu.cuStreamCreate(ctypes.byref(s), 1) == SUCCESS
    return s.value


def function(name):
    module, f = vp(), vp()
    assert cu.cuModuleLoadData(ctypes.byref(module), b"cubin") == SUCCESS
    assert cu.cuModuleGetFunction(ctypes.byref(f), module, name.encode()) == SUCCESS
    return f.value


def add_in_place(f, stream, x, y, n):
    """Launches add_in_place(x, y, n) as cudarc does: params[i] points at argument i."""
    args = [u64(x), u64(y), ctypes.c_longlong(n)]
    params = (vp * 3)(*[ctypes.cast(ctypes.byref(a), vp) for a in args])
    return cu.cuLaunchKernel(vp(f), 1, 1, 1, 64, 1, 1, 0, vp(stream), params, None)


n = 100
s = new_stream()
f = function("add_in_place")
x, y = alloc(4 * n), alloc(4 * n)
c.true("new memory is NaN", np.isnan(dtoh(np.zeros(n, np.float32), x)).all())
xs = np.arange(n, dtype=np.float32)
htod(x, xs)
htod(y, np.ones(n, np.float32))
add_in_place(f, s, x, y, n)
c.equal("a launch runs at once", dtoh(np.zeros(n, np.float32), x), xs + 1)

# Capture: recorded, not run; every replay runs it again.
graph, exec_ = vp(), vp()
assert cu.cuStreamBeginCapture_v2(vp(s), 2) == SUCCESS
scratch = alloc(4 * n, s)
c.true("a launch while capturing", add_in_place(f, s, x, y, n) == SUCCESS)
c.true("a memset while capturing", cu.cuMemsetD8Async(u64(scratch), 0, ctypes.c_size_t(4 * n),
                                                      vp(s)) == SUCCESS)
c.true("graph memory freed while capturing",
       cu.cuMemFreeAsync(u64(scratch), vp(s)) == SUCCESS)
c.true("the capture ends", cu.cuStreamEndCapture(vp(s), ctypes.byref(graph)) == SUCCESS)
c.equal("a captured launch does not run", dtoh(np.zeros(n, np.float32), x), xs + 1)
assert cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, u64(0)) == SUCCESS
for i in range(2):
    assert cu.cuGraphLaunch(exec_, vp(s)) == SUCCESS
    c.equal(f"replay {i + 1} runs the launch", dtoh(np.zeros(n, np.float32), x), xs + 2 + i)
assert cu.cuGraphExecDestroy(exec_) == SUCCESS and cu.cuGraphDestroy(graph) == SUCCESS

# What a capture cannot record fails and invalidates it, as on a device.
for name, op in [
    ("a copy from the host", lambda: htod(x, xs, s)),
    ("a synchronization", lambda: cu.cuStreamSynchronize(vp(s))),
]:
    assert cu.cuStreamBeginCapture_v2(vp(s), 2) == SUCCESS
    c.true(f"{name} while capturing fails", op() == CAPTURE_UNSUPPORTED)
    c.true(f"{name} invalidates the capture",
           cu.cuStreamEndCapture(vp(s), ctypes.byref(graph)) == CAPTURE_INVALIDATED)

# cuBLASLt: y[t, n] = x[t, k] . w[n, k]^T, as the backend asks for it (column-major, A
# transposed), in f16 and f32, and recorded by a capture.
rng = np.random.default_rng(7)
for dtype, code in [(np.float16, 2), (np.float32, 0)]:
    rows, t, k = 5, 3, 8
    w = rng.standard_normal((rows, k)).astype(dtype)
    xin = rng.standard_normal((t, k)).astype(dtype)
    dw, dx, dy = alloc(w.nbytes), alloc(xin.nbytes), alloc(4 * t * rows)
    htod(dw, w)
    htod(dx, xin)
    layouts = []
    for ty, r, cols, ld in [(code, k, rows, k), (code, k, t, k), (0, rows, t, rows)]:
        h = vp()
        assert lt.cublasLtMatrixLayoutCreate(ctypes.byref(h), ty, u64(r), u64(cols),
                                             ctypes.c_int64(ld)) == 0
        layouts.append(h)
    desc = vp()
    assert lt.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, 0) == 0
    one = ctypes.c_int(1)
    assert lt.cublasLtMatmulDescSetAttribute(desc, 3, ctypes.byref(one), ctypes.c_size_t(4)) == 0
    alpha, beta = ctypes.c_float(1), ctypes.c_float(0)
    a, b, cc = layouts

    def matmul(stream):
        return lt.cublasLtMatmul(None, desc, ctypes.byref(alpha), vp(dw), a, vp(dx), b,
                                 ctypes.byref(beta), vp(dy), cc, vp(dy), cc, None, None,
                                 ctypes.c_size_t(0), vp(stream))

    want = xin.astype(np.float64) @ w.astype(np.float64).T
    assert matmul(s) == 0
    c.close(f"cublasLtMatmul {dtype.__name__}", dtoh(np.zeros((t, rows), np.float32), dy), want,
            1e-6)
    assert cu.cuMemsetD8Async(u64(dy), 0, ctypes.c_size_t(4 * t * rows), vp(s)) == 0
    assert cu.cuStreamBeginCapture_v2(vp(s), 2) == SUCCESS
    assert matmul(s) == 0
    assert cu.cuStreamEndCapture(vp(s), ctypes.byref(graph)) == SUCCESS
    c.true(f"cublasLtMatmul {dtype.__name__} captured, not run",
           (dtoh(np.zeros((t, rows), np.float32), dy) == 0).all())
    assert cu.cuGraphLaunch(graph, vp(s)) == SUCCESS
    c.close(f"cublasLtMatmul {dtype.__name__} replayed",
            dtoh(np.zeros((t, rows), np.float32), dy), want, 1e-6)
    cu.cuGraphDestroy(graph)

# Misuse that a device might let pass unnoticed aborts, each in its own process.
CHILD = r"""
import ctypes, sys
import numpy as np
cu = ctypes.CDLL(sys.argv[1])
d = ctypes.c_uint64()
cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(16))
a = np.zeros(8, np.float32)
case = sys.argv[2]
if case == "copy":
    cu.cuMemcpyHtoDAsync_v2(d, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(32), None)
elif case == "overrun":
    ctypes.memset(d.value + 16, 0, 4)  # what a kernel writing past its buffer does
    cu.cuMemFree_v2(d)
elif case == "free":
    cu.cuMemFree_v2(ctypes.c_uint64(d.value + 4))
print("not caught")
"""
for case, message in [
    ("copy", "a copy to the device of 32 bytes outside every allocation"),
    ("overrun", "a write past the end of an allocation of 16 bytes"),
    ("free", "free of an address no allocation starts at"),
]:
    r = subprocess.run([sys.executable, "-c", CHILD, os.path.join(DRIVER, "libcuda.so"), case],
                       capture_output=True, text=True)
    c.true(f"caught: {case}", r.returncode != 0 and f"EMU ERROR: {message}" in r.stderr,
           r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.stdout.strip())

c.finish()

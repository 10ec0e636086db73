"""Builds the CUDA kernel files of src/kernels/cuda/ for the CPU emulator (cuda_emu.h): each
file, after prelude.cuh as NVRTC sees it, becomes one shared library exporting a launcher
`L_<kernel>` per kernel (see EMU_EXPORT in cuda_emu.h).

usage: build.py [BUILD_DIR]   builds every file (default BUILD_DIR: <repository>/target/cuda_emu)
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KERNEL_DIR = os.path.join(REPO, "src", "kernels", "cuda")
DEFAULT_BUILD_DIR = os.path.join(REPO, "target", "cuda_emu")

FORMATS = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k"]

# Every kernel, by file: the launchers the emulator exports (as src/kernels/cuda/mod.rs lists
# them for the Rust side).
KERNELS = {
    "quant.cu": [f"dequant_rows_{f}" for f in FORMATS]
    + [f"dequant_f16_{f}" for f in FORMATS if f != "f16"]
    + [f"matvec_{f}" for f in FORMATS]
    + [f"matmul_tc_{f}" for f in FORMATS]
    + ["f32_to_f16", "f32_to_bf16", "f16_to_f32", "sum_slices"],
    "ops.cu": ["rms_norm", "add_rms_norm", "add_in_place", "add_bias", "silu_mul", "rotary",
               "copy_columns", "gather_rows"],
    "attention.cu": ["kv_write_f16", "qkv_rotary_write_f16", "paged_attention_f16",
                     "paged_attention_tiles_f16", "attention_merge"],
    "sampling.cu": ["row_softmax_stats"],
}

CXXFLAGS = ["-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-fPIC", "-shared", "-Wall",
            "-Wno-unknown-pragmas", "-Wno-unused-variable", "-Wno-unused-function"]

# The prelude's two inline PTX instructions, and their host stand-ins.
PTX_HOST = {
    'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));': "f = emu_h2f(h);",
    'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));': "h = emu_f2h(f);",
    # Device-only (sm_80+) branch of mma_16816; the emulator compiles the shuffle branch.
    'asm volatile("mma.sync.aligned.m16n8k16': 'MMA_SYNC_DEVICE_ONLY("mma.sync.aligned.m16n8k16',
}


class BuildError(Exception):
    pass


def read(path):
    with open(path) as f:
        return f.read()


def host_source(fname):
    """The C++ text of kernel file `fname` for the emulator."""
    prelude = read(os.path.join(KERNEL_DIR, "prelude.cuh"))
    for ptx, host in PTX_HOST.items():
        if ptx not in prelude:
            raise BuildError(f"prelude.cuh no longer holds `{ptx}`: update PTX_HOST in build.py")
        prelude = prelude.replace(ptx, host)
    body = read(os.path.join(KERNEL_DIR, fname))
    if "asm(" in prelude or "asm(" in body:
        raise BuildError(f"{fname}: inline PTX the emulator has no stand-in for")
    # A kernel written out by name must be exported (ones made by macros are listed by hand).
    literal = re.findall(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(', body)
    unlisted = [k for k in literal if k not in KERNELS[fname]]
    if unlisted:
        raise BuildError(f"{fname}: kernels missing from KERNELS in build.py: {unlisted}")
    exports = "\n".join(f"EMU_EXPORT({k})" for k in KERNELS[fname])
    return f'#include "{os.path.join(HERE, "cuda_emu.h")}"\n{prelude}\n{body}\n{exports}\n'


def build(fname, build_dir=DEFAULT_BUILD_DIR):
    """Compiles kernel file `fname`; returns (path of the .so, g++'s warnings or "")."""
    os.makedirs(build_dir, exist_ok=True)
    cpp = os.path.join(build_dir, fname + ".cpp")
    so = os.path.join(build_dir, fname + ".so")
    with open(cpp, "w") as f:
        f.write(host_source(fname))
    tmp = f"{so}.tmp{os.getpid()}"
    r = subprocess.run(["g++", *CXXFLAGS, "-o", tmp, cpp], capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.splitlines()
        more = f"\n... ({len(lines) - 60} more lines)" if len(lines) > 60 else ""
        raise BuildError(f"g++ failed on {fname}:\n" + "\n".join(lines[:60]) + more)
    os.replace(tmp, so)  # a reader never sees half a library
    return so, r.stderr.strip()


def build_driver(build_dir=DEFAULT_BUILD_DIR):
    """Compiles the emulated driver and cuBLASLt (driver.cpp, cublaslt.cpp) into
    `build_dir`/driver/ as libcuda.so and libcublasLt.so: with that folder on LD_LIBRARY_PATH
    (and NVRTC's), the CUDA backend runs on the kernel libraries of `build_dir`, which must be
    built first. Returns the folder."""
    out = os.path.join(build_dir, "driver")
    os.makedirs(out, exist_ok=True)
    for src, lib, extra in [
        ("driver.cpp", "libcuda.so", ["-ldl"]),
        ("cublaslt.cpp", "libcublasLt.so", [f"-L{out}", "-lcuda", "-Wl,-rpath,$ORIGIN"]),
    ]:
        tmp = os.path.join(out, f"{lib}.tmp{os.getpid()}")
        cmd = ["g++", *CXXFLAGS, "-O2", f"-Wl,-soname,{lib}", "-o", tmp,
               os.path.join(HERE, src), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"g++ failed on {src}:\n{r.stderr[:4000]}")
        os.replace(tmp, os.path.join(out, lib))
    return out


def main():
    build_dir = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_BUILD_DIR
    bad = False
    for fname in KERNELS:
        try:
            so, warnings = build(fname, build_dir)
            print(f"built {fname} -> {so}")
            if warnings:
                print(warnings)
        except BuildError as e:
            print(f"FAIL build {fname}: {e}")
            bad = True
    try:
        print(f"built the emulated driver -> {build_driver(build_dir)}")
    except BuildError as e:
        print(f"FAIL build driver: {e}")
        bad = True
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Registers, spills and shared memory of every CUDA kernel, as ptxas reports them, without a
GPU: each file of src/kernels/cuda/ is compiled by NVRTC (prelude.cuh first, as the backend
does) with `-Xptxas=-v`.

    python3 scripts/kernel-resources.py [--arch 90] [FILE.cu ...]

Needs the NVRTC wheel the tests use (scripts/test.sh installs it); its lib folder must be on
LD_LIBRARY_PATH, as for `cargo test --features cuda`.
"""

import argparse
import ctypes
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src", "kernels", "cuda")


def nvrtc():
    import nvidia.cu13  # the nvidia-cuda-nvrtc wheel

    lib = os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so.13")
    return ctypes.CDLL(lib)


def compile_log(lib, name, source, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None,
                              None) != 0:
        sys.exit(f"{name}: nvrtcCreateProgram failed")
    opts = [f"-arch=sm_{arch}".encode(), b"--std=c++17", b"-default-device", b"-Xptxas=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"{name} sm_{arch} does not compile (is LD_LIBRARY_PATH set?):\n{text}")
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90", help="compute capability, e.g. 80 or 90")
    ap.add_argument("files", nargs="*", help="kernel files (default: every .cu)")
    args = ap.parse_args()
    files = args.files or sorted(f for f in os.listdir(SRC) if f.endswith(".cu"))
    prelude = open(os.path.join(SRC, "prelude.cuh")).read()
    lib = nvrtc()
    print(f"{'kernel':40} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'smem':>7}")
    for f in files:
        body = open(os.path.join(SRC, os.path.basename(f))).read()
        log = compile_log(lib, os.path.basename(f), prelude + "\n" + body, args.arch)
        # ptxas prints, per entry: its name, then the spills, then registers and smem.
        for entry in re.split(r"Compiling entry function ", log)[1:]:
            name = re.match(r"'(\w+)'", entry).group(1)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry)
            regs = re.search(r"Used (\d+) registers", entry)
            smem = re.search(r"(\d+) bytes smem", entry)
            print(f"{name:40} {regs.group(1) if regs else '?':>5} "
                  f"{spill.group(1) if spill else '?':>9} {spill.group(2) if spill else '?':>9} "
                  f"{smem.group(1) if smem else '0':>7}")


if __name__ == "__main__":
    main()

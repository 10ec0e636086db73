#!/usr/bin/env python3
"""Checks the CUDA kernels of src/kernels/cuda/ on the CPU, with no GPU: builds every kernel
file once with g++ against the emulator (cuda_emu.h), runs every test_*.py here (each in its
own process, several at a time), prints one line per check and a summary, and exits non-zero
if any check fails or anything cannot be built or run.

usage: run.py [-j JOBS] [--build-dir DIR] [TEST ...]
  TEST   test files to run (test_ops.py or ops); all of them by default
"""

import argparse
import concurrent.futures
import glob
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # nothing written into the source tree

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import build  # noqa: E402

PIP_HINT = "pip install numpy==2.4.6 gguf==0.19.0"


def missing_modules():
    missing = []
    for mod in ["numpy", "gguf"]:
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    return missing


def build_one(fname, build_dir):
    """(ok, lines to print) for one kernel file."""
    so = os.path.join(build_dir, fname + ".so")
    if os.path.exists(so):
        os.remove(so)  # a failed build must not leave an older library to test
    start = time.time()
    try:
        _, warnings = build.build(fname, build_dir)
    except (build.BuildError, OSError) as e:
        return False, [f"FAIL build {fname}", *str(e).splitlines()]
    lines = [f"ok   build {fname} ({time.time() - start:.1f}s)"]
    if warnings:
        lines += ["     g++ warnings:", *warnings.splitlines()]
    return True, lines


def build_driver(build_dir):
    """(ok, lines to print) for the emulated driver and cuBLASLt, which the Rust test
    cuda_parity runs on (scripts/test.sh)."""
    start = time.time()
    try:
        out = build.build_driver(build_dir)
    except (build.BuildError, OSError) as e:
        return False, ["FAIL build driver", *str(e).splitlines()]
    return True, [f"ok   build driver -> {out} ({time.time() - start:.1f}s)"]


def run_test(path, build_dir):
    """(returncode, stdout, stderr, seconds) of one test file."""
    env = dict(os.environ, CUDA_EMU_BUILD_DIR=build_dir, PYTHONDONTWRITEBYTECODE="1")
    start = time.time()
    r = subprocess.run([sys.executable, path], cwd=HERE, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr, time.time() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--build-dir", default=build.DEFAULT_BUILD_DIR)
    ap.add_argument("tests", nargs="*")
    args = ap.parse_args()
    jobs = max(1, args.jobs)
    build_dir = os.path.abspath(args.build_dir)
    start = time.time()

    missing = missing_modules()
    if missing:
        print(f"FAIL missing Python packages: {' '.join(missing)} ({PIP_HINT})")
        return 1

    tests = sorted(glob.glob(os.path.join(HERE, "test_*.py")))
    if args.tests:
        wanted = {t if t.endswith(".py") else f"test_{t}.py" for t in args.tests}
        unknown = wanted - {os.path.basename(t) for t in tests}
        if unknown:
            print(f"FAIL unknown tests: {' '.join(sorted(unknown))}")
            return 1
        tests = [t for t in tests if os.path.basename(t) in wanted]

    passed = failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        # Every kernel file, once.
        builds = [pool.submit(build_one, f, build_dir) for f in build.KERNELS]
        builds.append(pool.submit(build_driver, build_dir))
        for fut in builds:
            ok, lines = fut.result()
            print("\n".join(lines), flush=True)
            passed += ok
            failed += not ok

        # The tests, in their own processes (an emulator abort ends one test file only).
        runs = [(t, pool.submit(run_test, t, build_dir)) for t in tests]
        for path, fut in runs:
            name = os.path.basename(path)
            rc, out, err, secs = fut.result()
            print(f"== {name}", flush=True)
            lines = out.splitlines()
            for line in lines:
                print(line)
            ok_n = sum(line.startswith("ok ") for line in lines)
            fail_n = sum(line.startswith("FAIL") for line in lines)
            passed += ok_n
            failed += fail_n
            if (rc != 0 and fail_n == 0) or ok_n == 0:
                failed += 1
                print(f"FAIL {name} exited with status {rc} after {ok_n} checks")
            if rc != 0 and err.strip():
                print("\n".join("     " + line for line in err.strip().splitlines()[-40:]))
            print(f"== {name}: {secs:.1f}s", flush=True)

    total = time.time() - start
    verdict = "FAILED" if failed else "passed"
    print(f"cuda_emu {verdict}: {passed} checks passed, {failed} failed "
          f"({len(build.KERNELS)} kernel files, {len(tests)} test files, {jobs} jobs, "
          f"{total:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

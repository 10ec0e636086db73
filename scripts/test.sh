#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh machine, fetches the default
# models, then runs `cargo test`, and, with no arguments, the CUDA kernels' checks that need
# no GPU: every kernel compiled by NVRTC for sm_80 and sm_90 (`--features cuda`), every
# kernel run on the CPU emulator against independent references, and the CUDA backend's
# parity test on the emulated driver (tests/cuda_emu/driver.cpp); then each fuzz target for
# 30 s (scripts/fuzz.sh). Extra arguments go to
# `cargo test` alone, e.g.
#
#   scripts/test.sh                      # everything
#   scripts/test.sh --test server_http   # one test target
set -euo pipefail
cd "$(dirname "$0")/.."

# unzip for the model packages; iproute2 for the two-host test in network namespaces.
missing=()
command -v unzip >/dev/null || missing+=(unzip)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The OpenAI-client integration test drives the server with the official Python client.
if ! python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install -q openai || python3 -m pip install -q --break-system-packages openai
fi

# The AVX-512 VNNI and AVX-VNNI kernels are checked on emulated CPUs (Bochs' CPU models,
# from PyPI).
if ! python3 -c "import importlib.util as u; exit(u.find_spec('bochscpu') is None)"; then
  python3 -m pip install -q bochscpu-python==0.4.0 \
    || python3 -m pip install -q --break-system-packages bochscpu-python==0.4.0
fi

pip_install() {
  python3 -m pip install -q "$@" || python3 -m pip install -q --break-system-packages "$@"
}

# The API contract test runs schemathesis against the server's OpenAPI document.
command -v st >/dev/null || pip_install schemathesis==4.32.5

scripts/fetch-models.sh
# One build from clean: incremental state would only add time and about 1.6 GB of disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test "$@" 2>&1
[ $# -eq 0 ] || exit 0

# NVRTC 13.0 (a CUDA 13.0 driver loads its CUBINs) from PyPI, found through LD_LIBRARY_PATH
# as the `cuda` build finds it at run time; numpy and gguf-py are the emulator's references.
nvrtc_lib() {
  python3 -c 'import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], "lib"))' 2>/dev/null
}
[ -e "$(nvrtc_lib)/libnvrtc.so.13" ] || pip_install nvidia-cuda-nvrtc==13.0.88
python3 -c "import numpy, gguf" 2>/dev/null || pip_install numpy==2.4.6 gguf==0.19.0
nvrtc_lib=$(nvrtc_lib)
LD_LIBRARY_PATH="$nvrtc_lib:${LD_LIBRARY_PATH:-}" cargo test --features cuda --test cuda_kernels 2>&1
python3 tests/cuda_emu/run.py
# The CUDA backend against the CPU on tiny models, on the emulated driver run.py built.
LD_LIBRARY_PATH="$PWD/target/cuda_emu/driver:$nvrtc_lib:${LD_LIBRARY_PATH:-}" \
  cargo test --features cuda --test cuda_parity 2>&1

# Coverage-guided fuzzing, 30 s a target (longer runs: scripts/fuzz.sh 3600).
scripts/fuzz.sh 30

#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh machine, fetches the default
# models, then runs `cargo test`. Extra arguments go to `cargo test`, e.g.
#
#   scripts/test.sh                      # everything
#   scripts/test.sh --test server_http   # one test target
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v unzip >/dev/null; then
  apt-get update -qq && apt-get install -y -qq unzip >/dev/null
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

scripts/fetch-models.sh
cargo test "$@" 2>&1

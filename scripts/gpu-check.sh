#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, its driver and CUDA 13 libraries (NVRTC,
# cuBLASLt: a CUDA toolkit or PyTorch's wheels), Python with PyTorch, and no Rust toolchain
# or network. It runs the binaries scripts/gpu-bundle.sh built (beside this script), writes
# no model files (the speed runs use random-weight models of real shapes, made in memory),
# and ends with one summary:
#   (a) the GPU-vs-CPU test binary: logits and greedy tokens of tiny random models of every
#       architecture and stored format, batched and alone, prefill and decode;
#   (b) bench-model on Qwen2.5-1.5B, Qwen3-8B and Qwen3-32B shapes at Q4_K: prefill tok/s,
#       decode tok/s at batch 1, 8, 32 and 128, and % of the HBM roofline (bytes read per
#       step ÷ the device-to-device copy rate measured in the same run);
#   (c) PyTorch's bf16 matmul rate on this GPU, the peak prefill is read against;
#   and the 8B's decode launch by launch (--eager) against its CUDA graphs.
# Meant to finish within 8 minutes on an H100/H200. Usage: gpu-bundle/gpu-check.sh [OUT_DIR]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-${OUT:-$here/gpu-check-out}}"
mkdir -p "$out"
export TOKENROUTER_KERNEL_CACHE="${TOKENROUTER_KERNEL_CACHE:-$out/cache}"
# Seconds each bench-model run may take.
bench_timeout="${BENCH_TIMEOUT:-150}"

. "$here/gpu-env.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

echo "== (a) GPU against CPU"
timeout 180 "$here/cuda_parity" --test-threads 1 2>&1 | tee "$out/parity.txt"
parity=${PIPESTATUS[0]}

echo "== (c) PyTorch bf16 matmul peak"
python3 - <<'PY' 2>&1 | tee "$out/torch-peak.txt"
import time, torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
best = 0.0
for _ in range(5):
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    best = max(best, 20 * 2 * n**3 / (time.perf_counter() - t))
print(f"bf16_matmul_tflops {best / 1e12:.1f}")
PY

echo "== (b) bench-model on random-weight models of real shapes"
: > "$out/bench.jsonl"
for shape in qwen2.5-1.5b:q4_k qwen3-8b:q4_k qwen3-32b:q4_k; do
  timeout "$bench_timeout" "$here/tokenrouter" bench-model --random "$shape" --device cuda:0 \
    --batch 1,8,32,128 --prompt-len 512 --decode-steps 32 --json 2>"$out/bench-$shape.err" \
    | tee -a "$out/bench.jsonl"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "bench-model $shape failed:"; tail -5 "$out/bench-$shape.err"; }
done
# The 8B's decode launch by launch, read against the runs above, which replay CUDA graphs.
timeout "$bench_timeout" "$here/tokenrouter" bench-model --random qwen3-8b:q4_k --device cuda:0 \
  --batch 1,32 --prompt-len 512 --decode-steps 16 --eager --json 2>"$out/bench-eager.err" \
  | tee -a "$out/bench.jsonl"

echo "== summary"
python3 - "$out" "$parity" <<'PY'
import json, sys
out, parity = sys.argv[1], int(sys.argv[2])
peak = None
for line in open(f"{out}/torch-peak.txt"):
    if line.startswith("bf16_matmul_tflops"):
        peak = float(line.split()[1]) * 1e12
# Multiply-adds per prefill token (2 flops each): the layers' matrices; a prefill computes
# logits at its last position only, so the LM head is left out.
params = {"qwen2.5-1.5b:q4_k": 1.31e9, "qwen3-8b:q4_k": 6.95e9, "qwen3-32b:q4_k": 31.2e9}
every = [json.loads(l) for l in open(f"{out}/bench.jsonl") if l.strip()]
rows = [r for r in every if not r.get("eager")]
print(f"(a) GPU vs CPU parity: {'PASS' if parity == 0 else 'FAIL'}")
print(f"(c) PyTorch bf16 matmul: {peak / 1e12:.1f} TFLOP/s" if peak else "(c) no PyTorch peak")
print(f"{'model':<24} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'% roofline':>10}")
ok = parity == 0
for shape in params:
    mine = {r["batch"]: r for r in rows if r["model"] == f"random {shape}"}
    if not mine:
        print(f"{shape:<24} no result")
        ok = False
        continue
    for b, r in sorted(mine.items()):
        print(f"{shape:<24} {b:>5} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} "
              f"{100 * r['roofline_fraction']:>9.0f}%")
    if 1 in mine and 32 in mine:
        ratio = mine[32]["decode_tok_s"] / mine[1]["decode_tok_s"]
        print(f"  batch 32 / batch 1 decode: {ratio:.1f}x (goal >= 10x)")
        ok &= ratio >= 10
    if shape != "qwen2.5-1.5b:q4_k" and 1 in mine:
        frac = mine[1]["roofline_fraction"]
        print(f"  batch-1 decode: {100 * frac:.0f}% of the HBM roofline (goal >= 50%)")
        ok &= frac >= 0.5
    if shape == "qwen3-8b:q4_k" and 1 in mine and peak:
        share = 2 * params[shape] * mine[1]["prefill_tok_s"] / peak
        print(f"  prefill: {100 * share:.0f}% of the bf16 matmul peak (goal >= 25%)")
        ok &= share >= 0.25
eager = {r["batch"]: r for r in every if r.get("eager") and r["model"] == "random qwen3-8b:q4_k"}
graphed = {r["batch"]: r for r in rows if r["model"] == "random qwen3-8b:q4_k"}
for b in sorted(set(eager) & set(graphed)):
    print(f"  qwen3-8b batch {b} decode, CUDA graphs over eager: "
          f"{graphed[b]['decode_tok_s'] / eager[b]['decode_tok_s']:.2f}x")
print("GPU CHECK:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY

#!/usr/bin/env bash
# The GPU run, in one go, on a machine with an NVIDIA GPU and no cargo.
#
# Expects the binaries scripts/build-gpu.sh writes, copied with the repository:
#   target/gpu/hilore         hilore built with `--features gpu`
#   target/gpu/device_check   the codecs' GPU check (kernels/examples/device_check.rs)
# Runs, each step under its own time limit (about 7.5 minutes in all):
#   1. nvidia-smi and the binary's libraries (ldd), for the record;
#   2. the codec check through kernels/device-check.sh: every codec's GPU bytes equal the
#      CPU's, and encode/decode bandwidth against a device copy (device_check.json);
#   3. hilore --device cuda check: every fidelity's gradient against store-all's on the
#      GPU, recomputes bit-identical (check.json);
#   4. hilore --device cuda bench on a decoder of Qwen2.5-0.5B's shape (494 M parameters,
#      random weights, f32) with 4096-row microbatches: every policy's throughput and
#      peak memory under the budget (bench.json, plots/);
# then prints a summary (also written to summary.txt). Everything goes to $OUT.
#
# The CUDA libraries are found through the binary's run path, else through
# LD_LIBRARY_PATH, to which this script appends the folder below when it exists.
#
# Usage: scripts/device-run.sh [--help]
# Environment:
#   OUT           output folder (default: ./out)
#   HILORE_BIN    the hilore GPU binary (default: <repo>/target/gpu/hilore)
#   DEVICE_CHECK  the device_check binary (default: <repo>/target/gpu/device_check)
#   DEVICE        the GPU to use (default: cuda:0)
#   BENCH_ARGS    the size flags of `hilore bench` (default: --rows 4096 --prompts 4
#                 --group 8 --reps 2 --risk-targets 0.03)
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    "") ;;
    *) echo "device-run: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$PWD/out}
BIN=${HILORE_BIN:-$root/target/gpu/hilore}
DC=${DEVICE_CHECK:-$root/target/gpu/device_check}
DEVICE=${DEVICE:-cuda:0}
HOST_CUDA_LIB=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
if [ -d "$HOST_CUDA_LIB" ]; then
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$HOST_CUDA_LIB"
fi

summary=()
failed=0
# run NAME SECONDS CMD...: runs CMD under a time limit, its output into $OUT/NAME.log.
run() {
    local name=$1 limit=$2
    shift 2
    echo "device-run: [$name] $* (limit ${limit} s)"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local took=$((SECONDS - t0)) status
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMED OUT after ${limit} s"; failed=1 ;;
        *) status="FAILED (exit $rc)"; failed=1 ;;
    esac
    tail -n 25 "$OUT/$name.log" | sed "s/^/    /"
    summary+=("$(printf '%-13s %-24s %5d s' "$name" "$status" "$took")")
}

# 1. The machine.
run nvidia-smi 10 nvidia-smi
if [ -x "$BIN" ]; then
    run ldd 10 ldd "$BIN"
else
    echo "device-run: no hilore binary at $BIN (build it with scripts/build-gpu.sh)" >&2
    failed=1
fi

# 2. Codec parity and bandwidth (device_check.json in $OUT).
run device-check 100 "$root/kernels/device-check.sh" "$DC"

# 3. Gradients of every fidelity on the GPU, on the built-in decoder.
run check 80 sh -c '"$1" --device "$2" check --json >"$3/check.json"' sh "$BIN" "$DEVICE" "$OUT"

# 4. The policies on a 0.5B-parameter decoder (Qwen2.5-0.5B's shape, random weights).
cat >"$OUT/bench-config.json" <<'JSON'
{
  "model_type": "qwen2",
  "vocab_size": 151936,
  "hidden_size": 896,
  "intermediate_size": 4864,
  "num_hidden_layers": 24,
  "num_attention_heads": 14,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "rms_norm_eps": 1e-6,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": true,
  "max_position_embeddings": 32768,
  "attention_bias": true
}
JSON
BENCH_ARGS=${BENCH_ARGS:---rows 4096 --prompts 4 --group 8 --reps 2 --risk-targets 0.03}
# shellcheck disable=SC2086 # BENCH_ARGS is a list of arguments
run bench 250 "$BIN" --device "$DEVICE" bench --config "$OUT/bench-config.json" $BENCH_ARGS \
    --json "$OUT/bench.json" --plot "$OUT/plots" --quiet

{
    echo "device-run summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), device $DEVICE)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
        sed 's/^/gpu: /'
    for line in "${summary[@]}"; do echo "  $line"; done
    grep -h -m1 -o '"ok": *[a-z]*' "$OUT/check.json" 2>/dev/null | sed 's/^/check.json /'
    grep -h -i -E 'parity|byte-identical|all .* passed' "$OUT/device-check.log" 2>/dev/null | tail -n 3
    echo "outputs in $OUT:"
    ls -1 "$OUT" | sed 's/^/  /'
} | tee "$OUT/summary.txt"
exit "$failed"

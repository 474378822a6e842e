#!/usr/bin/env bash
# hilore bench at each built-in model size (2m: the benchmark decoder, 2.0 M parameters;
# 10m: 6 layers of 384, about 10 M), the same step shape and budget, one JSON per size in
# OUT_DIR (default docs/results). Each run reports HiLoRe against the fastest in-budget
# baseline whose measured gradient error is no larger than HiLoRe's own.
#
#   scripts/bench-sizes.sh [OUT_DIR] [extra hilore bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results}; shift || true
cargo build --release -p hilore
for size in 2m 10m; do
  echo "== hilore bench --size $size"
  ./target/release/hilore bench --size "$size" --quiet --json "$out/bench-size-$size.json" "$@"
done

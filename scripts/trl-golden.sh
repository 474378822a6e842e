#!/usr/bin/env bash
# GRPO golden numbers from TRL itself, for HiLoRe's tests to compare against without
# Python.
#
# Steps:
#   1. a Python virtual environment with trl==1.16.0 (and the torch, transformers and
#      accelerate it pulls) from PyPI, made once and reused while `import trl` gives
#      1.16.0; the same environment as scripts/vs-pytorch.sh's unless TRL_GOLDEN_VENV
#      says otherwise (torch is a one-time download of about 3 GB);
#   2. scripts/trl_golden.py: for each fixed case (every loss type, sequence-level
#      importance sampling, delta, the reward scalings, truncation masks, reward weights,
#      1-4 accumulation steps, steps_per_generation, 1-3 iterations, beta 0 and > 0), TRL's
#      own GRPOTrainer code computes the advantages and, per iteration and loss
#      microbatch, dL/dlogp of every response token by autograd; see the script's
#      docstring for what is stood in for (the model's log-probs, generation, the reward
#      functions, the accelerator) and why;
#   3. one JSON file per case into hilore-runtime/tests/fixtures/trl (or OUT_DIR), which
#      the test hilore-runtime/tests/trl_golden.rs reads.
#
# Usage: scripts/trl-golden.sh [OUT_DIR]
# Environment:
#   TRL_GOLDEN_VENV  the virtual environment (default <repo>/target/vs-pytorch-venv)
#   PYTHON           the interpreter that makes it (default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/hilore-runtime/tests/fixtures/trl}
venv=${TRL_GOLDEN_VENV:-$root/target/vs-pytorch-venv}
trl_version=1.16.0

if [ ! -x "$venv/bin/python" ]; then
    echo "trl-golden: making $venv" >&2
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
    echo "trl-golden: $venv/bin/python is not a virtual environment's interpreter; remove $venv and rerun" >&2
    exit 1
}
if ! "$venv/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '$trl_version')" 2>/dev/null; then
    echo "trl-golden: installing trl==$trl_version into $venv" >&2
    "$venv/bin/python" -m pip install --progress-bar off "trl==$trl_version"
fi
mkdir -p "$out"
"$venv/bin/python" -W ignore "$root/scripts/trl_golden.py" "$out"
echo "trl-golden: wrote $(ls "$out"/*.json | wc -l) cases to $out" >&2

#!/usr/bin/env bash
# The HiLoRe tape against PyTorch on the CPU: the same model, the same tokens, the same
# loss, each measurement in its own process, interleaved.
#
# Steps:
#   1. a Python virtual environment with torch, transformers and safetensors from PyPI
#      (made once; reused while `import torch, transformers, safetensors` works);
#   2. cargo build --release -p hilore;
#   3. the benchmark decoder (DecoderConfig::bench: 4 layers, hidden 192, MLP 512, 6 query
#      / 2 key-value heads of 32, vocabulary 1024, untied head; 2.0 M parameters), random
#      weights, written as a Hugging Face directory by `hilore export --config`;
#   4. scripts/vs_pytorch.py run: checks that transformers and the tape give the same
#      per-token log-probs on the same tokens (prints the max abs difference; stops above
#      1e-3), then times, on every shape and thread count, interleaved A B A B over the
#      repetitions:
#        - PyTorch store-all: transformers' LlamaForCausalLM (sdpa attention, float32,
#          train mode, dropout 0), log_softmax + gather of the next tokens, loss
#          sum(c * logp) with random c, backward;
#        - the tape's store-all (`hilore bench-tape --plans store-all`);
#        - PyTorch + checkpoint: the same with per-layer activation checkpointing
#          (gradient_checkpointing_enable, use_reentrant=False);
#        - the tape's recompute-all (per-layer gradient checkpointing);
#      and the attention core alone at each --attention length (one causal sequence,
#      6 / 2 heads of 32): torch.nn.functional.scaled_dot_product_attention with
#      enable_gqa=True (K/V repeat_interleave'd where torch lacks it) against the tape's
#      attention op, forward + backward with a random output gradient.
#      Each measurement is one process: a warm-up pass, a memory pass (peak RSS growth),
#      a timed pass (wall and CPU seconds); see scripts/vs_pytorch.py for the details.
#   5. writes the results as JSON and prints markdown tables: wall / CPU seconds and
#      CPU/wall, tape / PyTorch ratios, peak RSS growth, per-unit times of the tape.
#
# Shapes (--shapes, comma-separated): `LxN` is N sequences of L tokens (one batch of
# N x (L - 1) log-probs on both sides); `train` is the benchmark's 896-row microbatch
# (`hilore bench --rows 896`: eight sequences 161,97,129,65,193,81,113,65 tokens long),
# which PyTorch runs as a right-padded batch with an attention mask (as a PyTorch GRPO
# trainer batches responses: the padded positions are computed, their coefficients are
# 0), the tape packed; `A+B+C` is such a batch of any lengths. `hilore train` packs up
# to --token-budget 1024 rows per microbatch (padded to a multiple of 128 under its
# default policy); 896 rows is the benchmark's microbatch and the planner's test shape.
#
# Why torch comes with its CUDA libraries: only PyPI is reachable here, and PyPI's
# Linux x86-64 torch wheel is the CUDA build. `pip install --no-deps torch` plus its
# pure-Python dependencies does not import: torch preloads libcudart / libcublasLt from
# the nvidia-* and cuda-toolkit packages and stops when they are missing (checked with
# torch 2.15). So the plain `pip install torch` it is: a one-time download of about 3 GB
# (5.6 GB installed), in the venv only. Nothing here uses a GPU: CUDA is never
# initialized, and every PyTorch number is its CPU path (MKL / oneDNN).
#
# Usage: scripts/vs-pytorch.sh [--quick] [--model bench|train-default] [--reps N]
#                              [--threads 1,2] [--shapes S,...] [--attention T,...|none]
#                              [--out FILE] [--help]
#   --quick       smoke test: 1 repetition, 1 thread, shape 128x7, attention T=512
#   --model M     `bench` (default): the benchmark decoder above; `train-default`: the
#                 policy `hilore train` builds without --config or --model (2 layers,
#                 hidden 64, MLP 176, 4 query / 2 key-value heads of 16, the arithmetic
#                 task's 16-token vocabulary; 94.5 k parameters). Its microbatch is about
#                 64 responses of 14 tokens (32 prompts x 8 samples of `ddd+ddd=` and
#                 an answer, packed to 1024 rows): run it with --shapes 14x64
#   --reps N      repetitions (processes per measurement), medians reported (default 5)
#   --threads L   thread counts: torch.set_num_threads and OMP/MKL_NUM_THREADS for
#                 PyTorch, --threads (RAYON_NUM_THREADS) for the tape (default 1,2)
#   --shapes L    shapes, see above (default 128x7,512x4,train)
#   --attention L attention-core lengths T, or `none` (default 512,2048)
#   --out FILE    results JSON (default target/vs-pytorch/results.json)
# Environment:
#   VS_PYTORCH_VENV  the virtual environment (default <repo>/target/vs-pytorch-venv)
#   PYTHON           the interpreter that makes it (default python3)
# On a shared machine run it under `nice`, and read the CPU seconds (less disturbed by
# other work than wall seconds).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
reps=5
threads=1,2
shapes=128x7,512x4,train
attention=512,2048
out=$root/target/vs-pytorch/results.json
model=bench
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --quick) reps=1; threads=1; shapes=128x7; attention=512 ;;
        --model) model=${2:?--model needs bench or train-default}; shift ;;
        --reps) reps=${2:?--reps needs a number}; shift ;;
        --threads) threads=${2:?--threads needs a list like 1,2}; shift ;;
        --shapes) shapes=${2:?--shapes needs a list like 128x7,512x4,train}; shift ;;
        --attention) attention=${2:?--attention needs a list like 512,2048 or none}; shift ;;
        --out) out=${2:?--out needs a file}; shift ;;
        *) echo "vs-pytorch: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
[ "$attention" = none ] && attention=
case "$model" in
    bench | train-default) ;;
    *) echo "vs-pytorch: --model must be bench or train-default, got '$model'" >&2; exit 2 ;;
esac
case "$reps" in '' | *[!0-9]* | 0) echo "vs-pytorch: --reps must be a positive number, got '$reps'" >&2; exit 2 ;; esac

venv=${VS_PYTORCH_VENV:-$root/target/vs-pytorch-venv}
work=$root/target/vs-pytorch
mkdir -p "$work"

# 1. The venv. pip runs as the venv's own interpreter, checked to be the venv's first, so
# nothing is ever installed outside it.
if [ ! -x "$venv/bin/python" ]; then
    echo "vs-pytorch: making $venv" >&2
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || {
    echo "vs-pytorch: $venv/bin/python is not a virtual environment's interpreter; remove $venv and rerun" >&2
    exit 1
}
if ! "$venv/bin/python" -c 'import torch, transformers, safetensors' 2>/dev/null; then
    echo "vs-pytorch: installing torch, transformers, safetensors into $venv (about 3 GB to download, once)" >&2
    "$venv/bin/python" -m pip install --progress-bar off 'torch>=2.5' 'transformers>=4.45' safetensors
fi

# 2. The binary.
(cd "$root" && cargo build --release -p hilore)
hilore=$root/target/release/hilore

# 3. The model, random weights: the benchmark decoder (the fields of DecoderConfig::bench
# in models/src/config.rs) or the training default (`hilore train`'s --layers, --hidden,
# --heads, --kv-heads, --intermediate defaults and the arithmetic tokenizer's vocabulary).
if [ "$model" = bench ]; then
    dims='"vocab_size": 1024, "hidden_size": 192, "intermediate_size": 512,
  "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,'
else
    dims='"vocab_size": 16, "hidden_size": 64, "intermediate_size": 176,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,'
fi
cat >"$work/$model-config.json" <<EOF
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  $dims
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "max_position_embeddings": 4096,
  "attention_bias": false,
  "attention_dropout": 0.0,
  "hidden_act": "silu"
}
EOF
"$hilore" export --config "$work/$model-config.json" --seed 7 --out "$work/$model-model" --force

# 4-5. The comparison.
"$venv/bin/python" "$root/scripts/vs_pytorch.py" run \
    --hilore "$hilore" --model "$work/$model-model" --work "$work" --out "$out" \
    --shapes "$shapes" --threads "$threads" --attention "$attention" --reps "$reps"

#!/usr/bin/env bash
# GPU check of the codecs: byte parity with the CPU, and encode/decode bandwidth against a
# device-to-device copy (see kernels/examples/device_check.rs).
#
# Meant for a GPU machine without cargo or network. Build the binary anywhere first:
#   cargo build --release -p hilore-kernels --features cuda --example device_check
# then, on the GPU machine, from the repository:
#   kernels/device-check.sh [path/to/device_check]
# The binary is otherwise looked for under target*/release/examples/ (newest first), or
# built if cargo exists. libcuda comes with the driver; libnvrtc with the CUDA toolkit or
# Python's nvidia-cuda-nvrtc wheel; this script adds the usual folders of both to
# LD_LIBRARY_PATH. Writes device_check.json into $OUT when OUT is set.
#
# Exit status: the binary's (0 every codec byte-identical, 1 a parity failure or CUDA
# unusable, 2 built without CUDA), or 3 when no binary could be found or built.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
bin=${1:-${HILORE_DEVICE_CHECK:-}}

if [ -z "$bin" ]; then
    # shellcheck disable=SC2012
    bin=$(ls -t "$root"/target*/release/examples/device_check 2>/dev/null | head -n 1)
fi
if [ -z "$bin" ] && command -v cargo >/dev/null 2>&1; then
    (cd "$root" && cargo build --release -p hilore-kernels --features cuda --example device_check) || exit 3
    bin=${CARGO_TARGET_DIR:-$root/target}/release/examples/device_check
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "device-check: no device_check binary found; build it with" >&2
    echo "  cargo build --release -p hilore-kernels --features cuda --example device_check" >&2
    exit 3
fi

extra=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] && extra="$extra:$d"
done
if command -v python3 >/dev/null 2>&1; then
    wheel_libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = list(site.getsitepackages()) + [site.getusersitepackages()]
dirs = set()
for r in roots:
    for f in glob.glob(os.path.join(r, "nvidia", "**", "libnvrtc.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
    [ -n "$wheel_libs" ] && extra="$extra:$wheel_libs"
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}$extra"

echo "device-check: running $bin"
"$bin"

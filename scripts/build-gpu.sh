#!/usr/bin/env bash
# Builds the GPU binary of hilore on a machine that has no GPU and no CUDA installation.
#
# The binary is `hilore` with the `gpu` feature (candle-core's CUDA backend, and the codec
# kernels on candle's CUDA storage), for NVIDIA H100/H200 GPUs (sm_90) with CUDA 13.0
# libraries and a driver that supports CUDA 13.0. Steps:
#
#   1. Install the CUDA 13.0 compiler and libraries from PyPI wheels (about 680 MB) into a
#      Python venv under the build folder (default: .gpubuild/ in the repository, which git
#      ignores). Skipped when the venv already holds the pinned versions.
#   2. Make a CUDA_HOME-shaped folder of symlinks (<build folder>/cuda) with the unversioned
#      library names the linker looks for, and a link-only libcuda.so stub: libcuda comes
#      with the driver on the GPU machine, and no wheel ships one. The stub is only linked
#      against, never run.
#   3. cargo build --release -p hilore --features gpu into target/gpu-build (kept apart from
#      the CPU build in target/), with CUDA_COMPUTE_CAP=90 and CUDARC_CUDA_VERSION=13000 and
#      a run path to the GPU machine's CUDA libraries baked in (HOST_CUDA_LIB below), then
#      write a stripped copy to target/gpu/hilore.
#   4. Build the codec check (kernels' device_check example, which loads CUDA at run time)
#      and write a stripped copy to target/gpu/device_check.
#
# Afterwards copy the repository's scripts/, kernels/device-check.sh and target/gpu/ to the
# GPU machine and run scripts/device-run.sh there. The binary needs libcuda.so.1 (from the
# driver) and the CUDA 13.0 libraries (cudart, cublas, cublasLt, curand, nvrtc) at start.
#
# Needs: python3 with venv, gcc, strip, readelf, cargo, and access to PyPI and crates.io.
#
# Usage: scripts/build-gpu.sh [--help]
# Environment:
#   GPUBUILD       build folder (default: <repo>/.gpubuild)
#   HOST_CUDA_LIB  folder of the CUDA libraries on the GPU machine, baked in as run path
#                  (default: /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib)
#   CUDA_COMPUTE_CAP  GPU architecture for candle's kernels (default: 90)
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    "") ;;
    *) echo "build-gpu: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GB=${GPUBUILD:-$root/.gpubuild}
HOST_CUDA_LIB=${HOST_CUDA_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=13000
mkdir -p "$GB"
step() { echo "build-gpu: $*"; }

# 1. CUDA 13.0 from PyPI, at the versions PyTorch 2.11 pins (cudarc 0.19 knows CUDA <= 13.4;
#    the host's libraries are 13.0, so build against 13.0).
wheels=(
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.1.0.3 nvidia-curand==10.4.0.35
)
[ -x "$GB/venv/bin/pip" ] || python3 -m venv "$GB/venv"
installed=$("$GB/venv/bin/pip" freeze 2>/dev/null || true)
missing=()
for w in "${wheels[@]}"; do
    grep -qixF "$w" <<<"$installed" || missing+=("$w")
done
if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]} from PyPI"
    "$GB/venv/bin/pip" install -q "${wheels[@]}"
else
    step "CUDA wheels already installed in $GB/venv"
fi
cu=$(echo "$GB"/venv/lib/python3*/site-packages/nvidia/cu13)
[ -x "$cu/bin/nvcc" ] || { echo "build-gpu: no nvcc under $cu" >&2; exit 1; }

# 2. CUDA_HOME-shaped folder and the link-only libcuda stub.
ch=$GB/cuda
rm -rf "$ch"
mkdir -p "$ch/lib64/stubs"
ln -s "$cu/bin" "$ch/bin"
ln -s "$cu/include" "$ch/include"
ln -s "$cu/nvvm" "$ch/nvvm"
ln -s lib64 "$ch/lib"
for f in "$cu"/lib/*.so*; do ln -s "$f" "$ch/lib64/"; done
for s in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
    ln -s "lib$s" "$ch/lib64/lib${s%.so.*}.so"
done
# Every cu* function of cuda.h and of cudarc's driver bindings, each returning an error code.
(cd "$root" && cargo fetch --locked -q)
cudarc_version=$(awk '/^name = "cudarc"$/ {getline; gsub(/[^0-9.]/, ""); print}' "$root/Cargo.lock" |
    sort -V | tail -n 1)
cudarc_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$cudarc_version" | head -n 1)
{
    gcc -E -P -I "$ch/include" "$ch/include/cuda.h" |
        grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' \t('
    grep -ohE 'pub unsafe fn cu[A-Za-z0-9_]+' "$cudarc_src/src/driver/sys/mod.rs" |
        sed 's/pub unsafe fn //'
} | sort -u | awk '{print "int " $1 "(void){return 999;}"}' >"$GB/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ch/lib64/stubs/libcuda.so" "$GB/libcuda_stub.c"
step "CUDA_HOME at $ch (libcuda stub: $(wc -l <"$GB/libcuda_stub.c") functions)"

# 3. The GPU binary.
export CUDA_HOME=$ch CUDA_PATH=$ch NVCC=$ch/bin/nvcc PATH=$ch/bin:$PATH
export LIBRARY_PATH=$ch/lib64:$ch/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=$root/target/gpu-build
export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C link-arg=-Wl,-rpath,$HOST_CUDA_LIB"
out=$root/target/gpu
mkdir -p "$out"
cd "$root"
start=$SECONDS
step "cargo build --release -p hilore --features gpu (sm_$CUDA_COMPUTE_CAP, CUDA 13.0)"
cargo build --locked --release -p hilore --features gpu
strip -o "$out/hilore" "$CARGO_TARGET_DIR/release/hilore"

# 4. The codec check.
step "cargo build --release -p hilore-kernels --features cuda --example device_check"
cargo build --locked --release -p hilore-kernels --features cuda --example device_check
strip -o "$out/device_check" "$CARGO_TARGET_DIR/release/examples/device_check"
step "built in $((SECONDS - start)) s"

for b in "$out/hilore" "$out/device_check"; do
    size=$(stat -c %s "$b")
    echo "build-gpu: $b: $size bytes ($((size / 1048576)) MiB)"
    readelf -d "$b" | grep -E 'NEEDED|RUNPATH|RPATH' | sed 's/^/    /'
    if [ "$size" -ge $((64 * 1048576)) ]; then
        echo "build-gpu: $b is 64 MiB or more" >&2
        exit 1
    fi
done

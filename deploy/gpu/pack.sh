#!/bin/bash
# Builds the GPU tests and benchmark here (no GPU needed) and packs them, with
# the non-system shared libraries they load, into build/gpu-pack for the GPU
# machine, which has the CUDA toolkit, CMake and PyTorch but none of our other
# libraries (deploy/gpu/check.sh runs them there and builds nothing).
#
#   deploy/gpu/pack.sh [BUILD_DIR]      (default: build)
#
# Not packed: glibc's own libraries, and the CUDA libraries but the runtime
# (cuBLAS is hundreds of MiB; check.sh finds the machine's, or PyTorch's).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$repo/build}
pack=$build/gpu-pack
targets=(cuda_backend_test nccl_collective_test model_stack_test pdserve-gpu-bench pdserve_cuda)
echo "building ${targets[*]} in $build"
cmake --build "$build" --target "${targets[@]}"
rm -rf "$pack"
mkdir -p "$pack/lib"
bins=("$build/tests/kernels/cuda_backend_test" "$build/tests/kernels/nccl_collective_test"
      "$build/tests/common/engine/model_stack_test" "$build/tools/gpu_bench/pdserve-gpu-bench")
cp "${bins[@]}" "$pack/"
cp "$build/kernels/libpdserve_cuda.so" "$pack/lib/"
skip='^(linux-vdso|/lib64/ld-linux|.*/(libc|libm|libdl|librt|libpthread|libresolv)\.so)'
for f in "$pack"/* "$pack/lib/libpdserve_cuda.so"; do
  [ -f "$f" ] || continue
  ldd "$f" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$lib" in
      */libcudart.so*) ;;  # Small: carried, so only cuBLAS and NCCL must match.
      /usr/local/cuda*|*/libcuda.so*) continue ;;  # The machine's CUDA, and the driver.
    esac
    if echo "$lib" | grep -Eq "$skip"; then continue; fi
    [ -e "$pack/lib/$(basename "$lib")" ] || cp -L "$lib" "$pack/lib/"
  done
done
# Missing CUDA libraries are the machine's to provide; list what is needed.
for f in "$pack"/* "$pack/lib/libpdserve_cuda.so"; do
  [ -f "$f" ] && ldd "$f" | awk '/\/usr\/local\/cuda/ && !/libcudart/ {print $1}'
done | sort -u > "$pack/cuda-libraries-needed.txt"
du -sh "$pack"
echo "CUDA libraries the machine must provide: $(tr '\n' ' ' < "$pack/cuda-libraries-needed.txt")"

#!/usr/bin/env bash
# Configures the project (configure only) the way a stock Debian 12 host
# with CUDA 13 at /usr/local/cuda would: CMake's own FindCUDAToolkit.cmake,
# as Debian ships it, against a CUDA 13 tree that has no libnvToolsExt (CUDA
# 13 dropped it). Debian's CMake 3.25.1 module marks CUDA::nvToolsExt
# deprecated whenever the project's minimum CMake version is 3.25 or more,
# whether or not the target exists, and configure then fails; some hosts
# carry a module that guards that line, which hides the failure, so the
# module is taken from this CMake and any such guard removed.
#
#   tests/deploy/cuda_configure.sh SOURCE_DIR
#
# The fake tree: bin/nvcc (a script answering the module's two questions:
# where the toolkit is, and its version), include/cuda_runtime.h and
# lib64/libcudart.so (empty files the module looks for). Passes when
# configure succeeds and says in one line that the CUDA backend is not
# built (the stub compiles nothing); the CPU build's configure goes on.
set -euo pipefail
src=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cuda=$work/cuda
mkdir -p "$cuda/bin" "$cuda/include" "$cuda/lib64"
: > "$cuda/include/cuda_runtime.h"
: > "$cuda/lib64/libcudart.so"
cat > "$cuda/bin/nvcc" <<EOF
#!/bin/sh
case "\$*" in
  *--version*) echo "nvcc: NVIDIA (R) Cuda compiler driver"; echo "Cuda compilation tools, release 13.0, V13.0.88" ;;
  *__cmake_determine_cuda*) echo "#\$ TOP=$cuda" ;;
  *) echo "nvcc stub: compiles nothing" >&2; exit 1 ;;
esac
EOF
chmod +x "$cuda/bin/nvcc"

# The stock module and the two it includes from its own directory.
modules=$(cmake --system-information 2>/dev/null | sed -n 's/^CMAKE_ROOT "\(.*\)"$/\1/p')/Modules
[[ -f $modules/FindCUDAToolkit.cmake ]] || { echo "no FindCUDAToolkit.cmake under $modules"; exit 1; }
mkdir -p "$work/modules"
cp "$modules/FindPackageHandleStandardArgs.cmake" "$modules/FindPackageMessage.cmake" "$work/modules/"
sed 's/if(TARGET CUDA::nvToolsExt AND CMAKE_MINIMUM_REQUIRED_VERSION/if(CMAKE_MINIMUM_REQUIRED_VERSION/' \
  "$modules/FindCUDAToolkit.cmake" > "$work/modules/FindCUDAToolkit.cmake"

log=$work/configure.log
if ! CUDACXX="$cuda/bin/nvcc" cmake -S "$src" -B "$work/build" -DCMAKE_MODULE_PATH="$work/modules" \
    -DCUDAToolkit_ROOT="$cuda" -DPDSERVE_BUILD_TESTS=OFF > "$log" 2>&1; then
  echo "FAIL: configure against a CUDA 13 tree with the stock FindCUDAToolkit.cmake:"
  tail -n 30 "$log"
  exit 1
fi
grep -q "CUDA toolkit: 13.0.88" "$log" || { echo "FAIL: the fake CUDA 13 toolkit was not the one found:"; cat "$log"; exit 1; }
grep -q "CUDA backend: not built" "$log" || { echo "FAIL: no line saying the CUDA backend is not built:"; cat "$log"; exit 1; }
echo "OK: configured against CUDA 13 with the stock module; $(grep 'CUDA backend' "$log" | sed 's/^-- //')"

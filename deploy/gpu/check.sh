#!/bin/bash
# Runs on the GPU machine, from the repository root, on what
# deploy/gpu/pack.sh built here (build/gpu-pack): the GPU tests, then the
# benchmark and PyTorch's SDPA on the same attention shapes. Builds nothing.
# Writes everything under $OUT (default /tmp/pdserve-gpu) as it goes, so a
# run cut short keeps what it measured. About 4-5 minutes.
#
#   OUT=/some/dir deploy/gpu/check.sh [PACK_DIR]
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
pack=${1:-$repo/build/gpu-pack}
out=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$out"
log() { echo "[check $(date +%T)] $*" | tee -a "$out/check.log"; }

# cuBLAS and the CUDA runtime: the toolkit's, else PyTorch's wheels'.
libs=$pack/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libs=$libs:$d
done
if ! ls /usr/local/cuda*/lib*/libcublas.so.13* > /dev/null 2>&1; then
  for f in $(find / -xdev -name 'libcublas.so.13*' 2> /dev/null | head -3); do libs=$libs:$(dirname "$f"); done
fi
export LD_LIBRARY_PATH=$libs:${LD_LIBRARY_PATH:-}
export PDSERVE_SOURCE_DIR=$repo
export PDSERVE_CUDA_MODULE=$pack/lib/libpdserve_cuda.so
log "pack $pack, out $out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
for b in "$pack"/*_test "$pack/pdserve-gpu-bench" "$pack/lib/libpdserve_cuda.so"; do
  if ldd "$b" | grep -q 'not found'; then log "$b: missing libraries:"; ldd "$b" | grep 'not found' | tee -a "$out/check.log"; fi
done

rc=0
for t in cuda_backend_test nccl_collective_test model_stack_test; do
  log "running $t"
  timeout 150 "$pack/$t" --gtest_output="xml:$out/$t.xml" > "$out/$t.txt" 2>&1
  r=$?
  tail -n 25 "$out/$t.txt"
  log "$t exit $r"
  [ $r -eq 0 ] || rc=1
done

log "running pdserve-gpu-bench"
timeout 200 "$pack/pdserve-gpu-bench" --out "$out" --budget_s "${BENCH_BUDGET_S:-150}" 2>&1 | tee "$out/gpu_bench.txt"
log "pdserve-gpu-bench exit ${PIPESTATUS[0]}"

log "running PyTorch SDPA on the same shapes"
timeout 90 python3 "$repo/deploy/gpu/sdpa_bench.py" 2>&1 | tee "$out/sdpa.txt"
log "done (tests rc $rc)"
exit $rc

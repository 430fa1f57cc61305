#!/usr/bin/env bash
# Bursts past the decode pool's KV: a local cluster (deploy/cluster.sh,
# TLS on), then `pdctl bench --burst N` for each N, every request sent at
# once, each of 8 prompt tokens and 32 output tokens (ignore_eos). Each row
# reports, beside the client's figures, the decode pool's own rate while
# busy and the router's side (workers ejected, requests queued and refused,
# prefill tokens discarded, the router's peak memory).
#
#   tools/bench/burst.sh [--prefill P] [--decode D] [--model DIR] [--http] [--pin]
#                        [--router-flag FLAG]... [BURST...]
#
# Defaults: 1 prefill + 1 decode worker, the shipped kjv-tiny model, bursts
# 1024 2048 4096, over gRPC. --http also sends each burst through the
# router's OpenAI HTTP API (a second row); --pin puts the prefill workers on
# core 0 and the decode workers on core 1 (deploy/cluster.sh). The cluster is started fresh for
# the run, so the router's peak memory is the run's own; its state lives in
# $PDSERVE_CLUSTER_DIR (default /tmp/pdserve-burst). Needs a build.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
export PDSERVE_CLUSTER_DIR=${PDSERVE_CLUSTER_DIR:-/tmp/pdserve-burst}
export PDSERVE_HTTP_PORT=${PDSERVE_HTTP_PORT:-8190}
prefill=1 decode=1 model=deploy/models/kjv-tiny http=0
extra=() bursts=()
while (($#)); do
  case "$1" in
    --prefill) prefill=$2; shift 2 ;;
    --decode) decode=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --http) http=1; shift ;;
    --pin) extra+=(--pin); shift ;;
    --router-flag) extra+=(--router-flag "$2"); shift 2 ;;
    -*) echo "burst.sh: unknown option $1" >&2; exit 2 ;;
    *) bursts+=("$1"); shift ;;
  esac
done
((${#bursts[@]})) || bursts=(1024 2048 4096)
trap 'deploy/cluster.sh stop >/dev/null 2>&1 || true' EXIT
deploy/cluster.sh stop >/dev/null 2>&1 || true
deploy/cluster.sh start --prefill "$prefill" --decode "$decode" --model "$model" "${extra[@]}" >/dev/null
router=$(cat "$PDSERVE_CLUSTER_DIR/router.address")
ca=$(cat "$PDSERVE_CLUSTER_DIR/tls_ca")
targets=(--router "$router")
((http)) && targets+=(--openai "https://127.0.0.1:$PDSERVE_HTTP_PORT")
echo "cluster: $prefill prefill + $decode decode, $model, $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p'))"
for n in "${bursts[@]}"; do
  echo "== burst $n"
  "$BUILD_DIR/tools/pdctl/pdctl" bench "${targets[@]}" --tls_ca "$ca" --burst "$n" --prompt-tokens 8 \
    --output-tokens 32 2> >(grep -v '^bench ' >&2)
done

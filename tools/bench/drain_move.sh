#!/usr/bin/env bash
# Drains one of two decode workers in the middle of a run, once with live
# moves (the draining worker ships each running sequence's KV to the other
# worker) and once with replay (moves off: the other worker recomputes each
# sequence's prompt and tokens so far), at each history length. Each row
# runs 16 streams of the 125M benchmark model against a fresh local cluster
# (1 prefill + 2 decode workers, TLS on) and reports `pdctl bench
# --drain-at`'s figures: each stream's largest inter-token gap, the moves
# and replays, the KV bytes moved and at what rate, the context positions
# computed again, and the bound a move's stall is held to (3 decode steps
# plus the KV transfer at the moves' measured rate).
#
#   tools/bench/drain_move.sh [--model DIR] [--streams N] [--drain-at S] [--modes move,replay]
#                             [HISTORY:OUTPUT...]
#
# Each HISTORY:OUTPUT is a prompt length and the tokens each stream
# generates; every stream must still decode when the last prompt has been
# prefilled (all run at once), so OUTPUT grows with HISTORY. Defaults: the
# 125M model made once in ${PDSERVE_BENCH_MODEL:-/tmp/pdserve-125m} (pdctl
# make-model, with the llama2 fixture's tokenizer), 16 streams, the drain 2 s
# after all of them decode, 512:1200 and 4096:3584. Each decode worker's
# pool holds every stream whole (--kv_positions), so that the worker left
# can take the drained one's. State lives in $PDSERVE_CLUSTER_DIR (default
# /tmp/pdserve-drain). Needs a build.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
PDCTL="$BUILD_DIR/tools/pdctl/pdctl"
export PDSERVE_CLUSTER_DIR=${PDSERVE_CLUSTER_DIR:-/tmp/pdserve-drain}
export PDSERVE_HTTP_PORT=${PDSERVE_HTTP_PORT:-8191}
model=${PDSERVE_BENCH_MODEL:-/tmp/pdserve-125m} streams=16 drain_at=2 modes=move,replay
histories=()
while (($#)); do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --streams) streams=$2; shift 2 ;;
    --drain-at) drain_at=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    -*) echo "drain_move.sh: unknown option $1" >&2; exit 2 ;;
    *) histories+=("$1"); shift ;;
  esac
done
((${#histories[@]})) || histories=(512:1200 4096:3584)
if [[ ! -f $model/config.json ]]; then
  echo "drain_move.sh: making the 125M model in $model"
  "$PDCTL" make-model --shape 125m --out "$model"
fi
# The servers need a tokenizer; the llama2 fixture's 32000 ids match the
# 125M shape's vocabulary.
[[ -f $model/tokenizer.json ]] || cp tests/fixtures/tokenizers/llama2/tokenizer*.json "$model/"
trap 'deploy/cluster.sh stop >/dev/null 2>&1 || true' EXIT
echo "cluster: 1 prefill + 2 decode, $model, $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p'))"
for pair in "${histories[@]}"; do
  history=${pair%%:*} output=${pair#*:}
  [[ $history =~ ^[0-9]+$ && $output =~ ^[0-9]+$ ]] || { echo "drain_move.sh: expected HISTORY:OUTPUT, got $pair" >&2; exit 2; }
  for mode in ${modes//,/ }; do
    [[ $mode == move || $mode == replay ]] || { echo "drain_move.sh: --modes takes move and replay, got $mode" >&2; exit 2; }
    # The rebalance is off in both modes: only the drain moves sequences.
    # Each decode pool holds every stream twice over (the router's room
    # accounting holds a replay's lease beside its predecessor's), and a
    # Decode call waits for its handoff as long as the one prefill worker
    # takes to work through every prompt.
    flags=(--decode-flag "--kv_positions=$((2 * streams * (history + output) + 4096))" --router-flag --rebalance=false
           --decode-flag --handoff_wait_s=600)
    # Replay: the worker does not move its sequences and hands them back at
    # once, so the router replays each on the other worker.
    [[ $mode == replay ]] && flags+=(--decode-flag --kv_moves=false --decode-flag --drain_grace_s=0.1)
    deploy/cluster.sh stop >/dev/null 2>&1 || true
    deploy/cluster.sh start --prefill 1 --decode 2 --model "$model" "${flags[@]}" >/dev/null
    pid=$(head -n 1 "$PDSERVE_CLUSTER_DIR/pids")  # decode0 starts first
    echo "== history $history, $output output tokens, $mode"
    "$PDCTL" bench --router "$(cat "$PDSERVE_CLUSTER_DIR/router.address")" --tls_ca "$(cat "$PDSERVE_CLUSTER_DIR/tls_ca")" \
      --requests "$streams" --concurrency "$streams" --prompt-tokens "$history" --output-tokens "$output" \
      --drain-at "$drain_at" --drain-pid "$pid" 2> >(grep -v '^bench [a-z]*:' >&2)
  done
done

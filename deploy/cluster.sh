#!/usr/bin/env bash
# A local pdserve cluster on loopback: one router, N prefill workers and M
# decode workers, as background processes.
#
#   deploy/cluster.sh start [--prefill N] [--decode M] [--colocated] [--pin] [--model DIR]
#                           [--router-flag FLAG]...   (e.g. --router-flag --admission)
#                           [--prefill-flag FLAG]... [--decode-flag FLAG]...
#                           [--prefill-tp N] [--decode-tp N] [--insecure] [--kv-tier2 DIR]
#   deploy/cluster.sh status
#   deploy/cluster.sh stop
#
# TLS by default: deploy/make_certs.sh makes (or keeps) a development CA and
# a certificate per role in ${PDSERVE_CERTS_DIR:-$PDSERVE_CLUSTER_DIR/certs};
# the hops between the processes are mutual TLS, the router's gRPC and HTTP
# ports TLS; clients trust the CA whose path is in $STATE/tls_ca (pdctl
# --tls_ca, curl --cacert). --insecure runs everything in plaintext, with
# a warning.
# State (pids, logs, ready files) lives in $PDSERVE_CLUSTER_DIR (default
# /tmp/pdserve-cluster). The router serves the OpenAI HTTP API on
# 127.0.0.1:${PDSERVE_HTTP_PORT:-8000}. --pin puts prefill workers on core 0 and decode
# workers on core 1 (taskset), the split the benchmarks use on 2 cores.
# Workers run --threads nproc/2 each; with --colocated the decode worker
# (which then also prefills) runs --threads nproc. --prefill-tp/--decode-tp
# run that pool's workers tensor-parallel over N ranks (threads), sharing
# the worker's threads (at least one each); pools of different TP sizes
# hand off to each other. --kv-tier2 DIR gives every worker a prefix cache
# second tier of its own in DIR/<worker> (--kv_tier2_dir), kept across
# restarts of the cluster.
# Needs a build (deploy/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
STATE=${PDSERVE_CLUSTER_DIR:-/tmp/pdserve-cluster}
PDCTL="$BUILD_DIR/tools/pdctl/pdctl"

die() { echo "cluster: $*" >&2; exit 1; }

wait_ready() {  # file, pid, what
  for _ in $(seq 600); do
    [[ -s "$1" ]] && { sed -e 's/.*"grpc_port":\([0-9]*\).*/\1/' "$1"; return 0; }
    kill -0 "$2" 2>/dev/null || { tail -n 20 "$STATE/$3.log" >&2; die "$3 exited during start-up (log: $STATE/$3.log)"; }
    sleep 0.1
  done
  die "$3 not ready after 60 s (log: $STATE/$3.log)"
}

start() {
  local prefill=1 decode=1 colocated=0 pin=0 model=${PDSERVE_MODEL:-deploy/models/kjv-tiny}
  local router_extra=() prefill_extra=() decode_extra=() insecure=0 prefill_tp=1 decode_tp=1 tier2=
  while (($#)); do
    case "$1" in
      --prefill) prefill=$2; shift 2 ;;
      --decode) decode=$2; shift 2 ;;
      --colocated) colocated=1; shift ;;
      --pin) pin=1; shift ;;
      --model) model=$2; shift 2 ;;
      --router-flag) router_extra+=("$2"); shift 2 ;;
      --prefill-flag) prefill_extra+=("$2"); shift 2 ;;
      --decode-flag) decode_extra+=("$2"); shift 2 ;;
      --prefill-tp) prefill_tp=$2; shift 2 ;;
      --decode-tp) decode_tp=$2; shift 2 ;;
      --insecure) insecure=1; shift ;;
      --kv-tier2) tier2=$2; shift 2 ;;
      *) die "unknown option $1" ;;
    esac
  done
  [[ -x "$BUILD_DIR/router/pdserve-router" ]] || die "no build in $BUILD_DIR (run deploy/bootstrap.sh)"
  if [[ -f "$STATE/pids" ]]; then stop; fi
  mkdir -p "$STATE"
  rm -f "$STATE"/*.ready "$STATE"/pids "$STATE"/tls_ca
  # tls_flags ROLE: the TLS flags of a process of that role (none for a
  # build from before TLS).
  local certs="" help
  # What this build's router takes (builds from before TLS or the HTTP API
  # lack those flags).
  help=$("$BUILD_DIR/router/pdserve-router" --helpfull 2>/dev/null || true)
  if [[ $help == *--tls_cert* ]]; then
    if ((insecure)); then
      echo "cluster: WARNING: --insecure: every port is plaintext and no peer is checked" >&2
    else
      certs=$(deploy/make_certs.sh "${PDSERVE_CERTS_DIR:-$STATE/certs}")
      echo "$certs/ca.pem" > "$STATE/tls_ca"
    fi
  fi
  tls_flags() {
    if [[ -n $certs ]]; then
      # The router mints KV grants; decode and prefill workers check them
      # (handoffs; prefix pulls).
      local grant=""
      [[ $1 == router || $1 == decode || $1 == prefill ]] && grant=" --kv_grant_key=$certs/kv_grant.key"
      echo "--tls_cert=$certs/$1.pem --tls_key=$certs/$1.key --tls_ca=$certs/ca.pem$grant"
    elif ((insecure)); then
      echo "--insecure"
    fi
  }
  # Disaggregated: each worker gets half the cores (one each on 2 cores);
  # colocated: the one worker that prefills and decodes gets them all.
  local threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
  ((colocated)) && threads=$(nproc)
  local decode_addrs=() prefill_addrs=()
  # launch NAME CORE BINARY ROLE: starts one worker (pinned to CORE with --pin)
  # and prints its address once it is ready.
  launch() {
    local pre=()
    ((pin)) && pre=(taskset -c "$2")
    local tls extra=()
    read -r -a tls <<< "$(tls_flags "$4")"
    local tp=$decode_tp
    if [[ $4 == prefill ]]; then extra=("${prefill_extra[@]}"); tp=$prefill_tp; else extra=("${decode_extra[@]}"); fi
    local rank_threads=$(( threads / tp > 0 ? threads / tp : 1 ))
    ((tp > 1)) && extra=(--tp "$tp" "${extra[@]}")
    [[ -n $tier2 ]] && extra+=(--kv_tier2_dir "$tier2/$1")
    setsid "${pre[@]}" "$BUILD_DIR/$3" --model "$model" --threads "$rank_threads" "${tls[@]}" "${extra[@]}" \
      --ready_file "$STATE/$1.ready" < /dev/null > "$STATE/$1.log" 2>&1 &
    echo "$!" >> "$STATE/pids"
    local port
    port=$(wait_ready "$STATE/$1.ready" $! "$1") || exit 1
    echo "127.0.0.1:$port"
  }
  local addr
  for i in $(seq 0 $((decode - 1))); do
    addr=$(launch "decode$i" 1 decode_worker/pdserve-decode-worker decode) || exit 1
    decode_addrs+=("$addr")
  done
  if ((!colocated)); then
    for i in $(seq 0 $((prefill - 1))); do
      addr=$(launch "prefill$i" 0 prefill_worker/pdserve-prefill-worker prefill) || exit 1
      prefill_addrs+=("$addr")
    done
  fi
  local rargs=(--model "$model" --decode "$(IFS=,; echo "${decode_addrs[*]}")" --ready_file "$STATE/router.ready"
               --listen "127.0.0.1:${PDSERVE_ROUTER_PORT:-0}")
  # The OpenAI HTTP API (builds from before it have no such flag).
  if [[ $help == *--http_listen* ]]; then
    rargs+=(--http_listen "127.0.0.1:${PDSERVE_HTTP_PORT:-8000}")
  fi
  if ((colocated)); then rargs+=(--colocated); else rargs+=(--prefill "$(IFS=,; echo "${prefill_addrs[*]}")"); fi
  local rtls
  read -r -a rtls <<< "$(tls_flags router)"
  rargs+=("${rtls[@]}" "${router_extra[@]}")
  setsid "$BUILD_DIR/router/pdserve-router" "${rargs[@]}" < /dev/null > "$STATE/router.log" 2>&1 &
  echo "$!" >> "$STATE/pids"
  local port
  port=$(wait_ready "$STATE/router.ready" $! router)
  echo "127.0.0.1:$port" > "$STATE/router.address"
  local http
  http=$(sed -n -e 's/.*"http_port":\([0-9]*\).*/\1/p' "$STATE/router.ready")
  local scheme=http pdctl_tls=()
  if [[ -n $certs ]]; then scheme=https; pdctl_tls=(--tls_ca "$certs/ca.pem"); fi
  if [[ -n $http ]]; then echo "$scheme://127.0.0.1:$http" > "$STATE/router.http"; else rm -f "$STATE/router.http"; fi
  "$PDCTL" status --router "127.0.0.1:$port" "${pdctl_tls[@]}" >/dev/null || die "router not answering (log: $STATE/router.log)"
  echo "cluster: router 127.0.0.1:$port${http:+ (OpenAI HTTP API: $scheme://127.0.0.1:$http/v1)}, TLS $([[ -n $certs ]] && echo "on (CA $certs/ca.pem)" || echo off), prefill [${prefill_addrs[*]:-}], decode [${decode_addrs[*]}] (logs in $STATE)"
}

stop() {
  [[ -f "$STATE/pids" ]] || { echo "cluster: not running"; return 0; }
  while read -r pid; do kill -TERM "$pid" 2>/dev/null || true; done < "$STATE/pids"
  for _ in $(seq 50); do
    alive=0
    while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1; done < "$STATE/pids"
    ((alive)) || break
    sleep 0.1
  done
  while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done < "$STATE/pids"
  rm -f "$STATE/pids" "$STATE/router.address" "$STATE/router.http" "$STATE/tls_ca"
  echo "cluster: stopped"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status)
    [[ -f "$STATE/router.address" ]] || die "not running"
    tls=()
    [[ -f "$STATE/tls_ca" ]] && tls=(--tls_ca "$(cat "$STATE/tls_ca")")
    "$PDCTL" status --router "$(cat "$STATE/router.address")" "${tls[@]}" ;;
  *) die "usage: $0 start|status|stop" ;;
esac

#!/usr/bin/env bash
# The main job. Installs and builds what is missing, starts a local pdserve
# cluster on loopback — a router, a prefill worker and a decode worker, the
# KV cache handed from one to the other over pdserve's TCP transport — on
# the embedded default model (deploy/models/kjv-tiny, a small
# Llama-architecture model the repository trained itself on the King James
# Bible), waits until all three serve, and streams a sample generation and
# a chat turn through it.
#
# Options go to deploy/cluster.sh start: --prefill N, --decode M,
# --colocated, --pin (prefill on core 0, decode on core 1). The cluster keeps
# running afterwards; stop it with deploy/cluster.sh stop.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the main job runs: the three servers and pdctl (deploy/test.sh
# builds the rest).
deploy/bootstrap.sh pdserve-router pdserve-prefill-worker pdserve-decode-worker pdctl
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
PDCTL="$BUILD_DIR/tools/pdctl/pdctl"
PROMPT=${PDSERVE_PROMPT:-"And God said, Let there be"}
STATE=${PDSERVE_CLUSTER_DIR:-/tmp/pdserve-cluster}

echo
echo "== starting a local cluster =="
deploy/cluster.sh start "$@"
ROUTER=$(cat "$STATE/router.address")
# TLS (the default): pdctl and curl trust the cluster's development CA.
TLS=() CURL_TLS=()
if [[ -f "$STATE/tls_ca" ]]; then TLS=(--tls_ca "$(cat "$STATE/tls_ca")"); CURL_TLS=(--cacert "$(cat "$STATE/tls_ca")"); fi
"$PDCTL" status --router "$ROUTER" "${TLS[@]}"

echo
echo "== generation through the cluster (router $ROUTER) =="
echo "prompt: $PROMPT"
echo "--------"
printf '%s' "$PROMPT"
"$PDCTL" generate --router "$ROUTER" "${TLS[@]}" --prompt "$PROMPT" --max-tokens 60 --temperature 0.7 --top-p 0.9 --seed 42
echo "--------"
echo
echo "== a chat turn (the model's ChatML template, rendered by the router) =="
MESSAGES=$(mktemp)
trap 'rm -f "$MESSAGES"' EXIT
echo '[{"role": "user", "content": "Who was the father of Isaac?"}]' > "$MESSAGES"
"$PDCTL" generate --router "$ROUTER" "${TLS[@]}" --chat-json "$MESSAGES" --max-tokens 40 --seed 7 --temperature 0.7
if [[ -f "$STATE/router.http" ]]; then
  HTTP=$(cat "$STATE/router.http")
  echo
  echo "== the same cluster through the OpenAI HTTP API ($HTTP/v1) =="
  BODY='{"model": "kjv-tiny", "prompt": "In the beginning", "max_tokens": 24, "seed": 7}'
  echo "curl -s ${CURL_TLS[*]} $HTTP/v1/completions -H 'Content-Type: application/json' -d '$BODY'"
  curl -s "${CURL_TLS[@]}" --max-time 60 "$HTTP/v1/completions" -H 'Content-Type: application/json' -d "$BODY"
  echo
fi
echo
echo "The cluster is still running (logs in $STATE):"
echo "  $PDCTL generate --router $ROUTER ${TLS[*]} --prompt 'In the beginning' --max-tokens 40"
echo "  $PDCTL status --router $ROUTER ${TLS[*]}"
echo "  gRPC: pdserve.v1.Generation at $ROUTER (server reflection and grpc.health.v1 are on)"
[[ -n ${HTTP:-} ]] && echo "  OpenAI HTTP API: $HTTP/v1 (README: \"The OpenAI HTTP API\")"
echo "  stop: deploy/cluster.sh stop"

#!/usr/bin/env bash
# The router's relay cost alone: a stand-in decode worker
# (pdserve-decode-worker --stand_in: streams max_tokens dummy tokens at once,
# no model work) on core 1, a colocated router on core 0, and pdctl bench
# through it (64 requests x 400 tokens, concurrency 8 by default). Prints
# tokens/s through the router and the per-message relay cost (read from the
# worker to written to the client): the median of the requests' p50s and
# the largest p99. Targets (issue 20): >= 50k tokens/s, <= 50 us p50.
#
#   tools/bench/relay_cost.sh [BUILD_DIR] [RUNS]
#
# Each run starts fresh servers; the summary gives every run and the median.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
RUNS=${2:-3}
MODEL=deploy/models/kjv-tiny
OUT=$(mktemp -d /tmp/relay-cost.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT

wait_ready() {  # FILE
  for _ in $(seq 1 300); do [[ -s $1 ]] && return 0; sleep 0.1; done
  echo "not ready: $1" >&2; return 1
}
port_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["grpc_port"])' "$1"; }

for run in $(seq 1 "$RUNS"); do
  rm -f "$OUT"/*.ready
  taskset -c 1 "$BUILD/decode_worker/pdserve-decode-worker" --model "$MODEL" --stand_in --metrics_listen= \
    --ready_file "$OUT/decode.ready" > "$OUT/decode.log" 2>&1 &
  dpid=$!
  wait_ready "$OUT/decode.ready"
  taskset -c 0 "$BUILD/router/pdserve-router" --model "$MODEL" --colocated --metrics_listen= --http_listen=127.0.0.1:0 \
    --decode "127.0.0.1:$(port_of "$OUT/decode.ready")" --ready_file "$OUT/router.ready" > "$OUT/router.log" 2>&1 &
  rpid=$!
  wait_ready "$OUT/router.ready"
  taskset -c 0 "$BUILD/tools/pdctl/pdctl" bench --router "127.0.0.1:$(port_of "$OUT/router.ready")" \
    --requests 64 --concurrency 8 --prompt-tokens 16 --output-tokens 400 --json > "$OUT/bench-$run.json" 2>/dev/null
  kill "$rpid" "$dpid"; wait "$rpid" "$dpid" 2>/dev/null || true
done

python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
rows = []
for r in range(1, runs + 1):
    j = json.load(open(f"{out}/bench-{r}.json"))["runs"][0]
    if j["failed"]:
        sys.exit(f"run {r}: {j['failed']} requests failed")
    tps = j["output_tokens_per_second"]
    relay = j["router_relay_seconds"]
    rows.append((tps, relay["p50"] * 1e6, relay["p99"] * 1e6))
    print(f"run {r}: {tps:,.0f} tokens/s through the router, relay p50 {relay['p50']*1e6:.1f} us, p99 {relay['p99']*1e6:.0f} us")
print(f"median: {statistics.median(t for t, _, _ in rows):,.0f} tokens/s (target >= 50,000), "
      f"relay p50 {statistics.median(p for _, p, _ in rows):.1f} us (target <= 50), "
      f"p99 {statistics.median(p for _, _, p in rows):.0f} us")
PY

#!/usr/bin/env bash
# The router's relay cost alone: a stand-in decode worker
# (pdserve-decode-worker --stand_in: streams max_tokens dummy tokens at once,
# no model work) on core 1, a colocated router on core 0, and pdctl bench
# through it (64 requests x 400 tokens, concurrency 8 by default), over
# the gRPC API and over the OpenAI HTTP API in the same run (each run's two
# rows share the servers). Prints tokens/s through the router and the
# per-message relay cost (read from the worker to handed to the client's
# writer: a gRPC Write returns once gRPC has the message; over HTTP the
# event is formatted and queued for the event loop, whose socket write is
# not in the figure but is in the tokens/s): the median of the requests'
# p50s and the largest p99. Targets: >= 50k tokens/s,
# <= 50 us p50, over either API.
#
#   tools/bench/relay_cost.sh [BUILD_DIR] [RUNS]
#   CONCURRENCY=64 REQUESTS=256 tools/bench/relay_cost.sh   (64 streams)
#   TLS=both tools/bench/relay_cost.sh build 5              (TLS off and on, same run)
#
# Each run starts fresh servers; the summary gives every run and the median.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
RUNS=${2:-3}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-64}
MODEL=deploy/models/kjv-tiny
OUT=$(mktemp -d /tmp/relay-cost.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT

wait_ready() {  # FILE
  for _ in $(seq 1 300); do [[ -s $1 ]] && return 0; sleep 0.1; done
  echo "not ready: $1" >&2; return 1
}
port_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2] if len(sys.argv) > 2 else "grpc_port"])' "$@"; }

# TLS=on|off|both (default off): "both" runs each run's servers twice, TLS
# off then on (mutual TLS router <-> worker, TLS to the router's gRPC and
# HTTPS ports), so the two are measured side by side.
case "${TLS:-off}" in
  off) MODES=(off) ;; on) MODES=(on) ;; both) MODES=(off on) ;; *) echo "TLS=on|off|both" >&2; exit 2 ;;
esac
[[ " ${MODES[*]} " == *" on "* ]] && deploy/make_certs.sh "$OUT/certs" > /dev/null

for run in $(seq 1 "$RUNS"); do
  for tls in "${MODES[@]}"; do
    rm -f "$OUT"/*.ready
    if [[ $tls == on ]]; then
      dflags=(--tls_cert "$OUT/certs/decode.pem" --tls_key "$OUT/certs/decode.key" --tls_ca "$OUT/certs/ca.pem"
              --kv_grant_key "$OUT/certs/kv_grant.key")
      rflags=(--tls_cert "$OUT/certs/router.pem" --tls_key "$OUT/certs/router.key" --tls_ca "$OUT/certs/ca.pem"
              --kv_grant_key "$OUT/certs/kv_grant.key")
      cflags=(--tls_ca "$OUT/certs/ca.pem"); scheme=https
    else
      dflags=(--insecure); rflags=(--insecure); cflags=(); scheme=http
    fi
    taskset -c 1 "$BUILD/decode_worker/pdserve-decode-worker" --model "$MODEL" --stand_in --metrics_listen= "${dflags[@]}" \
      --ready_file "$OUT/decode.ready" > "$OUT/decode.log" 2>&1 &
    dpid=$!
    wait_ready "$OUT/decode.ready"
    taskset -c 0 "$BUILD/router/pdserve-router" --model "$MODEL" --colocated --metrics_listen=127.0.0.1:0 \
      --http_listen=127.0.0.1:0 "${rflags[@]}" \
      --decode "127.0.0.1:$(port_of "$OUT/decode.ready")" --ready_file "$OUT/router.ready" > "$OUT/router.log" 2>&1 &
    rpid=$!
    wait_ready "$OUT/router.ready"
    taskset -c 0 "$BUILD/tools/pdctl/pdctl" bench --router "127.0.0.1:$(port_of "$OUT/router.ready")" "${cflags[@]}" \
      --openai "$scheme://127.0.0.1:$(port_of "$OUT/router.ready" http_port)" \
      --requests "$REQUESTS" --concurrency "$CONCURRENCY" --prompt-tokens 16 --output-tokens 400 --json \
      > "$OUT/bench-$run-$tls.json" 2>/dev/null
    python3 - "$(port_of "$OUT/router.ready" metrics_port)" > "$OUT/metrics-$run-$tls.txt" <<'PY'
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode())
PY
    kill "$rpid" "$dpid"; wait "$rpid" "$dpid" 2>/dev/null || true
  done
done

python3 - "$OUT" "$RUNS" "$CONCURRENCY" "${MODES[*]}" <<'PY'
import json, re, statistics, sys
out, runs, conc, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split()
rows, waits = {}, {}
for r in range(1, runs + 1):
    for tls in modes:
        for j in json.load(open(f"{out}/bench-{r}-{tls}.json"))["runs"]:
            api = ("gRPC" if j["target"] == "cluster" else "HTTP") + (" TLS" if tls == "on" else "")
            if j["failed"]:
                sys.exit(f"run {r} {api}: {j['failed']} requests failed ({j.get('first_error', '')})")
            tps = j["output_tokens_per_second"]
            relay = j["router_relay_seconds"]
            rows.setdefault(api, []).append((tps, relay["p50"] * 1e6, relay["p99"] * 1e6))
            print(f"run {r} {api}: {tps:,.0f} tokens/s through the router, relay p50 {relay['p50']*1e6:.1f} us, "
                  f"p99 {relay['p99']*1e6:.0f} us")
        # The HTTP loop's share: event queued by the relay -> handed to the
        # socket, from the router's histogram (the bucket holding the median).
        buckets = [(float(le), int(float(n))) for le, n in re.findall(
            r'pdserve_http_event_write_delay_seconds_bucket\{le="([^"]+)"\} (\S+)',
            open(f"{out}/metrics-{r}-{tls}.txt").read())]
        if buckets and buckets[-1][1] > 0:
            waits.setdefault(tls, []).append(next(le for le, n in buckets if n >= buckets[-1][1] / 2))
for api, rs in rows.items():
    print(f"median {api} (concurrency {conc}): {statistics.median(t for t, _, _ in rs):,.0f} tokens/s "
          f"(target >= 50,000), relay p50 {statistics.median(p for _, p, _ in rs):.1f} us (target <= 50), "
          f"p99 {statistics.median(p for _, _, p in rs):.0f} us")
for tls, w in waits.items():
    print(f"HTTP event loop{' (TLS)' if tls == 'on' else ''}: queued -> written to the socket, median bucket "
          f"<= {statistics.median(w)*1e6:.0f} us (per run: {', '.join(f'{x*1e6:.0f}' for x in w)} us)")
def med(api):
    return statistics.median(t for t, _, _ in rows[api]) if api in rows else None
if med("gRPC") and med("HTTP"):
    print(f"HTTP / gRPC tokens/s: {med('HTTP') / med('gRPC'):.2f}")
for api in ("gRPC", "HTTP"):
    if med(api) and med(api + " TLS"):
        print(f"{api}: TLS / plaintext tokens/s: {med(api + ' TLS') / med(api):.2f}")
PY

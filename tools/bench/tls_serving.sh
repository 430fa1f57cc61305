#!/usr/bin/env bash
# The README's serving rows with TLS off and on, same run: for each run,
# deploy/cluster.sh --pin starts the cluster plaintext (--insecure), then
# with its default TLS (mutual TLS router <-> workers, TLS to the router),
# and pdctl bench drives each at docs/performance.md's concurrencies (128-token
# prompts, 64 output tokens, greedy). Prints each row's tokens/s, TTFT and
# ITL p50 per mode, the medians and the TLS / plaintext ratios.
#
#   tools/bench/tls_serving.sh [BUILD_DIR] [RUNS]
#   CONCURRENCY="8:24 32:96" (concurrency:requests pairs; default "1:16 8:24 32:96")
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
RUNS=${2:-2}
CONCURRENCY=${CONCURRENCY:-"1:16 8:24 32:96"}
OUT=$(mktemp -d /tmp/tls-serving.XXXXXX)
export PDSERVE_BUILD_DIR=$BUILD PDSERVE_CLUSTER_DIR="$OUT/cluster"
trap 'deploy/cluster.sh stop > /dev/null 2>&1 || true' EXIT

for run in $(seq 1 "$RUNS"); do
  for tls in off on; do
    flags=(--pin)
    [[ $tls == off ]] && flags+=(--insecure)
    deploy/cluster.sh start "${flags[@]}" > /dev/null 2>&1
    router=$(cat "$OUT/cluster/router.address")
    ca=()
    [[ -f "$OUT/cluster/tls_ca" ]] && ca=(--tls_ca "$(cat "$OUT/cluster/tls_ca")")
    for c in $CONCURRENCY; do
      "$BUILD/tools/pdctl/pdctl" bench --router "$router" "${ca[@]}" --requests "${c#*:}" --concurrency "${c%%:*}" \
        --prompt-tokens 128 --output-tokens 64 --json > "$OUT/bench-$run-$tls-c${c%%:*}.json" 2>/dev/null
    done
    deploy/cluster.sh stop > /dev/null
  done
done

python3 - "$OUT" "$RUNS" "$CONCURRENCY" <<'PY'
import json, statistics, sys
out, runs, conc = sys.argv[1], int(sys.argv[2]), [c.split(":")[0] for c in sys.argv[3].split()]
print("concurrency  TLS  tok/s (runs)            TTFT p50 ms   ITL p50 ms")
for c in conc:
    med = {}
    for tls in ("off", "on"):
        rows = []
        for r in range(1, runs + 1):
            j = json.load(open(f"{out}/bench-{r}-{tls}-c{c}.json"))["runs"][0]
            if j["failed"]:
                sys.exit(f"run {r} TLS {tls} c={c}: {j['failed']} failed ({j.get('first_error', '')})")
            rows.append((j["output_tokens_per_second"], j["ttft_seconds"]["p50"] * 1e3, j["itl_seconds"]["p50"] * 1e3))
        med[tls] = [statistics.median(x[i] for x in rows) for i in range(3)]
        print(f"{c:>11}  {tls:>3}  {med[tls][0]:7.0f} ({', '.join(f'{x[0]:.0f}' for x in rows)})"
              f"{'':>4}{med[tls][1]:8.1f}   {med[tls][2]:8.2f}")
    print(f"{c:>11}  on/off: tok/s {med['on'][0] / med['off'][0]:.2f}, TTFT {med['on'][1] / med['off'][1]:.2f}, "
          f"ITL {med['on'][2] / med['off'][2]:.2f}")
PY

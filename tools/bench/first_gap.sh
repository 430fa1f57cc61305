#!/usr/bin/env bash
# The first gap (token 1 -> 2, where the KV handoff shows to a user: DESIGN.md
# fact 14) against the steady inter-token gap, with the prefill worker's
# layer-by-layer KV streaming on and off (--kv_stream_layers), same run.
# For each run and mode: deploy/cluster.sh --pin starts the cluster (prefill
# on core 0, decode on core 1), pdctl bench sends long prompts one at a time
# (so no request waits behind another), and the medians over runs of the
# first gap's and the steady ITL's p50 are printed per mode.
#
#   tools/bench/first_gap.sh [BUILD_DIR] [RUNS]
#   MODEL=/tmp/m125 PROMPT=1536 REQUESTS=8 OUTPUT=16 (defaults: the embedded model, whose
#   context is 512 positions, 448, 8, 16). The 125M shape: pdctl make-model --shape 125m
#   --out /tmp/m125, then cp tests/fixtures/tokenizers/llama2/tokenizer*.json /tmp/m125/
#   (the servers need a tokenizer; its 32000 ids match the shape's vocabulary).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
RUNS=${2:-2}
MODEL=${MODEL:-deploy/models/kjv-tiny}
PROMPT=${PROMPT:-448}
REQUESTS=${REQUESTS:-8}
OUTPUT=${OUTPUT:-16}
OUT=$(mktemp -d /tmp/first-gap.XXXXXX)
export PDSERVE_BUILD_DIR=$BUILD PDSERVE_CLUSTER_DIR="$OUT/cluster"
trap 'deploy/cluster.sh stop > /dev/null 2>&1 || true' EXIT

for run in $(seq 1 "$RUNS"); do
  for stream in true false; do
    deploy/cluster.sh start --pin --model "$MODEL" --prefill-flag "--kv_stream_layers=$stream" > /dev/null 2>&1
    router=$(cat "$OUT/cluster/router.address")
    "$BUILD/tools/pdctl/pdctl" bench --router "$router" --tls_ca "$(cat "$OUT/cluster/tls_ca")" \
      --requests "$REQUESTS" --concurrency 1 --prompt-tokens "$PROMPT" --output-tokens "$OUTPUT" --json \
      > "$OUT/bench-$run-$stream.json" 2>/dev/null
    deploy/cluster.sh stop > /dev/null
  done
done

python3 - "$OUT" "$RUNS" "$MODEL" "$PROMPT" <<'PY'
import json, statistics, sys
out, runs, model, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"model {model}, {prompt}-token prompts, one request at a time; medians of {runs} runs (each run's p50)")
print("layer streaming   first gap ms (runs)        steady ITL ms   TTFT ms   first gap / steady ITL")
med = {}
for stream in ("true", "false"):
    rows = []
    for r in range(1, runs + 1):
        j = json.load(open(f"{out}/bench-{r}-{stream}.json"))["runs"][0]
        if j["failed"]:
            sys.exit(f"run {r} streaming {stream}: {j['failed']} failed ({j.get('first_error', '')})")
        rows.append((j["first_gap_seconds"]["p50"] * 1e3, j["steady_itl_seconds"]["p50"] * 1e3,
                     j["ttft_seconds"]["p50"] * 1e3))
    med[stream] = [statistics.median(x[i] for x in rows) for i in range(3)]
    label = "on" if stream == "true" else "off"
    print(f"{label:>15}   {med[stream][0]:8.2f} ({', '.join(f'{x[0]:.2f}' for x in rows)})"
          f"{'':>6}{med[stream][1]:8.2f}   {med[stream][2]:7.1f}   {med[stream][0] / med[stream][1]:.2f}")
print(f"streaming saves {med['false'][0] - med['true'][0]:.2f} ms of the first gap "
      f"({med['true'][0] / med['false'][0]:.2f}x)")
PY

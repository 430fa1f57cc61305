#!/usr/bin/env bash
# Side-by-side performance of two builds (say, before and after a
# restructuring), alternating runs so that the machine's drift hits both
# alike, and medians of each: the engine (pdctl bench-engine, one weight
# format), the KV handoff (pdctl bench-kv over shared memory) and the
# serving rows of docs/performance.md (deploy/cluster.sh --pin, then pdctl bench at
# concurrency 1, 8 and 32, disaggregated and colocated).
#
#   tools/bench/side_by_side.sh OLD_BUILD_DIR NEW_BUILD_DIR [RUNS] [WEIGHTS]
#
# Defaults: 3 runs, bf16 weights. Each build is used whole: its pdctl and
# its servers. SERVING_ONLY=1 skips the engine and KV rows; CONCURRENCY
# sets the serving rows (default "1:16 8:24 32:96", concurrency:requests),
# e.g. SERVING_ONLY=1 CONCURRENCY="8:24 32:96" to re-measure the loaded rows. Raw JSON goes to $OUT (default /tmp/side-by-side); the
# summary (medians, new/old ratio) to stdout. Takes about 10 minutes per
# run pair on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?old build dir}
NEW=${2:?new build dir}
RUNS=${3:-3}
WEIGHTS=${4:-bf16}
OUT=${OUT:-/tmp/side-by-side}
SERVING_ONLY=${SERVING_ONLY:-0}
CONCURRENCY=${CONCURRENCY:-"1:16 8:24 32:96"}
mkdir -p "$OUT"
MODEL125="$OUT/m125-$WEIGHTS"
[[ $SERVING_ONLY == 1 || -f "$MODEL125/config.json" ]] ||
  "$NEW/tools/pdctl/pdctl" make-model --shape 125m --dtype "$WEIGHTS" --out "$MODEL125" >/dev/null

serving() {  # BUILD TAG RUN
  local build=$1 tag=$2 run=$3
  for mode in disaggregated colocated; do
    local flags=(--pin)
    [[ $mode == colocated ]] && flags=(--colocated)
    PDSERVE_BUILD_DIR=$build PDSERVE_CLUSTER_DIR="$OUT/cluster" deploy/cluster.sh start "${flags[@]}" >/dev/null
    local router
    router=$(cat "$OUT/cluster/router.address")
    local tls=()
    [[ -f "$OUT/cluster/tls_ca" ]] && tls=(--tls_ca "$(cat "$OUT/cluster/tls_ca")")
    for c in $CONCURRENCY; do
      "$build/tools/pdctl/pdctl" bench --router "$router" "${tls[@]}" --requests "${c#*:}" --concurrency "${c%%:*}" \
        --prompt-tokens 128 --output-tokens 64 --json > "$OUT/serving-$tag-$mode-c${c%%:*}-$run.json" 2>/dev/null
    done
    PDSERVE_BUILD_DIR=$build PDSERVE_CLUSTER_DIR="$OUT/cluster" deploy/cluster.sh stop >/dev/null
  done
}

for run in $(seq 1 "$RUNS"); do
  for side in old new; do
    build=$OLD
    [[ $side == new ]] && build=$NEW
    echo "run $run/$RUNS: $side ($build)" >&2
    if [[ $SERVING_ONLY != 1 ]]; then
      "$build/tools/pdctl/pdctl" bench-engine --model "$MODEL125" --threads 2 --weights "$WEIGHTS" --kv bf16 --json \
        > "$OUT/engine-$side-$run.json" 2>/dev/null
      UCX_TLS=sm,tcp,self "$build/tools/pdctl/pdctl" bench-kv --prompt-len 2048 --json > "$OUT/kv-$side-$run.json" 2>/dev/null
    fi
    serving "$build" "$side" "$run"
  done
done

python3 - "$OUT" "$RUNS" <<'EOF'
import glob, json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])

def load(path):
    text = open(path).read()
    return json.loads(text[text.index('{'):])

def row(j):  # The first bench row in a pdctl bench --json object.
    if isinstance(j, dict):
        if 'ttft_seconds' in j: return j
        for v in j.values():
            r = row(v)
            if r: return r
    if isinstance(j, list):
        for v in j:
            r = row(v)
            if r: return r
    return None

def tokens_per_second(r):
    return r['output_tokens_per_second'] if 'output_tokens_per_second' in r else r['throughput']['output_tokens_per_second']

def med(side, pattern, get):
    vals = [get(load(f)) for f in sorted(glob.glob(f"{out}/{pattern.format(side=side)}"))]
    return statistics.median(vals) if vals else float('nan'), len(vals)

metrics = []
for p in ['512', '2048']:
    metrics.append((f"engine prefill {p} tok/s", "engine-{side}-*.json",
                    lambda j, p=p: next(x['tokens_per_second'] for x in j['prefill'] if str(x['tokens']) == p)))
metrics.append(("engine prefix hit new tok/s", "engine-{side}-*.json", lambda j: j['prefix_hit']['new_tokens_per_second']))
for b, h in [(1, 512), (8, 512), (32, 512), (32, 4096)]:
    metrics.append((f"engine decode b={b} h={h} tok/s", "engine-{side}-*.json",
                    lambda j, b=b, h=h: next(x['tokens_per_second'] for x in j['decode']
                                             if x['batch'] == b and x['history'] == h)))
metrics.append(("kv handoff stream+commit ms", "kv-{side}-*.json", lambda j: j['stream_commit_ms_median']))
metrics.append(("kv handoff GB/s", "kv-{side}-*.json", lambda j: j['handoff_gbps']))
for mode in ['disaggregated', 'colocated']:
    for c in [1, 8, 32]:
        pat = f"serving-{{side}}-{mode}-c{c}-*.json"
        metrics.append((f"{mode} c={c} tok/s", pat, lambda j: tokens_per_second(row(j))))
        metrics.append((f"{mode} c={c} TTFT p50 ms", pat, lambda j: row(j)['ttft_seconds']['p50'] * 1e3))
        metrics.append((f"{mode} c={c} ITL p50 ms", pat, lambda j: row(j)['itl_seconds']['p50'] * 1e3))

print(f"{'metric':40s} {'old':>10s} {'new':>10s} {'new/old':>8s}  (medians of {runs})")
for name, pattern, get in metrics:
    try:
        o, no = med('old', pattern, get)
        n, nn = med('new', pattern, get)
        if no == 0 or nn == 0:
            continue  # Not measured in this run (SERVING_ONLY, CONCURRENCY).
    except (KeyError, StopIteration, ValueError, TypeError) as e:
        print(f"{name:40s} (missing: {e})")
        continue
    print(f"{name:40s} {o:10.3f} {n:10.3f} {n / o if o else float('nan'):8.3f}")
EOF

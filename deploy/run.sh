#!/usr/bin/env bash
# The main job. Installs and builds what is missing, then runs what pdserve
# can run today: an in-process greedy generation on a small Llama-family
# model that the repository makes itself (tests/fixtures/make_models.py).
# The local router/prefill/decode cluster replaces this once it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
MODEL=${PDSERVE_MODEL:-tests/fixtures/models/llama_untied_bf16}
PROMPT=${PDSERVE_PROMPT_IDS:-1,17,42,99,7}
echo
echo "== pdserve: in-process generation =="
echo "model:  $MODEL (random weights: the ids below are not text yet)"
echo "prompt: $PROMPT"
echo -n "generated ids: "
"$BUILD_DIR/tools/pdctl/pdctl" generate --model "$MODEL" --prompt-ids "$PROMPT" --max-tokens 16 --threads "$(nproc)"
echo
echo "Logits of the last prompt position (first 8 of the vocabulary):"
"$BUILD_DIR/tools/pdctl/pdctl" logits --model "$MODEL" --token-ids "$PROMPT" | cut -d, -f1-8 | sed 's/$/, ...]/'
echo
echo "More: $BUILD_DIR/tools/pdctl/pdctl help"

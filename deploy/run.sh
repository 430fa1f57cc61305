#!/usr/bin/env bash
# The main job. Installs and builds what is missing, then runs what pdserve
# runs today: an in-process generation with the embedded default model
# (deploy/models/kjv-tiny, a small Llama-architecture model the repository
# trained itself on the King James Bible), streamed as it is produced, plus
# a chat-template round. The local router/prefill/decode cluster replaces
# this once it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
PDCTL="$BUILD_DIR/tools/pdctl/pdctl"
MODEL=${PDSERVE_MODEL:-deploy/models/kjv-tiny}
PROMPT=${PDSERVE_PROMPT:-"And God said, Let there be"}
THREADS=$(nproc)

echo
echo "== pdserve: in-process generation with $MODEL =="
echo "prompt: $PROMPT"
echo "--------"
printf '%s' "$PROMPT"
"$PDCTL" generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 60 \
  --temperature 0.7 --top-p 0.9 --seed 42 --threads "$THREADS"
echo "--------"
echo
echo "== chat (ChatML template from the model's tokenizer_config.json) =="
MESSAGES=$(mktemp)
trap 'rm -f "$MESSAGES"' EXIT
echo '[{"role": "user", "content": "Who was the father of Isaac?"}]' > "$MESSAGES"
"$PDCTL" chat-template --model "$MODEL" --messages-file "$MESSAGES" --add-generation-prompt
"$PDCTL" generate --model "$MODEL" --chat-json "$MESSAGES" --max-tokens 40 --seed 7 \
  --temperature 0.7 --threads "$THREADS"
echo
echo "More: $PDCTL help   (tokenize, logits, bench-engine, bench-tokenizer, ...)"

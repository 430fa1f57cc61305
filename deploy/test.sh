#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every test
# through CTest. GPU tests skip with a reason when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
# The official openai npm client, for the HTTP API's test: Node.js from
# Debian when the machine has none, the client pinned by its lock file.
if ! command -v npm > /dev/null; then
  echo "test: installing nodejs npm"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
fi
CLIENT=tests/openai_client
if [[ ! -f $CLIENT/node_modules/.package-lock.json || $CLIENT/package-lock.json -nt $CLIENT/node_modules/.package-lock.json ]]; then
  (cd "$CLIENT" && npm ci --no-audit --no-fund --loglevel=error)
fi
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" "$@"

#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every test
# through CTest. GPU tests skip with a reason when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
# Node.js from Debian when the machine has none (tests run npm packages).
if ! command -v npm > /dev/null; then
  echo "test: installing nodejs npm"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
fi
# npm packages the tests use, each pinned by its lock file: the official
# openai client and ajv (the HTTP API's tests) and the Kubernetes schema
# validator.
for dir in tests/openai_client tests/k8s_schema; do
  if [[ ! -f $dir/node_modules/.package-lock.json || $dir/package-lock.json -nt $dir/node_modules/.package-lock.json ]]; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
done
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" "$@"

#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every test
# through CTest. GPU tests skip with a reason when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/bootstrap.sh
BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" "$@"

#!/usr/bin/env bash
# Installs the Debian packages the build needs (idempotent: apt-get is only
# called when one is missing), then configures and builds pdserve into
# ${PDSERVE_BUILD_DIR:-build}.
#
#   deploy/bootstrap.sh [TARGET...]
#
# With only the main job's targets (the three servers and pdctl, as
# deploy/run.sh names them): only the packages those need, and a build
# directory configured without the test suite when it is new. Otherwise
# (no target, or a test's): every package the tests use as well, and the
# test suite configured in. Safe to run again; a
# no-op rebuild takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the servers and pdctl need to build and the main job to run.
PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev nlohmann-json3-dev libyaml-cpp-dev libxxhash-dev libpcre2-dev libutf8proc-dev libopenblas-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils libmicrohttpd-dev libevent-dev libssl-dev
  openssl curl
)
# What the test suite adds: GoogleTest and Google Benchmark, clang for the
# thread-safety analysis, and the tools the network-namespace tests run.
TEST_PACKAGES=(
  libgtest-dev libgmock-dev libbenchmark-dev
  dnsmasq-base iproute2 nftables
  clang python3-yaml
)
# The test packages and the suite are left out only when every named
# target is one the main job runs.
MAIN_JOB_TARGETS=" pdserve-router pdserve-prefill-worker pdserve-decode-worker pdctl "
WITH_TESTS=$(($# == 0))
for t in "$@"; do
  [[ $MAIN_JOB_TARGETS == *" $t "* ]] || WITH_TESTS=1
done
((WITH_TESTS)) && PACKAGES+=("${TEST_PACKAGES[@]}")

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${#missing[@]} Debian packages (with what they depend on): ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  echo "bootstrap: configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${PDSERVE_BUILD_TYPE:-Release} \
    -DPDSERVE_BUILD_TESTS=$([[ $WITH_TESTS == 1 ]] && echo ON || echo OFF)
elif ((WITH_TESTS)) && grep -q '^PDSERVE_BUILD_TESTS:BOOL=OFF' "$BUILD_DIR/CMakeCache.txt"; then
  echo "bootstrap: configuring $BUILD_DIR with the test suite"
  cmake -S . -B "$BUILD_DIR" -DPDSERVE_BUILD_TESTS=ON
fi
if (($#)); then
  echo "bootstrap: building $* (ninja prints [done/total])"
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "$@"
else
  echo "bootstrap: building everything (ninja prints [done/total])"
  cmake --build "$BUILD_DIR" -j "$(nproc)"
fi

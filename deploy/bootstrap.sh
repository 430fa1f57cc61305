#!/usr/bin/env bash
# Installs the Debian packages the build needs (idempotent: apt-get is only
# called when one is missing), then configures and builds pdserve into
# ${PDSERVE_BUILD_DIR:-build}: the named targets, or everything when none is
# named. Safe to run again; a no-op rebuild takes seconds.
#
#   deploy/bootstrap.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libyaml-cpp-dev libxxhash-dev libpcre2-dev libutf8proc-dev libopenblas-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils libmicrohttpd-dev libevent-dev
  dnsmasq-base iproute2 nftables curl
  clang python3-yaml
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${#missing[@]} Debian packages: ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

BUILD_DIR=${PDSERVE_BUILD_DIR:-build}
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  echo "bootstrap: configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${PDSERVE_BUILD_TYPE:-Release}
fi
if (($#)); then
  echo "bootstrap: building $* (ninja prints [done/total])"
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "$@"
else
  echo "bootstrap: building everything (ninja prints [done/total])"
  cmake --build "$BUILD_DIR" -j "$(nproc)"
fi

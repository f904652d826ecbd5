#!/bin/sh
# Install the Debian packages that building SGLang's CPU kernel needs (scripts/setup_cpu_sglang.py):
# a C++ compiler, cmake, ninja and libnuma's header and library. Does nothing when they are all
# there. apt as root, else through sudo, as tests/install_prometheus.sh does.
set -eu
if command -v g++ >/dev/null 2>&1 && command -v cmake >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 \
    && [ -f /usr/include/numa.h ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "building SGLang's CPU kernel needs g++, cmake, ninja and libnuma's header, and apt-get is missing: install them" >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "installing build-essential cmake ninja-build libnuma-dev for SGLang's CPU kernel..." >&2
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    build-essential cmake ninja-build libnuma-dev >/dev/null

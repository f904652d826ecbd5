#!/bin/sh
# Install the Debian packages that building SGLang's CPU kernel needs (scripts/setup_cpu_sglang.py):
# a C++ compiler, cmake, ninja and libnuma's header and library. Does nothing when they are all
# there (tests/apt_install.sh installs them otherwise).
set -eu
if command -v g++ >/dev/null 2>&1 && command -v cmake >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 \
    && [ -f /usr/include/numa.h ]; then
    exit 0
fi
exec sh "$(dirname "$0")/apt_install.sh" \
    "building SGLang's CPU kernel needs g++, cmake, ninja and libnuma's header, and apt-get is missing: install them" \
    "installing build-essential cmake ninja-build libnuma-dev for SGLang's CPU kernel..." \
    build-essential cmake ninja-build libnuma-dev

#!/bin/sh
# Install Debian packages with apt, as root or through sudo: the set-up scripts beside it call it
# once they found what they need missing. Arguments: the line to print when apt-get is missing,
# the progress line, then the packages.
set -eu
missing="$1"; progress="$2"; shift 2
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$missing" >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
echo "$progress" >&2
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null

#!/bin/sh
# Install Debian's headless-capable Chromium for the report tests (tests/render/test_report.py), once.
# Idempotent: does nothing when a chromium is already on PATH. Needs apt-get and root (or sudo);
# where neither is there it says so and leaves the decision to the tests: they skip locally and
# fail under CI=true.
set -eu
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_chromium: no apt-get here: install Chromium yourself for the report tests" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "setup_chromium: not root and no password-less sudo: run 'apt-get install chromium' as root for the report tests" >&2
        exit 0
    fi
fi
echo "setup_chromium: installing Debian's chromium (once)" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null

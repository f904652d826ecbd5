#!/bin/sh
# Install Debian's prometheus package (the prometheus server and promtool) for the fleet tests
# (tests/server/test_fleet.py). Does nothing when both are already on PATH. The tests start their own
# Prometheus on a free loopback port; the package's system service is not used.
set -eu
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
exec sh "$(dirname "$0")/apt_install.sh" \
    "prometheus is not installed and apt-get is missing: install Prometheus 2.x (prometheus and promtool on PATH)" \
    "installing Debian's prometheus package for the fleet tests..." prometheus

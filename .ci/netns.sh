#!/usr/bin/env bash
# Lane: instances spanning nodes, with each node manager in its own network namespace
# (tests/integration/test_multinode.py, marker netns). Needs root and iproute2's ip netns;
# MOTOR_REQUIRE_NETNS=1 makes a missing capability fail the lane instead of skipping, and
# pytest's exit status 5 (nothing collected) fails it too. Namespaces and links are named
# motmn-* and use 198.18.2.0/24 only; the test removes stale ones first and all of its own at
# the end. About 5 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v ip > /dev/null; then
    echo "installing iproute2 (Debian package)"
    apt-get update -qq > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends iproute2 > /dev/null
fi
MOTOR_REQUIRE_NETNS=1 timeout 300 .venv/bin/python -m pytest -m netns -q -rs \
    tests/integration/test_multinode.py

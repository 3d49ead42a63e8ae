#!/usr/bin/env bash
# The browser lane: the controller's live cluster page (GET /cluster) in a real headless
# Chromium driven by selenium (tests/integration/test_cluster_page.py, marker browser).
# Debian's chromium + chromium-driver are installed when missing (no recommends; they start
# no service); selenium comes with the test extra. Screenshots go to $MOTOR_ARTIFACTS_DIR
# (default $TMPDIR/motor-artifacts/browser). Runs from the repository root, after .ci/run made .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    echo "installing chromium and chromium-driver (Debian packages)"
    { apt-get update -qq > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium chromium-driver > /dev/null; } \
        || { echo "chromium install failed" >&2; exit 1; }
fi
if ! .venv/bin/python -c "import selenium" 2> /dev/null; then
    .venv/bin/pip install -q -e '.[test]'
fi
export MOTOR_ARTIFACTS_DIR=${MOTOR_ARTIFACTS_DIR:-${TMPDIR:-/tmp}/motor-artifacts/browser}
mkdir -p "$MOTOR_ARTIFACTS_DIR"
# MOTOR_REQUIRE_BROWSER=1: a missing browser fails instead of skipping
MOTOR_REQUIRE_BROWSER=1 timeout 600 .venv/bin/python -m pytest -m browser -q -rs \
    tests/integration/test_cluster_page.py
echo "screenshots: $(ls "$MOTOR_ARTIFACTS_DIR"/*.png | tr '\n' ' ')"

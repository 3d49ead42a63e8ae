#!/usr/bin/env bash
# CI lane of deploy/ (called by .ci/run): renders every kustomize overlay of deploy/k8s with
# kubectl, validates the objects against a current Kubernetes schema (kubernetes-validate),
# checks them against the config they carry, and runs the image recipe without Docker (the
# wheel of deploy/docker/build.sh in a fresh venv, no compiler on PATH, every role started by
# the entrypoint from its environment). About 1 min on 2 cores, most of it the wheel build.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v kubectl > /dev/null; then
    echo "installing kubectl (Debian package kubernetes-client)"
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client > /dev/null
fi
kubectl version --client 2>/dev/null | head -2 || true
if ! .venv/bin/python -c "import kubernetes_validate" 2> /dev/null; then
    .venv/bin/pip install -q "kubernetes-validate>=1.34,<2"   # also in pyproject's test extra
fi
# MOTOR_REQUIRE_DEPLOY_TOOLS=1: a missing tool fails instead of skipping; pytest's exit
# status 5 (nothing collected) fails the lane too
MOTOR_REQUIRE_DEPLOY_TOOLS=1 timeout 900 .venv/bin/python -m pytest -m deploy -q -rs tests/deploy

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
# the pod-shaped test (tests/deploy/test_pod_topology.py) runs the etcd pods' own command:
# Debian's etcd-server, without starting its service (a refusing policy-rc.d for the install)
if ! command -v etcd > /dev/null; then
    echo "installing etcd-server (Debian package)"
    policy_added=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        policy_added=1
    fi
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server \
        > /dev/null
    [ -z "$policy_added" ] || rm -f /usr/sbin/policy-rc.d
fi
if ! .venv/bin/python -c "import kubernetes_validate" 2> /dev/null; then
    .venv/bin/pip install -q "kubernetes-validate>=1.34,<2"   # also in pyproject's test extra
fi
# MOTOR_REQUIRE_DEPLOY_TOOLS=1: a missing tool fails instead of skipping; pytest's exit
# status 5 (nothing collected) fails the lane too
MOTOR_REQUIRE_DEPLOY_TOOLS=1 timeout 900 .venv/bin/python -m pytest -m deploy -q -rs tests/deploy

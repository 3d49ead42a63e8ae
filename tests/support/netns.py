"""Network namespaces for multi-node tests: one namespace per node, each with its own IP on a
bridge in the root namespace (the controller and coordinators stay in the root namespace and
reach the nodes through it).

Names start with :data:`PREFIX` (``motmn``); addresses are from :data:`SUBNET` only
(198.18.2.0/24, a benchmarking range of RFC 2544 no real network uses): the bridge is
198.18.2.1, node ``i`` (1-based) is 198.18.2.(10 + i). :func:`cleanup` removes every
namespace and link of the prefix, stale ones of an earlier run included.
"""
from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "motmn"
SUBNET = "198.18.2"
BRIDGE = f"{PREFIX}-br"
BRIDGE_IP = f"{SUBNET}.1"


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def namespace(i: int) -> str:
    return f"{PREFIX}-n{i}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=10)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{PREFIX}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def cleanup() -> None:
    """Delete every namespace and link whose name starts with :data:`PREFIX`."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX):
            _ip("netns", "del", name, check=False)
    r = _ip("-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                _ip("link", "del", name, check=False)


def setup(n: int) -> list[str]:
    """``n`` namespaces on the bridge (after :func:`cleanup`); their IPs, node 1 first."""
    cleanup()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    ips = []
    for i in range(1, n + 1):
        ns, host, peer = namespace(i), f"{PREFIX}-h{i}", f"{PREFIX}-p{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", host, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", host, "master", BRIDGE)
        _ip("link", "set", host, "up")
        _ip("-n", ns, "addr", "add", f"{node_ip(i)}/24", "dev", peer)
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        ips.append(node_ip(i))
    return ips


def in_namespace(i: int, argv: list[str]) -> list[str]:
    """``argv`` run in node ``i``'s namespace."""
    return ["ip", "netns", "exec", namespace(i), *argv]

"""Pods as Linux network namespaces, for the pod-shaped deploy test.

:class:`PodNetwork` puts each pod in its own network namespace (``ip netns add``), joined to
one bridge in the root namespace by a veth pair; inside, the pod's end is ``eth0`` with the
pod's address from :data:`SUBNET`, and ``lo`` is up. The bridge holds :data:`GATEWAY` (the
root namespace: the test's clients) and any Service addresses the test adds. Names resolve
through ``ip netns exec``'s own mechanism: it bind-mounts ``/etc/netns/<namespace>/hosts``
over ``/etc/hosts`` in the mount namespace of the command it runs, so every pod sees the
cluster's names (:meth:`PodNetwork.write_hosts`) and nothing else changes for it.

Only 198.18.1.0/24 is used (RFC 2544 benchmarking space, reserved for network tests) and
every namespace, link and ``/etc/netns`` entry starts with :data:`PREFIX`, so nothing else on
the machine is touched; :func:`cleanup_stale` removes what a crashed run left.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: every namespace, link and /etc/netns entry this module creates starts with it
PREFIX = "motpod"
SUBNET = ipaddress.ip_network("198.18.1.0/24")
BRIDGE = f"{PREFIX}br0"
#: the bridge's address: the root namespace (the test process) as the pods see it
GATEWAY = "198.18.1.1"
#: the bridge's MAC (locally administered, unicast)
BRIDGE_MAC = "02:6d:70:6f:64:01"
ETC_NETNS = Path("/etc/netns")
IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def unavailable() -> str | None:
    """Why pods cannot be made here (not root, no ``ip``, ``ip netns add`` refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not os.access(IP, os.X_OK):
        return f"iproute2 is not installed ({IP})"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    try:
        r = _ip("link", "add", f"{PREFIX}probe", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"ip link add type bridge is not permitted here: {r.stderr.strip()}"
        _ip("link", "del", f"{PREFIX}probe", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """The network namespaces of this module (``ip netns list``, :data:`PREFIX`)."""
    r = _ip("netns", "list", check=False)
    return [ln.split()[0] for ln in r.stdout.splitlines()
            if ln.strip() and ln.split()[0].startswith(PREFIX)]


def pids_in(netns: str) -> list[int]:
    """Pids of every process in namespace ``netns`` (``ip netns pids``)."""
    r = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_namespace_processes(netns: str, sig: int = signal.SIGKILL, wait_s: float = 5.0) -> None:
    """Send ``sig`` to the process group of every process in ``netns`` (a pod's main process
    and the engines it started in their own groups), then wait up to ``wait_s`` for them to
    be gone (only for SIGKILL)."""
    own = os.getpgrp()
    groups, loose = set(), []
    for pid in pids_in(netns):
        try:
            g = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if g <= 1 or g == own:   # never this test's own group: that process alone
            loose.append(pid)
        else:
            groups.add(g)
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass
    for pid in loose:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if sig != signal.SIGKILL:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        live = [p for p in pids_in(netns) if _alive(p)]
        if not live:
            return
        for p in live:   # a process that left its group (setsid after our scan)
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cleanup_stale() -> list[str]:
    """Best effort: remove every namespace (its processes killed), link and ``/etc/netns``
    entry of :data:`PREFIX` that an earlier run left (a crash, a kill -9 of pytest). Returns
    what it removed."""
    removed = []
    for ns in namespaces():
        kill_namespace_processes(ns)
        _ip("netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    r = _ip("-o", "link", "show", check=False)
    for ln in r.stdout.splitlines():
        parts = ln.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            _ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            if d.name.startswith(PREFIX):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        _remove_if_empty(ETC_NETNS)
    return removed


@dataclass
class Pod:
    """One pod: its name, namespace, address and the host end of its veth pair."""
    name: str
    netns: str
    ip: str
    veth: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    up: bool = True


class PodNetwork:
    """A bridge with pods on it (see the module's docstring).

    Methods raise ``RuntimeError`` with ``ip``'s message when a step fails; :meth:`close`
    removes everything it made and never raises.
    """

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.service_ips: list[str] = []
        self._n = 0
        # a fixed MAC: a bridge without one takes the lowest of its ports' MACs, so deleting
        # a pod's veth could change it, and every pod's ARP entry for the gateway and the
        # Service addresses would point at a MAC nobody has until it expires (tens of s)
        _ip("link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge")
        _ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")

    def add_service_ip(self, ip: str) -> None:
        """An extra address on the bridge (a Service's virtual IP served from the root
        namespace)."""
        assert ipaddress.ip_address(ip) in SUBNET, ip
        _ip("addr", "add", f"{ip}/32", "dev", BRIDGE)
        self.service_ips.append(ip)

    def add_pod(self, name: str, ip: str) -> Pod:
        """Namespace ``motpod-<name>`` with ``eth0`` = ``ip`` on the bridge, ``lo`` up."""
        assert ipaddress.ip_address(ip) in SUBNET and ip != GATEWAY, ip
        self._n += 1
        netns = f"{PREFIX}-{name}"
        veth, peer = f"{PREFIX}v{self._n}", f"{PREFIX}p{self._n}"
        _ip("netns", "add", netns)
        pod = Pod(name, netns, ip, veth)
        self.pods[name] = pod
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", netns)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        inside = ("netns", "exec", netns, IP)
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", peer, "name", "eth0")
        _ip(*inside, "addr", "add", f"{ip}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        return pod

    def write_hosts(self, text: str) -> None:
        """The ``/etc/hosts`` every pod sees (``/etc/netns/<namespace>/hosts``)."""
        for pod in self.pods.values():
            d = ETC_NETNS / pod.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(text)

    def argv(self, pod: Pod, argv: list[str]) -> list[str]:
        """``argv`` run inside the pod's namespace (and its /etc/hosts)."""
        return [IP, "netns", "exec", pod.netns, *argv]

    def take_down(self, pod: Pod) -> None:
        """The pod is gone: every process in it killed (SIGKILL by process group), its veth
        deleted, its namespace removed."""
        kill_namespace_processes(pod.netns)
        for p in pod.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _ip("link", "del", pod.veth, check=False)
        _ip("netns", "del", pod.netns, check=False)
        shutil.rmtree(ETC_NETNS / pod.netns, ignore_errors=True)
        pod.up = False

    def close(self, term_s: float = 8.0) -> None:
        """Stop every pod (SIGTERM to each process group, SIGKILL after ``term_s``), delete the
        veths, the namespaces, their /etc/netns entries and the bridge."""
        live = [p for p in self.pods.values() if p.up]
        for pod in live:
            kill_namespace_processes(pod.netns, signal.SIGTERM)
        deadline = time.monotonic() + term_s
        for pod in live:
            for p in pod.procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for pod in live:
            try:
                self.take_down(pod)
            except Exception:  # noqa: BLE001 - teardown goes on whatever failed
                pass
        _ip("link", "del", BRIDGE, check=False)
        for pod in self.pods.values():
            shutil.rmtree(ETC_NETNS / pod.netns, ignore_errors=True)
        _remove_if_empty(ETC_NETNS)


def _remove_if_empty(d: Path) -> None:
    try:
        d.rmdir()   # only when empty: other users of ip netns may keep files there
    except OSError:
        pass

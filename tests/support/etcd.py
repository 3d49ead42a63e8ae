"""A real etcd cluster on loopback for tests (Debian's ``etcd-server``: ``/usr/bin/etcd``).

``EtcdCluster(n, workdir)`` starts ``n`` members on free 127.0.0.1 ports, each in its own
process group with its data directory under ``workdir``; :meth:`EtcdCluster.stop_member` /
:meth:`start_member` stop and restart one (same data directory: it rejoins), :meth:`close`
kills them all. Tests that need etcd skip without the binary unless ``MOTOR_REQUIRE_ETCD=1``
(``.ci/run`` sets it: a missing etcd fails there).
"""
from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from http.client import HTTPException

import pytest

from tests.support.procs import free_ports

ETCD = os.environ.get("MOTOR_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


def require_etcd() -> str:
    """The etcd binary, or skip (fail with ``MOTOR_REQUIRE_ETCD=1``)."""
    if os.path.exists(ETCD) and os.access(ETCD, os.X_OK):
        return ETCD
    msg = f"etcd not installed ({ETCD}); Debian: apt-get install etcd-server"
    if os.environ.get("MOTOR_REQUIRE_ETCD") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


class EtcdCluster:
    """``n`` etcd members on loopback.

    Parameters
    ----------
    n : int
        Members (3 for quorum tests: one may be lost).
    workdir : str
        Data directories and logs go under it.
    """

    def __init__(self, n: int, workdir: str, tls: dict[str, str] | None = None) -> None:
        #: ``tls``: ``{"ca", "cert", "key"}`` PEM paths: client URLs are https, client
        #: certificates signed by ``ca`` required (``--client-cert-auth``); the same
        #: certificate serves the members and the harness's own health checks
        self.tls = tls
        self.binary = require_etcd()
        self.n = n
        self.workdir = workdir
        ports = free_ports(2 * n)
        self.client_ports = ports[:n]
        self.peer_ports = ports[n:]
        self.names = [f"m{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.logs: list[str] = [os.path.join(workdir, f"etcd-{nm}.log") for nm in self.names]
        self._started_once = [False] * n

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoints(self) -> list[str]:
        """``127.0.0.1:PORT`` of every member's client URL (``https://`` with TLS)."""
        pre = "https://" if self.tls else ""
        return [f"{pre}127.0.0.1:{p}" for p in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        cluster = ",".join(f"{nm}=http://127.0.0.1:{p}" for nm, p in zip(self.names, self.peer_ports))
        return [self.binary, "--name", self.names[i],
                "--data-dir", os.path.join(self.workdir, f"data-{self.names[i]}"),
                "--listen-client-urls", f"{self.scheme}://127.0.0.1:{self.client_ports[i]}",
                "--advertise-client-urls", f"{self.scheme}://127.0.0.1:{self.client_ports[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-token", "motor-test",
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--log-level", "warn"] + ([
                    "--cert-file", self.tls["cert"], "--key-file", self.tls["key"],
                    "--trusted-ca-file", self.tls["ca"], "--client-cert-auth"]
                    if self.tls else [])

    def start(self, timeout_s: float = 20.0) -> EtcdCluster:
        for i in range(self.n):
            self.start_member(i, wait=False)
        self.wait_healthy(range(self.n), timeout_s)
        return self

    def start_member(self, i: int, wait: bool = True, timeout_s: float = 20.0) -> None:
        assert self.procs[i] is None or self.procs[i].poll() is not None, f"member {i} runs"
        log = open(self.logs[i], "ab")
        env = {**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")}
        self.procs[i] = subprocess.Popen(self._argv(i), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        log.close()
        self._started_once[i] = True
        if wait:
            self.wait_healthy([i], timeout_s)

    def healthy(self, i: int) -> bool:
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls["ca"])
            ctx.load_cert_chain(self.tls["cert"], self.tls["key"])
        try:
            with urllib.request.urlopen(f"{self.scheme}://127.0.0.1:{self.client_ports[i]}/health",
                                        timeout=1.0, context=ctx) as r:
                return b'"health":"true"' in r.read()
        except (OSError, urllib.error.URLError, HTTPException, ValueError):
            return False

    def wait_healthy(self, members: object, timeout_s: float) -> None:
        members = list(members)  # type: ignore[call-overload]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in members:
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"etcd member {i} exited {p.returncode}: "
                                       f"{self.log_tail(i)}")
            if all(self.healthy(i) for i in members):
                return
            time.sleep(0.1)
        raise TimeoutError(f"etcd members {members} not healthy after {timeout_s} s: "
                           + " | ".join(self.log_tail(i) for i in members))

    def log_tail(self, i: int, n: int = 1500) -> str:
        try:
            with open(self.logs[i], "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop_member(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def stop_all(self) -> None:
        for i in range(self.n):
            self.stop_member(i)

    def close(self) -> None:
        self.stop_all()

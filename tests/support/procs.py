"""Process helpers for integration tests: free ports, finding and killing our processes."""
from __future__ import annotations

import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

#: asyncio's debug-mode report of a slow step: "... WARNING asyncio[pid]: Executing <...> took
#: 0.118 seconds" (asyncio.base_events, under PYTHONASYNCIODEBUG=1 only: CI's second pass runs
#: everything so, on a loaded 2-core machine): a timing of the machine, not the program's output
ASYNCIO_SLOW = re.compile(r" WARNING asyncio\[\d+\]: Executing .* took \d+\.\d+ seconds$")


def program_stderr(text: str) -> str:
    """A child's stderr without asyncio's debug-mode slow-step lines, stripped: what the
    program itself wrote, for tests of its exact words."""
    return "\n".join(ln for ln in text.splitlines() if not ASYNCIO_SLOW.search(ln)).strip()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``net.ipv4.ip_local_port_range``), inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _port_window(n: int) -> tuple[int, int]:
    """Where to look for ``n`` ports: ``[first, last]`` outside the ephemeral range.

    A port taken from the ephemeral range is free when probed but any process's next outgoing
    connect() may take it as its local port before the test's server binds it (a controller's
    etcd client did, to an engine port of the HA cluster). Below the range (or above it, when it
    starts too low) only explicit binds take ports.
    """
    lo, hi = _ephemeral_range()
    if lo - 10000 >= 1000 + n:
        return 10000, lo - n - 1
    if 65535 - hi >= 1000 + n:
        return hi + 1, 65535 - n
    return 1024, 65535 - n


#: every port :func:`free_ports` returned in this process: never returned again (two calls
#: for one config, e.g. the controller's port and then an engine's consecutive ports, probe
#: ports that are all free until something binds them, so the second call could hand out a
#: port of the first: a CI run's cluster config was refused for a port "also used by
#: controller.port")
_GIVEN: set[int] = set()


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """``n`` ports free on 127.0.0.1 now (consecutive when asked), outside the ephemeral range,
    and none returned by an earlier call in this process.

    Raises RuntimeError when 200 random tries found none.
    """
    first, last = _port_window(n)
    for _ in range(200):
        base = random.randint(first, last)
        ports = list(range(base, base + n)) if consecutive else \
            sorted(random.sample(range(first, last + n), n))
        if not _GIVEN.isdisjoint(ports):
            continue
        socks = []
        try:
            for p in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _GIVEN.update(ports)
            return ports
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def pids_matching(*needles: str) -> list[int]:
    """Pids of live processes whose command line contains every needle."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if all(n in cmd for n in needles):
            out.append(int(d))
    return out


def wait_http(url: str, timeout_s: float = 30.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == status:
                    return
        except Exception as e:  # noqa: BLE001
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not answering {status} after {timeout_s} s: {last}")


def spawn(args: list[str], log_path: str) -> subprocess.Popen[bytes]:
    """``python -m motor ARGS`` in its own process group, output to ``log_path``."""
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "motor"] + args, stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def stop(p: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM to every process group at once, then wait for each; SIGKILL to a group still
    there after ``timeout_s`` (several components stop in parallel, in the list's order)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def read_line_with(proc: subprocess.Popen[bytes], needle: bytes, timeout_s: float) -> bytes:
    """Read ``proc``'s stdout line by line until one holds ``needle`` (that line), EOF or
    ``timeout_s`` (the last line read, maybe empty)."""
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + timeout_s
    while needle not in line and time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 1.0)
        if r:
            line = proc.stdout.readline()
            if not line:
                break
    return line

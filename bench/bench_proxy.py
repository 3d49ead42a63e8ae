"""Proxy overhead of the coordinator: requests/s and coordinator CPU per request.

The coordinator (standalone, round robin) runs as a subprocess in front of two fast
fake backends (``bench/fast_backend.py``, another subprocess); an in-process asyncio
client sends a round of requests over keep-alive connections at a fixed concurrency.
Each benchmark round is one batch; ``extra_info`` carries ``req_per_s`` and
``coordinator_cpu_us_per_req`` (the coordinator process tree's user+system CPU from
/proc over the requests completed) so a regression shows in the JSON report.

Bar (issue 5, on the peer harness): CPU per request at most half of sglang-router's
(about 150 us non-stream, 270 us stream measured on this machine). The peer
comparison itself is in docs/benchmarks.md (``../shared/peer-bench``).

Run::

    .venv/bin/python -m pytest bench/bench_proxy.py --benchmark-only -o addopts="" -p no:cacheprovider
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from motor.http.client import Pool

pytestmark = pytest.mark.proxy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_ROUND = 2000
CONCURRENCY = 32
_TICK = os.sysconf("SC_CLK_TCK")


def _free_ports(n: int) -> list[int]:
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _tree_cpu_s(pid: int) -> float:
    """user+system CPU seconds of ``pid`` and its live children."""
    total = 0.0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except OSError:
            pass
    return total


def _wait(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"workers={n}")
def gateway(request):
    b1, b2, gw = _free_ports(3)
    env = dict(os.environ, PYTHONPATH=ROOT)
    backend = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "fast_backend.py"),
                                str(b1), str(b2)], env=env, start_new_session=True)
    coord = subprocess.Popen([sys.executable, "-m", "motor", "--log-level", "warning",
                              "coordinator", "--port", str(gw), "--workers", str(request.param),
                              "--backend", f"http://127.0.0.1:{b1}", f"http://127.0.0.1:{b2}"],
                             env=env, start_new_session=True)
    try:
        _wait(f"http://127.0.0.1:{gw}/readiness")
        yield gw, coord.pid
    finally:
        for p in (coord, backend):
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(15)


async def _round(port: int, body: bytes) -> int:
    pool = Pool("127.0.0.1", port, max_connections=CONCURRENCY)
    sent = 0

    async def worker() -> int:
        nonlocal sent
        done = 0
        while sent < PER_ROUND:
            sent += 1
            r = await pool.request(b"POST", b"/v1/chat/completions", body,
                                   ((b"content-type", b"application/json"),))
            await r.read()
            done += r.status == 200
        return done
    try:
        return sum(await asyncio.gather(*(worker() for _ in range(CONCURRENCY))))
    finally:
        pool.close()


PROMPT = "x" * 1024


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_proxy_round_robin(benchmark, gateway, stream):
    benchmark.group = "proxy.round_robin"
    port, pid = gateway
    body = (b'{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"%s"}]%s}'
            % (PROMPT.encode(), b',"stream":true' if stream else b""))
    stats = {"ok": 0, "cpu": 0.0, "wall": 0.0}

    def one_round() -> int:
        c0, t0 = _tree_cpu_s(pid), time.perf_counter()
        ok = asyncio.run(_round(port, body))
        stats["cpu"] += _tree_cpu_s(pid) - c0
        stats["wall"] += time.perf_counter() - t0
        stats["ok"] += ok
        return ok

    ok = benchmark.pedantic(one_round, rounds=5, warmup_rounds=1)
    assert ok == PER_ROUND
    benchmark.extra_info["req_per_s"] = round(stats["ok"] / stats["wall"], 1)
    benchmark.extra_info["coordinator_cpu_us_per_req"] = round(1e6 * stats["cpu"] / stats["ok"], 1)
    print(f"\n{benchmark.name}: {benchmark.extra_info}")

"""`coordinator.workers = 2` with a rate limit: the limit holds for the coordinator as a whole
(the shared rate table, motor/coordinator/ratetable.py), not per worker.

Real processes on 127.0.0.1: a `motor sim` engine (no delays) and `motor coordinator` with
two workers, every request `anonymous` under `limits.default: {rpm: 120}` (2 / s, a burst of
1 s = 2 requests). Count-based: the clients send as fast as they can, the elapsed time is
measured and the admitted count compared with what the limit allows in that time.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

from tests.support.procs import free_ports, spawn, stop, wait_http

RPM = 120
RATE = RPM / 60                      # per second
BURST = RATE * 1.0                   # burst_s = 1
WORKERS = 2
BODY = json.dumps({"model": "motor-sim", "prompt": "hi", "max_tokens": 1})


class Conn:
    """One keep-alive connection: it stays on the worker that accepted it."""

    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.c.request("GET", "/instances")
        r = self.c.getresponse()
        self.pid = json.loads(r.read())["worker_pid"]
        self.admitted = self.refused = 0
        self.limit_header: set[str] = set()

    def hammer(self, until: float) -> None:
        """Completions back to back until ``until`` (monotonic)."""
        while time.monotonic() < until:
            self.c.request("POST", "/v1/completions", BODY, {"content-type": "application/json"})
            r = self.c.getresponse()
            r.read()
            if r.status == 200:
                self.admitted += 1
            else:
                assert r.status == 429, r.status
                assert int(r.getheader("retry-after") or 0) >= 1
                self.refused += 1
            self.limit_header.add(r.getheader("x-ratelimit-limit-requests") or "")

    def close(self) -> None:
        self.c.close()


def allowance(elapsed_s: float) -> float:
    """What the whole coordinator may admit in ``elapsed_s``: the rate for that time, one
    burst, and one request per worker (two workers admitting at the same instant)."""
    return RATE * elapsed_s + BURST + WORKERS


def test_two_workers_hold_one_limit_together(tmp_path):
    sim, gw = free_ports(2)
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps({"coordinator": {
        "host": "127.0.0.1", "port": gw, "workers": WORKERS,
        "limits": {"default": {"rpm": RPM}, "burst_s": 1.0}}}))
    procs = [spawn(["sim", "--port", str(sim), "--time-scale", "0"], str(tmp_path / "sim.log")),
             spawn(["coordinator", "-c", str(cfg), "--backend", f"http://127.0.0.1:{sim}"],
                   str(tmp_path / "coord.log"))]
    conns: list[Conn] = []
    try:
        wait_http(f"http://127.0.0.1:{sim}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")

        # 1. one keep-alive connection, so one worker: it still gets the whole limit (with
        # a per-worker split it would get half: RATE / 2 per second and a burst of 1)
        one = Conn(gw)
        conns.append(one)
        t0 = time.monotonic()
        one.hammer(t0 + 4.0)
        elapsed = time.monotonic() - t0
        assert one.refused > 0, "the client offered more than the limit"
        assert one.admitted <= allowance(elapsed)
        assert one.admitted > RATE / 2 * elapsed + 1 + 1, \
            f"{one.admitted} admitted in {elapsed:.1f} s: one worker's share, not the limit"
        assert one.limit_header == {str(RPM)}      # the headers say the whole limit

        # 2. many connections over both workers, as fast as they can: one limit for all
        deadline = time.monotonic() + 20
        while len({c.pid for c in conns}) < WORKERS or len(conns) < 8:
            assert time.monotonic() < deadline, "both workers answer on the shared port"
            conns.append(Conn(gw))
        for c in conns:
            c.admitted = c.refused = 0
        t0 = time.monotonic()
        threads = [threading.Thread(target=c.hammer, args=(t0 + 5.0,)) for c in conns]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        elapsed = time.monotonic() - t0
        admitted = sum(c.admitted for c in conns)
        by_pid: dict[int, int] = {}
        for c in conns:
            by_pid[c.pid] = by_pid.get(c.pid, 0) + c.admitted + c.refused
        assert len(by_pid) == WORKERS and all(by_pid.values()), by_pid   # both got traffic
        assert sum(c.refused for c in conns) > admitted
        assert RATE * elapsed * 0.5 < admitted <= allowance(elapsed), (admitted, elapsed)
    finally:
        for c in conns:
            c.close()
        for p in procs:
            stop(p)

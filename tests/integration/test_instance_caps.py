"""Per-instance caps end to end: `motor coordinator --backend A --backend B` with
`admission.max_inflight_per_instance: N` in front of two `motor sim --max-num-seqs N`, offered
4x their capacity at once. The sims' own high-water marks (`/admin/stats` ``max_held``:
running + waiting sequences at once) prove the engines never held more than N; every request
gets one terminal answer, 200 or 503 with Retry-After and an OpenAI error body."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from tests.support.procs import free_ports, spawn, stop, wait_http

N = 2


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    d = tmp_path_factory.mktemp("caps")
    a, b, gw = free_ports(3)
    cfg = d / "motor.yaml"
    cfg.write_text(f"coordinator:\n  admission:\n    max_inflight_per_instance: {N}\n"
                   "    queue_timeout_s: 0.2\n")
    procs = [spawn(["sim", "--port", str(p), "--time-scale", "1.0", "--max-num-seqs", str(N)],
                   str(d / f"sim-{p}.log")) for p in (a, b)]
    procs.append(spawn(["coordinator", "-c", str(cfg), "--port", str(gw),
                        "--backend", f"http://127.0.0.1:{a}", "--backend",
                        f"http://127.0.0.1:{b}"], str(d / "coordinator.log")))
    try:
        for p in (a, b):
            wait_http(f"http://127.0.0.1:{p}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        yield gw, (a, b)
    finally:
        for p in procs:
            stop(p)


def _post(port: int, body: dict, out: list) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append((r.status, r.headers.get("retry-after"), r.read()))
    except urllib.error.HTTPError as e:
        out.append((e.code, e.headers.get("retry-after"), e.read()))


def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=5) as r:
        return json.loads(r.read())


def test_engines_never_hold_more_than_their_limit_at_four_times_capacity(capped):
    gw, sims = capped
    answers: list = []
    threads = [threading.Thread(target=_post, args=(gw, {
        "model": "motor-sim", "prompt": f"request {i}", "max_tokens": 128, "stream": i % 2 == 1},
        answers)) for i in range(4 * 2 * N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert len(answers) == len(threads)          # one terminal answer each, none hung
    statuses = sorted(a[0] for a in answers)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 2 * N, statuses
    # 4 rounds of 16 requests on 4 slots: the last ones wait longer than queue_timeout_s
    assert 503 in statuses, statuses
    for status, retry_after, body in answers:
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
            assert json.loads(body)["error"]["code"] == 503
    for p in sims:
        st = _stats(p)
        assert st["finished"] >= 1, st
        assert st["max_held"] <= N, st
        assert st["max_running"] <= N, st

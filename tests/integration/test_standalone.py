"""`motor coordinator --backend A --backend B` in front of two `motor sim` processes, no controller."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.procs import free_ports, spawn, stop, wait_http


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    d = tmp_path_factory.mktemp("standalone")
    a, b, gw = free_ports(3)
    procs = [spawn(["sim", "--port", str(p), "--time-scale", "0.05"], str(d / f"sim-{p}.log"))
             for p in (a, b)]
    procs.append(spawn(["coordinator", "--port", str(gw), "--backend", f"http://127.0.0.1:{a}",
                        "--backend", f"http://127.0.0.1:{b}"], str(d / "coordinator.log")))
    try:
        for p in (a, b):
            wait_http(f"http://127.0.0.1:{p}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        yield gw, (a, b)
    finally:
        for p in procs:
            stop(p)


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def test_serves_without_controller_and_spreads_over_both(standalone):
    gw, sims = standalone
    for i in range(6):
        st, out = post(gw, "/v1/completions", {"model": "motor-sim", "prompt": f"hello {i}",
                                               "max_tokens": 4})
        assert st == 200
        body = json.loads(out)
        assert len(body["choices"][0]["text"]) == 4 and body["usage"]["completion_tokens"] == 4
    counts = []
    for p in sims:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5) as r:
            text = r.read().decode()
        line = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
        counts.append(float(line[0].split()[-1]))
    assert all(c >= 8 for c in counts), counts  # round robin: 3 requests x 4 tokens each
    with urllib.request.urlopen(f"http://127.0.0.1:{gw}/v1/models", timeout=5) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["motor-sim"]

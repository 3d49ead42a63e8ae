"""A whole cluster started like `motor up` (controller + node manager + 2 sims + coordinator),
driven by raw HTTP and by the official `openai` SDK."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from motor.config.load import parse_config
from motor.cluster import Cluster, StartError
from tests.support.procs import free_ports, pids_matching

MODEL = "motor-sim"


def make_config(tmp_path):
    ctl, gw = free_ports(2)
    sim_a, sim_b = free_ports(2, consecutive=True)
    data = {
        "controller": {"port": ctl, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
        "coordinator": {"port": gw, "policy": "round_robin"},
        "nodes": [{"name": "n0", "log_dir": str(tmp_path / "engines"), "engines": [{
            "name": "sim", "kind": "sim", "role": "union", "model": MODEL, "count": 2,
            "base_port": sim_a, "health_interval_s": 0.2,
            "restart": {"backoff_initial_s": 0.2},
            "engine_config": {"time-scale": 0.05}}]}],
    }
    return parse_config(data, "test"), (sim_a, sim_b)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    cfg, sims = make_config(d)
    c = Cluster(cfg, str(d / "logs"))
    try:
        try:
            c.start(90)
        except StartError as e:
            logs = "\n".join(f"--- {f}\n" + (d / "logs" / f).read_text()[-3000:]
                             for f in os.listdir(d / "logs") if f.endswith(".log"))
            pytest.fail(f"cluster not ready: {e}; logs:\n{logs}")
        yield c, sims
    finally:
        c.stop()
        # nothing left behind: no process of ours still runs with our config or engine ports
        time.sleep(0.3)
        assert pids_matching(c.config_path) == []
        for p in sims:
            assert pids_matching("motor", "sim", "--port", str(p)) == []


def request(c: Cluster, path: str, body: bytes | dict, method: str = "POST"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(c.url + path, data=data if method == "POST" else None,
                                 method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_models_lists_the_model(cluster):
    c, _ = cluster
    st, _, out = request(c, "/v1/models", b"", "GET")
    assert st == 200 and [m["id"] for m in json.loads(out)["data"]] == [MODEL]


def test_raw_http_completion_and_chat(cluster):
    c, _ = cluster
    st, _, out = request(c, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 5})
    body = json.loads(out)
    assert st == 200 and body["object"] == "text_completion"
    assert body["usage"] == {**body["usage"], "prompt_tokens": 5, "completion_tokens": 5,
                             "total_tokens": 10}
    st, _, out = request(c, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    body = json.loads(out)
    assert st == 200 and body["usage"]["prompt_tokens"] == 21
    assert len(body["choices"][0]["message"]["content"]) == 3


def test_raw_http_stream_arrives_as_sse(cluster):
    c, _ = cluster
    st, h, out = request(c, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 6,
                                                "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert st == 200 and h["content-type"].startswith("text/event-stream")
    events = [e[6:] for e in out.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert len(text) == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_bad_json_gets_400_openai_error(cluster):
    c, _ = cluster
    st, _, out = request(c, "/v1/chat/completions", b'{"model": "motor-sim", "messages": [')
    err = json.loads(out)["error"]
    assert st == 400 and err["code"] == 400 and err["type"] == "BadRequestError"


def test_openai_sdk_sync_and_async(cluster):
    openai = pytest.importorskip("openai")
    c, _ = cluster
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert len(r.choices[0].text) == 4 and r.usage.prompt_tokens == 3
    r = client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert len(r.choices[0].message.content) == 4
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, max_tokens=5, stream=True, messages=[{"role": "user", "content": "hi"}])
        if ch.choices]
    assert len("".join(parts)) == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    client.close()

    async def go():
        ac = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)
        try:
            r = await ac.chat.completions.create(model=MODEL, max_tokens=3,
                                                 messages=[{"role": "user", "content": "x"}])
            assert len(r.choices[0].message.content) == 3
            text = ""
            async for ch in await ac.completions.create(model=MODEL, prompt="p", max_tokens=7,
                                                        stream=True):
                text += ch.choices[0].text if ch.choices else ""
            assert len(text) == 7
        finally:
            await ac.close()
    asyncio.run(go())


def _generation_tokens(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for ln in r.read().decode().splitlines():
            if ln.startswith("vllm:generation_tokens_total"):
                return float(ln.split()[-1])
    return 0.0


def test_kill9_engine_under_load_is_restarted_and_used_again(cluster):
    """kill -9 of one engine while a benchmark runs: the node manager restarts it, the coordinator
    routes around it meanwhile and uses it again once ready; only requests that were on the killed
    engine may fail (mid-stream failover comes with the faults issue)."""
    from motor.bench import BenchConfig, run_bench
    c, (sim_a, sim_b) = cluster
    victim = pids_matching("motor", "sim", "--port", str(sim_a))
    assert len(victim) == 1
    result: dict = {}

    def bench():
        cfg = BenchConfig(url=c.url, model=MODEL, dataset="random", num_requests=120,
                          concurrency=4, input_len=32, output_len=16, timeout=30)
        result["r"] = asyncio.run(run_bench(cfg))
    t = threading.Thread(target=bench)
    t.start()
    time.sleep(0.5)
    os.kill(victim[0], signal.SIGKILL)
    t.join(120)
    r = result["r"]
    assert r.completed + r.failed == 120
    assert r.failed <= 4, r.failure_messages  # at most the requests in flight on the victim
    # restarted (new pid) and serving again
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = pids_matching("motor", "sim", "--port", str(sim_a))
        if new and new != victim:
            try:
                before = _generation_tokens(sim_a)
                break
            except OSError:
                pass
        time.sleep(0.2)
    else:
        pytest.fail("engine was not restarted")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        request(c, "/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 2})
        if _generation_tokens(sim_a) > before:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the restarted engine never got traffic again")

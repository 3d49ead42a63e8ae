"""`coordinator.workers = 2` following a controller through the feed (its long poll):
both workers route to the instances registered with the controller, and an instance the
controller drops stops being routed by both workers.

Real processes on 127.0.0.1: a controller, two `motor sim` engines registered with it over
its HTTP API (as a node manager would, healthy at once), and a coordinator with two
workers pointed at the controller.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from typing import cast

import pytest

from tests.support.procs import free_ports, spawn, stop, wait_http

NODE = "n1"


def post_json(url: str, obj: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(obj).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def register(ctrl: int, sims: dict[str, int]) -> None:
    """The node's whole instance set (a re-registration replaces it)."""
    post_json(f"http://127.0.0.1:{ctrl}/v1/nodes/register", {
        "node": NODE, "host": "127.0.0.1", "instances": [
            {"id": iid, "model": "motor-sim", "role": "union", "engine": "sim",
             "healthy": True, "endpoints": [{"host": "127.0.0.1", "port": port}]}
            for iid, port in sims.items()]})


def finished(sim: int) -> int:
    return int(get_json(f"http://127.0.0.1:{sim}/admin/stats")["finished"])


class Conn:
    """A keep-alive connection to the gateway: one worker answers all its requests."""

    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.pid = self.get("/instances")["worker_pid"]

    def get(self, path: str) -> dict:
        self.c.request("GET", path)
        r = self.c.getresponse()
        return json.loads(r.read())

    def routable(self) -> set[str]:
        """Instance ids this worker routes to (its own endpoint table)."""
        return {e["instance"] for e in self.get("/instances")["endpoints"] if e["routable"]}

    def complete(self) -> int:
        self.c.request("POST", "/v1/completions", json.dumps(
            {"model": "motor-sim", "prompt": "hello", "max_tokens": 2}),
            {"content-type": "application/json"})
        r = self.c.getresponse()
        r.read()
        return r.status

    def close(self) -> None:
        self.c.close()


def one_conn_per_worker(gw: int, n: int = 2, cls: type[Conn] = Conn) -> dict[int, Conn]:
    conns: dict[int, Conn] = {}
    deadline = time.monotonic() + 20
    while len(conns) < n and time.monotonic() < deadline:
        c = cls(gw)
        if c.pid in conns:
            c.close()
        else:
            conns[c.pid] = c
    assert len(conns) == n, "every worker answers on the shared port"
    return conns


def until(pred, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def test_two_workers_follow_the_controller_through_the_feed(tmp_path):
    ctrl, gw, s1, s2 = free_ports(4)
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps({
        # no heartbeats from this "node manager": nothing times out during the test
        "controller": {"host": "127.0.0.1", "port": ctrl, "heartbeat_timeout_s": 600,
                       "remove_after_s": 600, "watch_timeout_s": 2},
        "coordinator": {"host": "127.0.0.1", "port": gw, "policy": "round_robin",
                        "workers": 2}}))
    procs = [spawn(["controller", "-c", str(cfg)], str(tmp_path / "controller.log"))]
    procs += [spawn(["sim", "--port", str(s), "--time-scale", "0", "--seed", str(i)],
                    str(tmp_path / f"sim{i}.log")) for i, s in enumerate((s1, s2))]
    conns: dict[int, Conn] = {}
    sims = {"n1/sim/0": s1, "n1/sim/1": s2}
    try:
        wait_http(f"http://127.0.0.1:{ctrl}/health")
        for s in (s1, s2):
            wait_http(f"http://127.0.0.1:{s}/health")
        register(ctrl, sims)
        procs.append(spawn(["coordinator", "-c", str(cfg), "--controller",
                            f"http://127.0.0.1:{ctrl}"], str(tmp_path / "coord.log")))
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        conns = one_conn_per_worker(gw)

        # both workers got the controller's table through the feed and route to both
        for c in conns.values():
            until(lambda c=c: c.routable() == set(sims), f"worker {c.pid} routes to both")
        for pid, c in conns.items():
            before = {iid: finished(p) for iid, p in sims.items()}
            for _ in range(4):
                assert c.complete() == 200
            got = {iid: finished(p) - before[iid] for iid, p in sims.items()}
            assert got == {"n1/sim/0": 2, "n1/sim/1": 2}, f"worker {pid} (round robin): {got}"

        # the controller drops one instance: neither worker routes to it any more
        register(ctrl, {"n1/sim/0": s1})
        for c in conns.values():
            until(lambda c=c: c.routable() == {"n1/sim/0"}, f"worker {c.pid} dropped n1/sim/1")
        gone = finished(s2)
        for c in conns.values():
            for _ in range(4):
                assert c.complete() == 200
        assert finished(s2) == gone, "no request reached the removed instance"
        assert finished(s1) >= 4 + 8
    finally:
        for c in conns.values():
            c.close()
        for p in reversed(procs):
            stop(p)


# -- the engines' models through the feed: LoRA adapters and max_model_len (issue 18) --------
MAX_MODEL_LEN = 128
ADAPTER = "sql-lora"
SIM_ARGS = ["--time-scale", "0", "--max-model-len", str(MAX_MODEL_LEN), "--context-keyed-text",
            "--seed", "0"]
NO_FAULT = {"mode": "none"}


class ChatConn(Conn):
    def models(self) -> set[str]:
        return {m["id"] for m in self.get("/v1/models")["data"]}

    def ask(self, model: str) -> int:
        self.c.request("POST", "/v1/chat/completions", json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 2}), {"content-type": "application/json"})
        r = self.c.getresponse()
        r.read()
        return r.status

    def story(self) -> tuple[str, str | None, dict]:
        """A streamed chat without max_tokens: (text, last finish_reason, usage)."""
        self.c.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "motor-sim", "messages": [{"role": "user", "content": "a long story"}],
             "stream": True, "stream_options": {"include_usage": True}, "seed": 7}),
            {"content-type": "application/json"})
        r = self.c.getresponse()
        assert r.status == 200
        text, finish, usage = "", None, {}
        for ev in r.read().split(b"\n\n"):
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            o = json.loads(ev[6:])
            assert "error" not in o, o
            usage = o.get("usage") or usage
            for ch in o.get("choices") or []:
                text += (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
        return text, finish, usage


def fault(sim: int, spec: dict) -> None:
    post_json(f"http://127.0.0.1:{sim}/admin/fault", spec)


def lora(sim: int, op: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{sim}/v1/{op}_lora_adapter",
                                 data=json.dumps({"lora_name": ADAPTER,
                                                  "lora_path": "/adapters/sql"}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("source", ["controller", "standalone"])
def test_two_workers_follow_the_engines_models(tmp_path, source):
    """workers: 2. A LoRA adapter loaded on one engine at run time is listed and routed (to
    that engine only) by both workers, and 404 again once unloaded; a chat without max_tokens
    broken mid-stream twice continues with the rest of the context (the engines'
    max_model_len), ending as the uninterrupted answer does, through both workers."""
    ctrl, gw, s1, s2 = free_ports(4)
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps({
        "controller": {"host": "127.0.0.1", "port": ctrl, "heartbeat_timeout_s": 600,
                       "remove_after_s": 600, "watch_timeout_s": 2},
        "coordinator": {"host": "127.0.0.1", "port": gw, "policy": "round_robin",
                        "workers": 2, "health_check_interval_s": 0.1}}))
    procs = []
    if source == "controller":
        procs.append(spawn(["controller", "-c", str(cfg)], str(tmp_path / "controller.log")))
    procs += [spawn(["sim", "--port", str(s)] + SIM_ARGS, str(tmp_path / f"sim{i}.log"))
              for i, s in enumerate((s1, s2))]
    conns: dict[int, Conn] = {}
    try:
        for s in (s1, s2):
            wait_http(f"http://127.0.0.1:{s}/health")
        if source == "controller":
            wait_http(f"http://127.0.0.1:{ctrl}/health")
            register(ctrl, {"n1/sim/0": s1, "n1/sim/1": s2})
            where = ["--controller", f"http://127.0.0.1:{ctrl}"]
        else:
            where = ["--backend", f"http://127.0.0.1:{s1}", f"http://127.0.0.1:{s2}"]
        procs.append(spawn(["coordinator", "-c", str(cfg)] + where, str(tmp_path / "coord.log")))
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        conns = one_conn_per_worker(gw, cls=ChatConn)
        chat = cast(dict[int, ChatConn], conns)
        for c in chat.values():
            until(lambda c=c: c.models() == {"motor-sim"}, f"worker {c.pid} lists motor-sim")
            assert c.ask(ADAPTER) == 404

        # an adapter loaded on sim 1 at run time: both workers list it and route it there
        lora(s1, "load")
        for c in chat.values():
            until(lambda c=c: ADAPTER in c.models(), f"worker {c.pid} lists the adapter")
        before = {s: finished(s) for s in (s1, s2)}
        for c in chat.values():
            for _ in range(3):
                assert c.ask(ADAPTER) == 200
        assert finished(s1) - before[s1] == 6 and finished(s2) == before[s2]
        lora(s1, "unload")
        for c in chat.values():
            until(lambda c=c: ADAPTER not in c.models(), f"worker {c.pid} forgot the adapter")
            assert c.ask(ADAPTER) == 404

        # failover budget: both sims drop their next stream after 4 tokens; the answer goes
        # sim -> other sim -> first sim again, and still ends at the context length
        for c in chat.values():
            whole, fin, usage = c.story()
            assert fin == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
            for s in (s1, s2):
                fault(s, {"mode": "drop_after", "tokens": 4, "count": 1})
            try:
                text, fin2, usage2 = c.story()
            finally:
                for s in (s1, s2):
                    fault(s, NO_FAULT)
            assert (text, fin2) == (whole, "length"), f"worker {c.pid}"
            assert usage2["completion_tokens"] == usage["completion_tokens"]
    finally:
        for c in conns.values():
            c.close()
        for p in reversed(procs):
            stop(p)

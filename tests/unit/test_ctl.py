"""``motor ctl`` against a real in-process controller (and node manager with simulated engines),
a follower of our own that answers 307, and a coordinator's ``/instances`` figures."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import uvloop

import motor.ctl as ctl
from motor.cli import main
from motor.config.schema import ClusterConfig, ControllerConfig, NodeConfig
from motor.controller.server import ControllerServer
from motor.node_manager.agent import NodeAgent
from motor.protocol.instances import Endpoint, InstanceSpec, NodeRegistration

from .node_manager.helpers import free_ports, wait_until


class Loop:
    """An event loop in a thread: the controller (and node manager) run there while ``motor
    ctl``, which blocks, runs in the test's thread."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def controller() -> Iterator[tuple[Loop, ControllerServer]]:
    loop = Loop()
    srv = ControllerServer(ControllerConfig(port=free_ports(), heartbeat_timeout_s=5,
                                            remove_after_s=60))
    loop.run(srv.start(port=0))
    try:
        yield loop, srv
    finally:
        loop.run(srv.stop())
        loop.close()


def post(url: str, body: object) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def register_fake_node(url: str) -> None:
    """Node n1 with two instances, the first one healthy (no engines behind them)."""
    specs = [InstanceSpec(id=f"n1/sim/{i}", model="m", role="union", engine="sim",
                          endpoints=[Endpoint(host="127.0.0.1", port=18100 + i)])
             for i in range(2)]
    post(url + "/v1/nodes/register",
         json.loads(NodeRegistration(node="n1", instances=specs).model_dump_json()))
    post(url + "/v1/nodes/heartbeat", {"node": "n1", "health": {"n1/sim/0": True,
                                                                  "n1/sim/1": False}})


def ctl_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["ctl", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


class FakeServer:
    """A small HTTP server of our own on 127.0.0.1: ``answer(method, path, body) -> (status,
    headers, body)``."""

    def __init__(self, answer: Any) -> None:
        self.requests: list[tuple[str, str]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def _do(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.requests.append((self.command, self.path))
                status, headers, data = answer(self.command, self.path, body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _do

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def follower_of(leader: str) -> FakeServer:
    """A follower controller: every request -> 307 to ``leader`` + the same path."""
    def answer(method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        doc = {"error": {"message": f"this controller follows; the leader is {leader}",
                         "type": "redirect", "param": None, "code": 307}, "leader": leader}
        return 307, {"location": leader + path}, json.dumps(doc).encode()
    return FakeServer(answer)


def leaderless() -> FakeServer:
    def answer(method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        doc = {"error": {"message": "no controller leads", "type": "unavailable",
                         "param": None, "code": 503}, "leader": None}
        return 503, {"retry-after": "1"}, json.dumps(doc).encode()
    return FakeServer(answer)


# ------------------------------------------------------------------ listing


def test_instances_and_nodes_as_aligned_tables_and_as_json(
        controller: tuple[Loop, ControllerServer], capsys: pytest.CaptureFixture[str]) -> None:
    _, srv = controller
    register_fake_node(srv.url)
    code, out, err = ctl_main(capsys, "--controller", srv.url, "instances")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["INSTANCE", "NODE", "ROLE", "ENGINE", "MODEL", "STATE",
                                "ENDPOINTS", "REASON"]
    assert lines[1].split()[:7] == ["n1/sim/0", "n1", "union", "sim", "m", "ready",
                                    "127.0.0.1:18100"]
    assert lines[2].split()[5] == "starting"
    # aligned: every column starts where its header does
    for h in ("NODE", "STATE", "ENDPOINTS"):
        col = lines[0].index(h)
        assert all(ln[col - 2:col] == "  " and ln[col] != " " for ln in lines[1:]), h
    code, out, _ = ctl_main(capsys, "instances", "--output", "json", "--controller", srv.url)
    assert code == 0
    doc = json.loads(out)
    assert [i["id"] for i in doc["instances"]] == ["n1/sim/0", "n1/sim/1"]
    assert doc["version"] == srv.registry.version
    code, out, _ = ctl_main(capsys, "--controller", srv.url, "nodes")
    assert code == 0
    assert out.splitlines()[0].split() == ["NODE", "HOST", "MGMT_PORT", "HEARTBEAT_AGE_S",
                                           "INSTANCES"]
    assert out.splitlines()[1].split()[0:3] == ["n1", "127.0.0.1", "-"]
    assert out.splitlines()[1].split()[-1] == "n1/sim/0,n1/sim/1"
    code, out, _ = ctl_main(capsys, "--output", "json", "nodes", "--controller", srv.url)
    assert json.loads(out)["nodes"][0]["node"] == "n1"


def test_the_controller_of_the_config_is_the_default(
        controller: tuple[Loop, ControllerServer], capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    _, srv = controller
    register_fake_node(srv.url)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"controller": {"port": srv.port,
                                              "peers": [f"http://127.0.0.1:{free_ports()}",
                                                        srv.url]}}))
    code, out, err = ctl_main(capsys, "-c", str(cfg), "instances", "--output", "json")
    assert code == 0, err
    assert len(json.loads(out)["instances"]) == 2


# ------------------------------------------------------------------ the leader


def test_a_follower_s_307_is_followed_and_dead_or_leaderless_controllers_skipped(
        controller: tuple[Loop, ControllerServer], capsys: pytest.CaptureFixture[str]) -> None:
    _, srv = controller
    register_fake_node(srv.url)
    follower, none = follower_of(srv.url), leaderless()
    dead = f"http://127.0.0.1:{free_ports()}"
    try:
        code, out, err = ctl_main(capsys, "--controller", dead, "--controller",
                                  f"{none.url},{follower.url}", "instances", "--output", "json")
        assert code == 0, err
        assert [i["id"] for i in json.loads(out)["instances"]] == ["n1/sim/0", "n1/sim/1"]
        assert none.requests == [("GET", "/v1/instances")]
        assert follower.requests == [("GET", "/v1/instances")]
        # the client asks the leader first next time
        c = ctl.ControllerClient([dead, follower.url])
        c.get("/v1/nodes")
        assert str(c.current) == srv.url
        c.get("/v1/nodes")
        assert len(follower.requests) == 2
    finally:
        follower.close()
        none.close()


def test_no_controller_or_a_refusal_is_status_1_with_the_error(
        controller: tuple[Loop, ControllerServer], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, srv = controller
    register_fake_node(srv.url)
    monkeypatch.setattr(ctl, "LEADERLESS_RETRY_S", 0.3)
    dead = f"http://127.0.0.1:{free_ports()}"
    none = leaderless()
    try:
        code, out, err = ctl_main(capsys, "--controller", dead, "--controller", none.url,
                                  "nodes")
        assert (code, out) == (1, "")
        assert err.startswith("motor ctl: no controller answered: ")
        assert "connection refused" in err and "no leader elected yet" in err
        assert len(none.requests) >= 2   # the list was tried again
    finally:
        none.close()
    code, out, err = ctl_main(capsys, "--controller", srv.url, "drain", "n1/sim/9")
    assert (code, out) == (1, "")
    assert "the controller refused (404)" in err and "n1/sim/9" in err
    # n1 registered no management API: the controller refuses with 409
    code, _, err = ctl_main(capsys, "--controller", srv.url, "stop", "n1/sim/0")
    assert code == 1 and "(409)" in err and "management API" in err


@pytest.mark.parametrize("argv, message", [
    (["instances", "--output", "yaml"], "argument --output: expected one of table, json"),
    (["restart"], "argument ID: expected an instance id (or --rolling), got none"),
    (["restart", "n1/sim/0", "--rolling"], "argument ID: expected no instance id with"),
    (["--controller", "http://127.0.0.1:1", "restart", "--rolling", "--no-wait"],
     "--no-wait: a rolling restart waits for each instance to be ready before the next"),
    (["drain"], "the following arguments are required: ID"),
    (["drain", "x", "--timeout", "-1"], "argument --timeout: expected a number >= 0"),
    (["--controller", "127.0.0.1:1", "nodes"], "argument --controller: expected a URL"),
    (["--controller", "https://127.0.0.1:1", "nodes"], "https:// controller URL needs "
                                                       "controller.tls"),
    ([], "the following arguments are required: SUBCOMMAND"),
])
def test_usage_errors_are_status_2(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code, _, err = ctl_main(capsys, *argv)
    except SystemExit as e:     # refused by argparse
        code, err = int(e.code or 0), capsys.readouterr().err
    assert code == 2
    assert message in err


# ------------------------------------------------------------------ hotness


class _Resp:
    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []

    def send(self, status: int, body: bytes = b"", **kw: object) -> None:
        self.sent.append((status, body))


def test_coordinator_kv_blocks_order_the_rolling_restart() -> None:
    """A coordinator's GET /instances carries the KV-index blocks of each endpoint; the rolling
    order is least hot first."""
    from motor.coordinator.endpoints import EndpointTable
    from motor.coordinator.kv.router import KvRouter
    from motor.coordinator.policy import make_policy
    from motor.coordinator.server import Coordinator
    from motor.http import Client
    from motor.protocol.instances import Instance, InstanceTable

    async def go() -> dict[str, Any]:
        cfg = ClusterConfig.model_validate({"coordinator": {"policy": "kv_affinity"}})
        client = Client()
        table = EndpointTable(client)
        router = KvRouter(cfg.coordinator.kv)
        coord = Coordinator(cfg.coordinator, table, make_policy("kv_affinity", router=router))
        table.apply(InstanceTable(version=3, instances=[
            Instance(id=f"n1/sim/{i}", model="m", role="union", engine="sim", node="n1",
                     state="ready", endpoints=[Endpoint(host="127.0.0.1", port=18100 + i)])
            for i in range(3)]))
        router.note_sent(router.slot("n1/sim/0#0"), "m", np.arange(1, 9, dtype=np.uint64))
        router.note_sent(router.slot("n1/sim/2#0"), "m", np.arange(20, 22, dtype=np.uint64))
        r = _Resp()
        await coord._on_instances(None, r)  # type: ignore[arg-type]
        client.close()
        coord.close()
        return orjson.loads(r.sent[0][1])  # type: ignore[no-any-return]

    doc = asyncio.run(go())
    blocks = {e["instance"]: e["kv_blocks"] for e in doc["endpoints"]}
    assert blocks == {"n1/sim/0": 8, "n1/sim/1": 0, "n1/sim/2": 2}
    # the same figures through HTTP, from two coordinators (one of them down)
    coord = FakeServer(lambda m, p, b: (200, {}, json.dumps(doc).encode()))
    try:
        hot, failed = ctl.coordinator_hotness([coord.url, f"http://127.0.0.1:{free_ports()}"])
    finally:
        coord.close()
    assert hot == blocks and len(failed) == 1
    assert ctl.rolling_order(["n1/sim/0", "n1/sim/1", "n1/sim/2"], hot) == \
        ["n1/sim/1", "n1/sim/2", "n1/sim/0"]
    assert ctl.rolling_order(["b", "a"], {}) == ["a", "b"]


def test_the_feed_s_instances_carry_kv_blocks() -> None:
    """A multi-worker coordinator's management ``/instances`` (the feed): ``kv_blocks`` from
    the KV events it recorded, null without KV events."""
    import uuid
    from types import SimpleNamespace

    from motor._fast.ring import Ring
    from motor.coordinator.feed import Feed
    from motor.coordinator.loadtable import LoadTable
    from motor.coordinator.rings import ring_names

    async def go() -> tuple[Any, Any]:
        cfg = ClusterConfig.model_validate({"coordinator": {"policy": "kv_affinity"}})
        prefix = f"motor-test-ctl-{uuid.uuid4().hex[:10]}"
        load = LoadTable.create(f"{prefix}-load", 1, 16)
        w, h = ring_names(prefix, 0)
        rings = [(Ring.create(w, 1 << 20), Ring.create(h, 1 << 16))]
        try:
            feed = Feed(cfg, load, rings)
            feed.set_endpoints({f"n1/sim/{i}#0": SimpleNamespace(
                host="127.0.0.1", port=9 + i, ready=True, kv_events=None, dp_rank=0)
                for i in range(2)})
            without = feed.instances()["endpoints"]
            feed.kv_feed = SimpleNamespace(sync=lambda: None, close=lambda: None)
            feed.kv.index.store(feed.slots["n1/sim/1#0"][0], 0, 0,
                                np.arange(1, 6, dtype=np.uint64))
            return without, feed.instances()["endpoints"]
        finally:
            for r in (x for pair in rings for x in pair):
                r.close()
                r.unlink()
            load.close()
            load.unlink()

    without, with_events = asyncio.run(go())
    assert [e["kv_blocks"] for e in without] == [None, None]
    assert [(e["instance"], e["kv_blocks"]) for e in with_events] == [("n1/sim/0", 0),
                                                                     ("n1/sim/1", 5)]


# ------------------------------------------------------------------ lifecycle


def test_drain_start_restart_and_rolling_restart_of_real_engines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the controller to a node manager with two simulated engines."""
    loop = Loop()
    srv = ControllerServer(ControllerConfig(port=free_ports(), heartbeat_timeout_s=3,
                                            remove_after_s=30))
    loop.run(srv.start(port=0))
    node = NodeConfig(name="n1", log_dir=str(tmp_path / "logs"), engines=[dict(
        name="sim", kind="sim", model="m", count=2, base_port=free_ports(2),
        health_interval_s=0.05, stop_timeout_s=5,
        restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.2})])

    async def make() -> NodeAgent:
        a = NodeAgent(node, srv.url, heartbeat_interval_s=0.1, mgmt_port=0)
        await a.start()
        return a
    agent = loop.run(make())

    def states() -> dict[str, str]:
        return {i.id: i.state.value for i in srv.registry.table().instances}

    def pids() -> list[int | None]:
        return [i.processes[0].pid for i in agent.instances]

    coord = FakeServer(lambda m, p, b: (200, {}, json.dumps({"endpoints": [
        {"key": "n1/sim/0#0", "instance": "n1/sim/0", "kv_blocks": 50},
        {"key": "n1/sim/1#0", "instance": "n1/sim/1", "kv_blocks": 3}]}).encode()))
    url = srv.url
    try:
        wait_until(lambda: states() == {"n1/sim/0": "ready", "n1/sim/1": "ready"}, 20, "ready")
        code, out, err = ctl_main(capsys, "--controller", url, "drain", "n1/sim/0",
                                  "--grace", "0.05", "--timeout", "5")
        assert code == 0, err
        assert out.splitlines()[1].split()[:3] == ["n1/sim/0", "drain", "stopped"]
        assert states()["n1/sim/0"] == "stopped" and pids()[0] is None
        code, out, err = ctl_main(capsys, "--controller", url, "start", "n1/sim/0",
                                  "--output", "json")
        assert code == 0, err
        assert json.loads(out)["action"] == "start"
        wait_until(lambda: states()["n1/sim/0"] == "ready", 20, "started")
        before = pids()
        code, out, err = ctl_main(capsys, "--controller", url, "restart", "n1/sim/1",
                                  "--no-drain", "--output", "json")
        assert code == 0, err
        r = json.loads(out)
        assert r["state"] == "ready" and r["waited_s"] > 0
        assert pids()[1] not in (None, before[1]) and pids()[0] == before[0]
        before = pids()
        code, out, err = ctl_main(capsys, "--controller", url, "restart", "--rolling",
                                  "--coordinator", coord.url, "--grace", "0.05",
                                  "--output", "json")
        assert code == 0, err
        r = json.loads(out)
        assert r["order"] == ["n1/sim/1", "n1/sim/0"]    # the cold one first
        assert [x["state"] for x in r["results"]] == ["ready", "ready"]
        assert [x["kv_blocks"] for x in r["results"]] == [3, 50]
        after = pids()
        assert all(p is not None for p in after) and after[0] != before[0] and \
            after[1] != before[1]
        assert states() == {"n1/sim/0": "ready", "n1/sim/1": "ready"}
    finally:
        coord.close()
        loop.run(agent.stop())
        loop.run(srv.stop())
        loop.close()


def test_a_url_that_is_not_a_controller_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Another server's 404 on /v1/instances (what a coordinator answers): not a controller."""
    def answer(method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        doc = {"error": {"message": f"no route for {path}", "type": "NotFoundError",
                         "param": None, "code": 404}}
        return 404, {}, json.dumps(doc).encode()
    other = FakeServer(answer)
    try:
        code, _, err = ctl_main(capsys, "--controller", other.url, "instances")
    finally:
        other.close()
    assert code == 1
    assert "does not look like a motor controller" in err and "GET /instances" in err

"""The engines' figures re-exported by a real controller (``GET /metrics/engines``,
``GET /v1/engines``) from in-process ``motor sim`` engines on 127.0.0.1, the cluster page
served, and the renderer on its own (motor.controller.engine_metrics)."""
from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from motor.config.schema import ControllerConfig
from motor.controller import engine_metrics
from motor.controller.engine_metrics import EngineScraper, Scraped, Target, render
from motor.controller.server import ControllerServer
from motor.http import Client
from motor.protocol.instances import InstanceTable
from motor.sim.engine import EngineConfig
from motor.sim.options import SimOptions
from motor.sim.server import SimServer


def _dead_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Cluster:
    """A controller and ``n`` sims, registered as node ``n0`` (instances ``n0/sim/<i>``),
    plus ``n0/dead/0`` whose endpoint does not listen; every instance ready."""

    def __init__(self, srv: ControllerServer, sims: list[SimServer], client: Client) -> None:
        self.srv, self.sims, self.client = srv, sims, client

    async def get(self, path: str) -> tuple[int, bytes]:
        assert self.srv.port is not None
        return await self.client.get_json_bytes("127.0.0.1", self.srv.port, path, 10)

    async def post(self, path: str, body: Any) -> Any:
        assert self.srv.port is not None
        st, raw = await self.client.post_json_bytes("127.0.0.1", self.srv.port, path,
                                                    orjson.dumps(body), 10)
        assert st == 200, raw
        return orjson.loads(raw)


def run(fn: Callable[[Cluster], Awaitable[None]], n: int = 2, dead: bool = True) -> None:
    async def go() -> None:
        srv = ControllerServer(ControllerConfig(host="127.0.0.1", port=18500))
        await srv.start(port=0)
        sims = [SimServer(SimOptions(host="127.0.0.1", port=0, model="m",
                                     engine=EngineConfig(time_scale=0.05)))
                for _ in range(n)]
        client = Client()
        try:
            ports = [await s.start() for s in sims]
            insts = [{"id": f"n0/sim/{i}", "model": "m", "role": "union", "engine": "sim",
                      "endpoints": [{"host": "127.0.0.1", "port": p}]}
                     for i, p in enumerate(ports)]
            if dead:
                insts.append({"id": "n0/dead/0", "model": "m", "role": "decode",
                              "engine": "vllm",
                              "endpoints": [{"host": "127.0.0.1", "port": _dead_port(),
                                             "dp_rank": 1}]})
            c = Cluster(srv, sims, client)
            await c.post("/v1/nodes/register", {"node": "n0", "host": "127.0.0.1",
                                                "instances": insts})
            await c.post("/v1/nodes/heartbeat", {"node": "n0", "health": dict.fromkeys(
                (i["id"] for i in insts), True)})
            await fn(c)
        finally:
            client.close()
            await srv.stop()
            for s in sims:
                await s.stop(drain_timeout_s=0.0)
    asyncio.run(go())


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_engine_sample_carries_the_instance_labels_and_a_dead_one_is_scrape_up_0():
    async def body(c: Cluster) -> None:
        st, raw = await c.get("/metrics/engines")
        assert st == 200
        text = raw.decode()
        fams = _families(text)
        running = fams["vllm:num_requests_running"]
        assert running.type == "gauge"
        assert sorted((s.labels["motor_instance"], s.labels["motor_node"],
                       s.labels["motor_role"], s.labels["dp_rank"]) for s in running.samples
                      ) == [("n0/sim/0", "n0", "union", "0"), ("n0/sim/1", "n0", "union", "0")]
        # the engine's own labels stay
        assert {s.labels["model_name"] for s in running.samples} == {"m"}
        up = {(s.labels["motor_instance"], s.labels["motor_role"], s.labels["dp_rank"]): s.value
              for s in fams["motor_engine_scrape_up"].samples}
        assert up == {("n0/sim/0", "union", "0"): 1.0, ("n0/sim/1", "union", "0"): 1.0,
                      ("n0/dead/0", "decode", "1"): 0.0}
        samples = {s.labels["motor_instance"]: s.value
                   for s in fams["motor_engine_scrape_samples"].samples}
        assert samples["n0/dead/0"] == 0 and samples["n0/sim/0"] > 50
        # nothing of the dead one but its scrape gauges; HELP / TYPE once per family
        dead = [ln for ln in text.splitlines() if 'motor_instance="n0/dead/0"' in ln]
        assert dead and all(ln.startswith("motor_engine_scrape_") for ln in dead)
        types = re.findall(r"^# TYPE (\S+) ", text, re.M)
        assert len(types) == len(set(types))
        assert "vllm:num_requests_running" in types
        hist = fams["vllm:time_to_first_token_seconds"]
        assert hist.type == "histogram"
        assert {s.labels["motor_instance"] for s in hist.samples} == {"n0/sim/0", "n0/sim/1"}
    run(body)


def test_the_summary_gives_each_endpoints_load_and_why_one_is_down():
    async def body(c: Cluster) -> None:
        # a request on sim 0, so its TTFT count and prefix queries move
        port = c.sims[0].port
        st, _ = await c.client.post_json_bytes(
            "127.0.0.1", port, "/v1/completions",
            orjson.dumps({"model": "m", "prompt": "hello there " * 20, "max_tokens": 2}), 10)
        assert st == 200
        st, raw = await c.get("/v1/engines")
        assert st == 200
        doc = orjson.loads(raw)
        by = {e["instance"]: e for e in doc["endpoints"]}
        assert set(by) == {"n0/sim/0", "n0/sim/1", "n0/dead/0"}
        assert doc["version"] == c.srv.registry.version and doc["scraped_at"] > 0
        s0 = by["n0/sim/0"]
        assert s0["up"] is True and s0["error"] is None and s0["url"] == f"http://127.0.0.1:{port}"
        assert s0["running"] == 0 and s0["waiting"] == 0 and 0 <= s0["kv_usage"] <= 1
        assert s0["ttft_count"] == 1 and s0["ttft_sum_s"] > 0
        assert s0["prefix_queries"] > 0 and 0 <= s0["prefix_hit_ratio"] <= 1
        assert by["n0/sim/1"]["ttft_count"] == 0 and by["n0/sim/1"]["prefix_hit_ratio"] is None
        d = by["n0/dead/0"]
        assert d["up"] is False and d["running"] is None and d["error"]
        assert (d["role"], d["dp_rank"], d["node"]) == ("decode", 1, "n0")
    run(body)


def test_scrapes_at_most_once_a_second_whatever_the_number_of_callers():
    async def body(c: Cluster) -> None:
        before = [s.requests_by_path.get("/metrics", 0) for s in c.sims]
        answers = await asyncio.gather(*(c.get("/metrics/engines") for _ in range(8)),
                                       *(c.get("/v1/engines") for _ in range(4)))
        assert all(st == 200 for st, _ in answers)
        assert len({raw for st, raw in answers[:8]}) == 1
        after = [s.requests_by_path.get("/metrics", 0) for s in c.sims]
        assert [a - b for a, b in zip(after, before)] == [1, 1]
        assert c.srv._engine_scraper().rounds == 1
    run(body)


def test_only_ready_unhealthy_and_draining_instances_are_scraped():
    async def body(c: Cluster) -> None:
        await c.post("/v1/nodes/heartbeat", {"node": "n0", "health": {
            "n0/sim/0": True, "n0/sim/1": True, "n0/dead/0": True}, "stopped": ["n0/sim/1"]})
        assert c.srv.registry.state("n0/sim/1").value == "stopped"
        st, raw = await c.get("/v1/engines")
        assert {e["instance"] for e in orjson.loads(raw)["endpoints"]} == {"n0/sim/0",
                                                                          "n0/dead/0"}
    run(body)


def test_no_instance_no_engine_series_but_an_answer():
    async def body(c: Cluster) -> None:
        await c.post("/v1/nodes/deregister", {"node": "n0"})
        st, raw = await c.get("/metrics/engines")
        assert st == 200 and b"vllm:" not in raw and b"motor_engine_scrape_up{" not in raw
    run(body, n=0, dead=False)


def test_a_follower_redirects_the_engine_routes_and_the_page_to_the_leader():
    class Follower:
        is_leader = False
        serves = False
        leader_url = "http://127.0.0.1:1"

    async def body(c: Cluster) -> None:
        c.srv.ha = Follower()  # type: ignore[assignment]
        try:
            for path in ("/metrics/engines", "/v1/engines", "/cluster"):
                assert c.srv.port is not None
                pool = c.client.pool("127.0.0.1", c.srv.port)
                up = await pool.request(b"GET", path.encode(), first_byte_timeout_s=5)
                async with up:
                    await up.read()
                assert up.status == 307, path
                assert up.header(b"location") == f"http://127.0.0.1:1{path}".encode()
        finally:
            c.srv.ha = None
    run(body, n=0, dead=False)


def test_the_cluster_page_is_self_contained_html():
    async def body(c: Cluster) -> None:
        assert c.srv.port is not None
        pool = c.client.pool("127.0.0.1", c.srv.port)
        up = await pool.request(b"GET", b"/cluster", first_byte_timeout_s=5)
        async with up:
            page = (await up.read()).decode()
        assert up.status == 200
        assert up.header(b"content-type") == b"text/html; charset=utf-8"
        assert page.startswith("<!doctype html>") and "<script>" in page
        # no asset from elsewhere: no tag with a src / href attribute, no stylesheet link,
        # no module import; the only URL is the SVG namespace
        assert not re.search(r"<[a-z]+\s[^>]*\b(src|href)\s*=", page)
        assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
        assert "<link" not in page and "@import" not in page and "import(" not in page
        for path in ("/v1/instances", "/v1/engines", "/v1/nodes", "/v1/leader"):
            assert f'"{path}' in page
    run(body, n=0, dead=False)


# -- the renderer and the scraper on their own ---------------------------------------------
_T = Target("n1/vllm/0", "n1", "prefill", 2, "127.0.0.1", 1)
_U = Target("n1/vllm/1", "n1", "prefill", 0, "127.0.0.1", 2)


def test_a_family_of_another_type_under_the_same_name_is_left_out_for_the_later_engine():
    a = "# TYPE x gauge\nx 1\n# TYPE y_total counter\ny_total 3\n"
    b = "# TYPE x_total counter\nx_total 5\n# TYPE y_total counter\ny_total 4\n"
    fams = _families(render([Scraped(_T, a, None, 0.01), Scraped(_U, b, None, 0.02)]).decode())
    assert fams["x"].type == "gauge"
    assert [(s.labels["motor_instance"], s.value) for s in fams["x"].samples] == [("n1/vllm/0", 1)]
    assert sorted((s.labels["motor_instance"], s.value) for s in fams["y"].samples
                  if s.name == "y_total") == [("n1/vllm/0", 3), ("n1/vllm/1", 4)]


def test_text_that_does_not_parse_counts_as_down_and_our_labels_replace_the_engines():
    good = '# TYPE g gauge\ng{motor_instance="spoofed",dp_rank="9"} 2\n'
    fams = _families(render([Scraped(_T, good, None, 0.01),
                             Scraped(_U, "g{{{ not prometheus", None, 0.01)]).decode())
    assert [(s.labels["motor_instance"], s.labels["dp_rank"]) for s in fams["g"].samples] == [
        ("n1/vllm/0", "2")]
    up = {s.labels["motor_instance"]: s.value for s in fams["motor_engine_scrape_up"].samples}
    assert up == {"n1/vllm/0": 1.0, "n1/vllm/1": 0.0}


def test_label_values_are_escaped():
    t = Target('n"1\\x', "n\n1", "union", 0, "127.0.0.1", 1)
    text = render([Scraped(t, "# TYPE g gauge\ng 1\n", None, 0.01)]).decode()
    [s] = _families(text)["g"].samples
    assert s.labels["motor_instance"] == 'n"1\\x' and s.labels["motor_node"] == "n\n1"


def test_the_cache_expires_after_min_interval_s():
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    async def go() -> None:
        clock = Clock()
        sc = EngineScraper(lambda: InstanceTable(version=3), min_interval_s=1.0, clock=clock)
        a = await sc.snapshot()
        clock.t = 0.9
        assert await sc.snapshot() is a
        clock.t = 1.0
        b = await sc.snapshot()
        assert b is not a and sc.rounds == 2 and b.version == 3
        assert (await sc.summary())["endpoints"] == []
    asyncio.run(go())


def test_an_engine_slower_than_the_timeout_is_down_within_the_timeout():
    async def go() -> None:
        # a listening socket nobody accepts on: the connection opens (the kernel's
        # backlog), no answer ever comes
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        client = Client()
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            s = await engine_metrics.scrape_one(
                client, Target("a", "n", "union", 0, "127.0.0.1", silent.getsockname()[1]), 0.2)
            assert loop.time() - t0 < 1.0
            assert s.text is None and s.error == "no answer within 0.2 s"
        finally:
            client.close()
            silent.close()
    asyncio.run(go())

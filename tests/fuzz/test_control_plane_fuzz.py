"""Fuzz lane: hypothesis-made requests against the control plane's HTTP APIs (issue 17 item 6).

A controller and a node manager (one fake engine, management API on) run in-process on a
background event loop, on 127.0.0.1 with port 0. The routes come from their :class:`Router`
objects, so a route added later is fuzzed too. Each example is one HTTP exchange on a fresh
connection (``http.client``, which rejects a malformed answer). Properties:

* every answer is a well-formed HTTP response with a status < 500; a 4xx carries an OpenAI
  error body ``{"error": {"message", "type", "param", "code"}}``;
* a refused request (4xx) changes nothing in the registry;
* the registry's invariants hold after every example (public API only): versions never go
  backwards, every instance belongs to a registered node and the other way round, the table
  survives the trip a coordinator makes (JSON -> ``orjson.loads`` -> ``InstanceTable``)
  unchanged, instance ids and (instance, DP rank) pairs are unique;
* the server keeps serving: a valid registration, long poll and deregistration work after it.

Bounded: a few hundred examples, no deadline, about 10 s on 2 cores.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from motor.config.schema import ControllerConfig, NodeConfig
from motor.controller.server import ControllerServer
from motor.http import Router
from motor.node_manager.agent import NodeAgent
from motor.protocol.instances import InstanceState, InstanceTable
from tests.unit.node_manager.helpers import FAKE_LAUNCHER, free_ports

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])

T = TypeVar("T")


class FakeClock:
    """The registry's clock: still, so no heartbeat timeout changes the registry under a test
    (a refused request must leave it exactly as it was)."""
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class Background:
    """Controller + node manager on their own event loop thread (module-wide)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.log_dir = tempfile.TemporaryDirectory(prefix="motor-fuzz-nm-")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "background servers did not start"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.clock = FakeClock()
            # watch_timeout_s caps every long poll the fuzzer sends; heartbeat_timeout_s is the
            # warm-up that holds a poll from "another incarnation" (at most watch_timeout_s)
            self.ctrl = ControllerServer(ControllerConfig(host="127.0.0.1", watch_timeout_s=0.05,
                                                          heartbeat_timeout_s=5.0),
                                         clock=self.clock)
            await self.ctrl.start(port=0)
            node = NodeConfig(name="nm", log_dir=self.log_dir.name, engines=[dict(
                name="fake", kind="sim", model="m", count=1, base_port=free_ports(1),
                launcher=FAKE_LAUNCHER, health_interval_s=0.2, stop_timeout_s=2)])
            # its controller is a closed port: the node manager retries in the background and
            # its traffic never changes the fuzzed registry
            self.agent = NodeAgent(node, f"http://127.0.0.1:{free_ports(1)}",
                                   heartbeat_interval_s=1.0, mgmt_host="127.0.0.1", mgmt_port=0)
            await self.agent.start()

        try:
            self.loop.run_until_complete(start())
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        self.loop.run_forever()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread: an atomic view of the registry between two requests."""
        async def go() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def close(self) -> None:
        async def stop() -> None:
            await self.agent.stop(deregister_timeout_s=0.2)
            await self.ctrl.stop()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.log_dir.cleanup()


BG: Background | None = None
LAST_VERSION = 0


def bg() -> Background:
    global BG
    if BG is None:
        BG = Background()
    return BG


def teardown_module() -> None:
    global BG
    if BG is not None:
        BG.close()
        BG = None


# ------------------------------------------------------------------------------------ HTTP
#: what follows a prefix route (the lifecycle routes ``/v1/instances/{id}/{action}``)
PREFIX_TAIL = "{id}/{action}"


def routes(router: Router) -> list[tuple[str, str]]:
    """(method, path) of every route of ``router`` (HEAD for each GET route); a prefix route
    as ``prefix + PREFIX_TAIL`` (:func:`concrete` fills it in)."""
    out = []
    for path, by_method in sorted(router._routes.items()):
        for m in sorted(by_method):
            out.append((m.decode(), path))
            if m == b"GET":
                out.append(("HEAD", path))
    for prefix, by_method in router._prefixes:
        assert prefix == "/v1/instances/", f"prefix route {prefix}: teach the fuzzer its tail"
        for m in sorted(by_method):
            out.append((m.decode(), prefix + PREFIX_TAIL))
    return out


def concrete(data: st.DataObject, path: str) -> str:
    """``path`` with a prefix route's tail drawn: an instance id nobody registered (so no
    engine is ever stopped), quoted or not, and an action or junk."""
    if PREFIX_TAIL not in path:
        return path
    iid = data.draw(st.sampled_from(["zz/none/0", "", "%2F", "nm%2Ffake%2F9", "a/b/c/d"])
                    | st.text(min_size=1, max_size=12).map(urllib.parse.quote), "id")
    action = data.draw(st.sampled_from(["drain", "stop", "start", "restart", "", "pause",
                                        "drain/x", "DRAIN"]) | st.text(max_size=8), "action")
    return path.replace(PREFIX_TAIL, f"{iid}/{urllib.parse.quote(action)}")


def controller_routes() -> list[tuple[str, str]]:
    return routes(bg().ctrl._http.handler)  # type: ignore[arg-type]


def agent_routes() -> list[tuple[str, str]]:
    assert bg().agent._http is not None
    return routes(bg().agent._http.handler)  # type: ignore[arg-type]


def request(port: int, method: str, target: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One exchange on a fresh connection; ``http.client`` raises on a malformed answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        hdrs = {"connection": "close", **(headers or {})}
        if body is not None:
            hdrs["content-length"] = str(len(body))
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.version == 11, resp.version
        assert resp.getheader("content-type"), "answer without a content type"
        if method != "HEAD" and resp.getheader("content-length") is not None:
            assert len(data) == int(resp.getheader("content-length") or 0)
        return resp.status, data
    finally:
        conn.close()


def check_answer(method: str, status: int, body: bytes, target: str = "") -> None:
    # 502: the lifecycle routes' answer when the node manager they forward to is unreachable
    # (a fuzzed registration names any management port)
    bad_gateway = status == 502 and target.startswith("/v1/instances/")
    assert 100 <= status < 500 or bad_gateway, (status, body[:300])
    if status >= 400 and method != "HEAD":
        doc = orjson.loads(body)
        assert set(doc) == {"error"}, doc
        err = doc["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == status and isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"].endswith("Error")


# ------------------------------------------------------------------------------ invariants
def snapshot() -> tuple[int, str, str]:
    """What a refused request must not change (the clock is still: ages do not move)."""
    reg = bg().ctrl.registry
    return reg.version, reg.table().model_dump_json(), json.dumps(reg.nodes(), sort_keys=True)


def registry_invariants() -> int:
    """The registry's invariants through its public API (run on the loop thread)."""
    reg = bg().ctrl.registry
    t = reg.table()
    assert t.version == reg.version
    ids = [i.id for i in t.instances]
    assert ids == sorted(set(ids)), "instance ids unique, table sorted by id"
    nodes = reg.nodes()
    owned = {str(n["node"]): list(n["instances"]) for n in nodes}  # type: ignore[call-overload]
    assert len(owned) == len(nodes)
    for name, insts in owned.items():
        assert reg.knows(name)
        assert len(set(insts)) == len(insts)
        for iid in insts:
            inst = reg.instance(iid)
            assert inst is not None, f"node {name!r} lists {iid!r}, which is not in the table"
            assert inst.node == name
    counts = reg.counts()
    assert sum(counts.values()) == len(t.instances)
    for inst in t.instances:
        assert inst.node in owned and inst.id in owned[inst.node], inst
        assert inst.state is not InstanceState.REMOVED
        assert reg.state(inst.id) is inst.state
        ranks = [e.dp_rank for e in inst.endpoints]
        assert len(set(ranks)) == len(ranks), f"{inst.id}: DP ranks {ranks} not unique"
        for e in inst.endpoints:
            assert 1 <= e.port <= 65535
    # what a coordinator reads (motor/coordinator/controller_poll.py) is what the registry holds
    wire = t.model_dump_json()
    assert InstanceTable.model_validate(orjson.loads(wire)) == t, "table changed on the wire"
    orjson.dumps({"version": reg.version, "nodes": nodes})
    return reg.version


def after_example(before: tuple[int, str, str] | None = None, status: int = 200) -> None:
    """Invariants, a refused request changed nothing, versions never go back, still serving."""
    global LAST_VERSION
    b = bg()
    if before is not None and 400 <= status < 500:
        assert b.call(snapshot) == before, f"a {status} answer changed the registry"
    v = b.call(registry_invariants)
    assert v >= LAST_VERSION, f"version went back from {LAST_VERSION} to {v}"
    LAST_VERSION = v


def controller_still_serves() -> None:
    """A valid registration, long poll and deregistration work (after any garbage)."""
    try:
        _controller_still_serves()
    except BaseException:
        bg().call(forget_all_nodes)
        raise


def _controller_still_serves() -> None:
    port = bg().ctrl.port or 0
    inst = {"id": "probe/sim/0", "model": "probe-model", "role": "union", "engine": "sim",
            "endpoints": [{"host": "127.0.0.1", "port": 18100}]}
    st_, body = request(port, "POST", "/v1/nodes/register",
                        orjson.dumps({"node": "probe-node", "instances": [inst]}))
    assert st_ == 200, body
    v = orjson.loads(body)["version"]
    st_, body = request(port, "GET", f"/v1/instances?after={v - 1}&timeout=1")
    assert st_ == 200
    table = InstanceTable.model_validate(orjson.loads(body))
    assert table.version >= v
    probe = [i for i in table.instances if i.id == "probe/sim/0"]
    assert len(probe) == 1 and probe[0].node == "probe-node" and probe[0].model == "probe-model"
    st_, body = request(port, "POST", "/v1/nodes/deregister", b'{"node": "probe-node"}')
    assert st_ == 200 and orjson.loads(body)["known"] is True
    after_example()


def agent_still_serves() -> None:
    port = bg().agent.mgmt_port or 0
    st_, body = request(port, "GET", "/health")
    assert (st_, orjson.loads(body)) == (200, {"status": "ok"})
    st_, body = request(port, "GET", "/v1/instances")
    assert st_ == 200 and orjson.loads(body)["node"] == "nm"
    bg().call(lambda: orjson.dumps(bg().agent.status()))


# ------------------------------------------------------------------------------ strategies
huge_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1,
                             int("9" * 400)])
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | huge_ints
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=12), c, max_size=5), max_leaves=12)


names = st.sampled_from(["n0", "n1", "n2", "n\u00e9\u4e2d", "n0 "]) | st.text(min_size=1, max_size=16)
ids = st.sampled_from(["a", "b", "c", "n0/sim/0", "n1/sim/0"]) | st.text(min_size=1, max_size=16)
hosts = st.sampled_from(["127.0.0.1", "h", "::1"]) | st.text(min_size=1, max_size=8)
texts = st.text(max_size=12)
counts = st.integers(0, 10**6)
floats = st.floats(allow_nan=False, allow_infinity=False)


def obj(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid JSON object: the required fields and some of the optional ones."""
    return st.fixed_dictionaries(required, optional=optional)


endpoint = obj({"host": hosts, "port": st.integers(1, 65535)}, {"dp_rank": st.integers(0, 3)})
kv_transfer = obj({"connector": st.sampled_from(["NixlConnector", "MooncakeLayerwiseConnector"])},
                  {"role": st.none() | texts, "engine_id": st.none() | ids,
                   "kv_port": st.none() | st.integers(1, 65535)})
instance_spec = obj(
    {"id": ids, "model": texts, "role": st.sampled_from(["union", "prefill", "decode"]),
     "engine": st.sampled_from(["sim", "vllm", "sglang"]),
     "endpoints": st.lists(endpoint, min_size=1, max_size=3, unique_by=lambda e: e.get("dp_rank", 0))},
    {"kv_events": st.none() | texts, "bootstrap_port": st.none() | st.integers(1, 65535),
     "healthy": st.booleans(), "dp_size": st.integers(1, 8), "tp_size": st.integers(1, 8),
     "kv_transfer": st.none() | kv_transfer, "metaserver": st.booleans()})
registration = obj({"node": names},
                   {"host": texts, "mgmt_port": st.none() | st.integers(1, 65535),
                    "instances": st.lists(instance_spec, min_size=1, max_size=3,
                                          unique_by=lambda i: i["id"])})
npu_chip = obj({"npu": counts, "chip": counts, "device": counts},
               {"name": texts, "power_w": st.none() | floats, "hbm_used_mb": st.none() | counts})
vi_status = obj({}, {"state": texts, "failures": counts, "last_aicore_pct": st.none() | floats})
engine_health = obj({"state": texts}, {"http_healthy": st.booleans(), "restarts": counts,
                                       "virtual_inference": st.none() | vi_status})
heartbeat = obj({"node": names},
                {"health": st.dictionaries(ids, st.booleans(), max_size=3),
                 "failed": st.lists(ids, max_size=3),
                 "reasons": st.dictionaries(ids, texts, max_size=3),
                 "engines": st.dictionaries(ids, engine_health, max_size=2),
                 "npu": st.lists(npu_chip, max_size=2)})
deregister = obj({"node": names}, {})

#: values of the right JSON type that are out of range somewhere: huge numbers, empty and long
#: strings, lone or odd unicode, NaN
edges = (huge_ints | st.sampled_from([0, -1, 65536, 257, 2**16 + 1, "", "\x00", "x" * 300,
                                      "\u202e\ufeff", "\U0001f600", 1.5, float("nan"),
                                      float("inf"), True, None, [], {}]))


def _slots(doc: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) of ``doc``, depth first."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((doc, k))
            _slots(v, out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((doc, i))
            _slots(v, out)
    return out


@st.composite
def mutated(draw: st.DrawFn, docs: st.SearchStrategy[Any], max_changes: int = 2) -> Any:
    """A valid document with one or a few changes: a field dropped, replaced by an
    out-of-range value or by junk of another type, or an unknown field added."""
    doc = json.loads(json.dumps(draw(docs)))
    for _ in range(draw(st.integers(1, max_changes))):
        slots = _slots(doc, [])
        if not slots:
            return draw(junk)
        parent, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["drop", "edge", "edge", "junk", "extra"]))
        if action == "drop" and isinstance(parent, dict):
            del parent[key]
        elif action == "extra" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(junk)
        else:
            parent[key] = draw(edges if action != "junk" else junk)
    return doc


def encode(v: Any) -> bytes:
    """JSON of ``v``; NaN / Infinity written as Python's json does (not JSON: must be a 400)."""
    return json.dumps(v, allow_nan=True).encode()


def bodies(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(valid.map(encode), mutated(valid).map(encode), mutated(valid).map(encode),
                     junk.map(encode),
                     st.binary(max_size=200),
                     st.sampled_from([b"", b"null", b"[]", b"{", b'{"node": "n0"', b"[" * 3000,
                                      b'{"node": "\\ud800"}', b'{"node": "n0", "node": 1}',
                                      b"\xef\xbb\xbf{}", b'{"node": "n0"}\x00']))


content_types = st.sampled_from([None, "application/json", "text/plain", "application/json; charset=latin-1",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/x-ndjson", "\u00e9".encode().decode("latin-1")])
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE",
                           "BREW", "get"])
query_values = (st.integers(-2**70, 2**70).map(str) | huge_ints.map(str)
                | st.sampled_from(["", "nan", "NaN", "inf", "-inf", "1e400", "0x10", "1_000", " 7 ",
                                   "\u0661\u0662", "9" * 5000, "-0", "0.0000001", "%00", "true"])
                | st.text(max_size=10))
query_keys = st.sampled_from(["after", "timeout", "version", "node", "x", "after[]", ""])


@st.composite
def query_strings(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(query_keys, query_values), max_size=4))
    q = urllib.parse.urlencode(pairs, quote_via=urllib.parse.quote)
    return draw(st.sampled_from(["", "?", "?" + q, "?" + q + "&", "?" + q.replace("=", "", 1),
                                 "?" + q + "#frag", "?&&=&"]))


def path_variants(path: str) -> st.SearchStrategy[str]:
    return st.sampled_from([path, path + "/", "/" + path, path.upper(), path + "%20", path + "/..",
                            path.replace("/", "//"), "http://h" + path, "http://h:1" + path,
                            path + ";x", path[:-1] or "/", path + "/extra"])


# ------------------------------------------------------------------------------ the tests
def draw_request(data: st.DataObject, routes: list[tuple[str, str]]
                 ) -> tuple[str, str, bytes | None, str | None]:
    """(method, target, body, content type) for one of ``routes``: its method or any, a
    variant of its path (a prefix route's tail drawn), any query string, any body."""
    method, path = data.draw(st.sampled_from(routes), "route")
    method = data.draw(st.just(method) | methods, "method")
    path = data.draw(path_variants(concrete(data, path)), "path")
    target = path + data.draw(query_strings(), "query")
    body = data.draw(st.none() | bodies(junk), "body")
    return method, target, body, data.draw(content_types, "ctype")


def fuzz_one(port: int, method: str, target: str, body: bytes | None, ctype: str | None,
             stateful: bool) -> int:
    before = bg().call(snapshot) if stateful else None
    headers = {"content-type": ctype} if ctype else {}
    try:
        status, data = request(port, method, target, body, headers)
        check_answer(method, status, data, target)
        event(f"{method} {target.split('?')[0][:30]} -> {status}")
        if stateful:
            after_example(before, status)
    except BaseException:
        # a registry left broken would fail every later example: hypothesis could not shrink
        # to the one that broke it
        bg().call(forget_all_nodes)
        raise
    return status


def forget_all_nodes() -> None:
    reg = bg().ctrl.registry
    for n in reg.nodes():
        reg.deregister(str(n["node"]))


POST_BODIES = {"/v1/nodes/register": registration, "/v1/nodes/heartbeat": heartbeat,
               "/v1/nodes/deregister": deregister}


def post_route_bodies() -> st.SearchStrategy[tuple[str, bytes]]:
    posts = [p for m, p in controller_routes() if m == "POST" and PREFIX_TAIL not in p]
    assert set(posts) == set(POST_BODIES), "a new POST route: give it a body strategy here"
    return st.sampled_from(sorted(posts)).flatmap(
        lambda p: st.tuples(st.just(p), bodies(POST_BODIES[p])))


def _reg(endpoints: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    """A registration of node ``r`` with one instance ``r/0`` (``fields`` set on it)."""
    inst = {"id": "r/0", "model": "m", "role": "union", "engine": "sim",
            "endpoints": endpoints or [{"host": "h", "port": 1}], **fields}
    return {"node": "r", "instances": [inst]}


#: one example per defect found (each was accepted and left a table that no coordinator could
#: read, or one whose endpoints collapse), with words its 400 message must contain now
BIG = 2**64
REGRESSIONS: list[tuple[str, Any, list[str]]] = [
    ("/v1/nodes/register", _reg([{"host": "h", "port": 1, "dp_rank": BIG}]),
     ["instances.0.endpoints.0.dp_rank", "less than 65536", f"got {BIG}"]),
    ("/v1/nodes/register", _reg(tp_size=10**30),
     ["instances.0.tp_size", "less than or equal to 65536", f"got {10**30}"]),
    ("/v1/nodes/register", _reg(dp_size=BIG), ["instances.0.dp_size", f"got {BIG}"]),
    ("/v1/nodes/register", _reg(bootstrap_port=BIG),
     ["instances.0.bootstrap_port", "less than or equal to 65535", f"got {BIG}"]),
    ("/v1/nodes/register", _reg(kv_transfer={"connector": "NixlConnector", "kv_port": BIG}),
     ["instances.0.kv_transfer.kv_port", "less than or equal to 65535", f"got {BIG}"]),
    ("/v1/nodes/register", {**_reg(), "mgmt_port": BIG}, ["mgmt_port", f"got {BIG}"]),
    ("/v1/nodes/register", _reg([{"host": "h", "port": 1}, {"host": "h", "port": 2}]),
     ["instances.0", "endpoints[1].dp_rank", "expected a DP rank not used by an earlier endpoint",
      "got 0 again"]),
    ("/v1/nodes/register", _reg([{"host": "", "port": 1}]),
     ["instances.0.endpoints.0.host", "at least 1 character", "got ''"]),
]


def _with_examples(fn: Callable[..., None]) -> Callable[..., None]:
    for path, body, _ in REGRESSIONS:
        fn = example((path, encode(body)), "application/json")(fn)
    return fn


@SETTINGS
@given(st.deferred(post_route_bodies), content_types)
@_with_examples
def test_controller_post_bodies(route_body: tuple[str, bytes], ctype: str | None) -> None:
    """Every POST route with random, malformed and valid-shaped-but-wrong JSON bodies."""
    path, body = route_body
    fuzz_one(bg().ctrl.port or 0, "POST", path, body, ctype, stateful=True)


@pytest.mark.parametrize(("path", "body", "words"), REGRESSIONS)
def test_regressions_answer_400_naming_the_field(path: str, body: Any, words: list[str]) -> None:
    """Each fixed defect: a 400 whose message names the field, what was expected and what
    came, and nothing changed."""
    before = bg().call(snapshot)
    st_, data = request(bg().ctrl.port or 0, "POST", path, encode(body))
    assert st_ == 400, data
    msg = orjson.loads(data)["error"]["message"]
    for w in words:
        assert w in msg, msg
    after_example(before, st_)
    controller_still_serves()


@SETTINGS
@given(st.data())
def test_controller_any_route_any_request(data: st.DataObject) -> None:
    """Every route (and variants of its path) with any method, query string and body."""
    fuzz_one(bg().ctrl.port or 0, *draw_request(data, controller_routes()), stateful=True)


@settings(SETTINGS, max_examples=100)
@given(st.lists(st.tuples(st.sampled_from(["after", "timeout"]), query_values), max_size=3),
       st.booleans())
def test_controller_long_poll_queries(pairs: list[tuple[str, str]], current: bool) -> None:
    """``GET /v1/instances`` with odd ``after`` / ``timeout`` values (``current``: ``after`` is
    the table's version, so the poll is held up to the capped timeout)."""
    if current:
        pairs = [("after", str(bg().call(lambda: bg().ctrl.registry.version)))] + pairs
    q = urllib.parse.urlencode(pairs, quote_via=urllib.parse.quote)
    status = fuzz_one(bg().ctrl.port or 0, "GET", "/v1/instances?" + q, None, None, stateful=True)
    assert status in (200, 400)


@settings(SETTINGS, max_examples=40)
@given(st.lists(st.one_of(*(st.one_of(b, mutated(b, 1)).map(lambda v, p=p: (p, encode(v)))
                            for p, b in POST_BODIES.items())),
                min_size=1, max_size=6))
def test_controller_sequences_then_valid_use(steps: list[tuple[str, bytes]]) -> None:
    """A run of valid-shaped requests (registrations, heartbeats, deregistrations of a few
    nodes), then a valid registration, poll and deregistration still work."""
    port = bg().ctrl.port or 0
    for path, body in steps:
        fuzz_one(port, "POST", path, body, "application/json", stateful=True)
    controller_still_serves()


@SETTINGS
@given(st.data())
def test_node_manager_any_route_any_request(data: st.DataObject) -> None:
    """The node manager's management API: every route, any method / path / query / body."""
    fuzz_one(bg().agent.mgmt_port or 0, *draw_request(data, agent_routes()), stateful=False)
    bg().call(lambda: orjson.dumps(bg().agent.status()))


def test_both_still_serve_after_the_fuzzing() -> None:
    controller_still_serves()
    agent_still_serves()
    assert bg().ctrl._http.inflight == 0

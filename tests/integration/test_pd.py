"""PD modes end to end: an in-process coordinator in front of 2 prefill + 2 decode
simulators (motor sim roles), for each of the three handshakes."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import orjson
import pytest

from motor.config.schema import Role
from motor.sim.engine import EngineConfig
from motor.sim.options import PdOptions, SimOptions
from motor.sim.server import SimServer
from tests.support.gateway import Gateway, http, run_async

MODES = ["pd_prefill_first", "pd_decode_first", "pd_bootstrap"]


class Cluster:
    def __init__(self, mode: str, **cfg: Any) -> None:
        self.mode = mode
        self.cfg = cfg
        self.sims: list[SimServer] = []
        self.bodies: list[tuple[str, str, dict[str, Any]]] = []   # (role, path, body)
        self.auth: list[bytes | None] = []    # Authorization of every engine request

    async def start(self) -> Cluster:
        for role in ("prefill", "prefill", "decode", "decode"):
            s = SimServer(SimOptions(port=0, role=role, model="m",
                                     engine=EngineConfig(time_scale=0.05),
                                     pd=PdOptions(bootstrap_timeout_s=10.0)))
            orig = s._handle

            async def handle(req: Any, resp: Any, orig: Any = orig, role: str = role) -> None:
                if req.path.startswith("/v1/") and req.method == b"POST":
                    self.bodies.append((role, req.path, orjson.loads(req.body)))
                    self.auth.append(req.header(b"authorization"))
                await orig(req, resp)
            s._handle = handle  # type: ignore[method-assign]
            await s.start()
            self.sims.append(s)
        backends = [(Role.PREFILL if s.opts.role == "prefill" else Role.DECODE, "127.0.0.1", s.port)
                    for s in self.sims]
        self.gw = await Gateway(backends, mode=self.mode, **self.cfg).start()
        if self.mode == "pd_decode_first":
            self.gw.coord.path.metaserver_url = f"http://127.0.0.1:{self.gw.port}/v1/metaserver"
        return self

    def log(self, role: str) -> list[tuple[str, dict[str, Any]]]:
        return [(p, b) for r, p, b in self.bodies if r == role]

    def sim(self, role: str, i: int = 0) -> SimServer:
        return [s for s in self.sims if s.opts.role == role][i]

    async def stop(self) -> None:
        await self.gw.stop()
        for s in self.sims:
            await s.stop(0.2)


def _events(body: bytes) -> list[Any]:
    out = []
    for ev in body.split(b"\n\n"):
        if ev.startswith(b"data: "):
            d = ev[6:]
            out.append("[DONE]" if d == b"[DONE]" else orjson.loads(d))
    return out


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_modes_chat_and_completions_stream_and_not(mode: str) -> None:
    c = await Cluster(mode).start()
    try:
        for chat in (True, False):
            for stream in (False, True):
                path = "/v1/chat/completions" if chat else "/v1/completions"
                req: dict[str, Any] = {"model": "m", "max_tokens": 6, "n": 2, "stream": stream,
                                       "ignore_eos": True}
                if chat:
                    req["messages"] = [{"role": "user", "content": "hello " * 20}]
                else:
                    req["prompt"] = "hello " * 20
                if stream:
                    req["stream_options"] = {"include_usage": True}
                n_p, n_d = len(c.log("prefill")), len(c.log("decode"))
                st, h, body = await http(c.gw.port, "POST", path, orjson.dumps(req),
                                         {"x-request-id": f"{mode}-{chat}-{stream}"})
                assert st == 200, body
                assert h["x-request-id"] == f"{mode}-{chat}-{stream}"
                if stream:
                    assert h["content-type"].startswith("text/event-stream")
                    evs = _events(body)
                    assert evs[-1] == "[DONE]"
                    usage = [e["usage"] for e in evs[:-1] if e.get("usage")]
                    assert len(usage) == 1
                    idx = {ch["index"] for e in evs[:-1] for ch in e["choices"]}
                    assert idx == {0, 1}
                else:
                    obj = orjson.loads(body)
                    usage = [obj["usage"]]
                    assert len(obj["choices"]) == 2
                assert usage[0]["completion_tokens"] == 12
                assert usage[0]["prompt_tokens"] > 20
                p_new, d_new = c.log("prefill")[n_p:], c.log("decode")[n_d:]
                assert len(d_new) == 1 and len(p_new) == 1
                pb, db = p_new[0][1], d_new[0][1]
                if mode == "pd_bootstrap":
                    assert pb == db   # the same body to both, at once
                    rooms = db["bootstrap_room"]
                    assert isinstance(rooms, list) and len(set(rooms)) == 2
                    assert all(0 <= r < 2 ** 63 for r in rooms)
                    assert db["bootstrap_port"] == [c.sim("prefill", 0).pd.bootstrap_port] * 2 or \
                        db["bootstrap_port"] == [c.sim("prefill", 1).pd.bootstrap_port] * 2
                else:
                    assert pb["max_tokens"] == 1 and pb["stream"] is False
                    assert "stream_options" not in pb
                    assert db["max_tokens"] == 6 and db["stream"] is stream
                    if mode == "pd_prefill_first":
                        assert pb["kv_transfer_params"]["do_remote_decode"] is True
                        assert db["kv_transfer_params"]["do_remote_prefill"] is True
                        assert db["kv_transfer_params"]["remote_request_id"]
                    else:
                        assert db["kv_transfer_params"]["metaserver"].endswith("/v1/metaserver")
                        assert pb["kv_transfer_params"]["do_remote_decode"] is True
                        assert pb["min_tokens"] == 1
        # the decode side really got its KV from the prefill side
        d_stats = [s.pd.stats for s in c.sims if s.opts.role == "decode"]
        if mode == "pd_prefill_first":
            assert sum(s["pulled"] for s in d_stats) == 4
        elif mode == "pd_decode_first":
            assert sum(s["callbacks"] for s in d_stats) == 4
        else:
            assert sum(s["rooms_taken"] for s in c.sims[:2] for s in [s.pd.stats]) == 8
        # ... and did not compute the prompt again: its whole blocks count as loaded
        # (vLLM's external computed tokens), none on the prefill side
        loaded = {r: sum(s.engine.stats()["kv_loaded_tokens"] for s in c.sims
                         if s.opts.role == r) for r in ("prefill", "decode")}
        assert loaded["prefill"] == 0 and loaded["decode"] >= 4 * 2 * 16, loaded
        assert c.gw.inflight() == 0
    finally:
        await c.stop()


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_disconnect_mid_stream_closes_both_legs(mode: str) -> None:
    c = await Cluster(mode).start()
    try:
        req = {"model": "m", "prompt": "count " * 10, "max_tokens": 2000, "stream": True,
               "ignore_eos": True}
        for s in c.sims:
            s.engine.slow_factor = 20.0   # keep the decode going
        reader, writer = await asyncio.open_connection("127.0.0.1", c.gw.port)
        raw = orjson.dumps(req)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        await writer.drain()
        got = b""
        while got.count(b"data: ") < 3:
            got += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        # the decode leg sees its connection closed; a bootstrap P still running too
        for _ in range(100):
            if sum(s.num_disconnects for s in c.sims if s.opts.role == "decode") >= 1 \
                    and c.gw.inflight() == 0:
                break
            await asyncio.sleep(0.01)
        assert sum(s.num_disconnects for s in c.sims if s.opts.role == "decode") == 1
        assert c.gw.inflight() == 0
    finally:
        await c.stop()


FAULTS = [("prefill", {"mode": "error", "status": 500}, 502),
          ("prefill", {"mode": "drop_after", "tokens": 0}, 502),
          ("prefill", {"mode": "hang"}, 504),
          ("decode", {"mode": "error", "status": 500}, 500),
          ("decode", {"mode": "drop_after", "tokens": 3}, 502)]


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_leg_failures_end_with_one_terminal_answer(mode: str) -> None:
    c = await Cluster(mode, timeouts={"first_token_s": 1.0, "idle_s": 2.0},
                      retries={"max_attempts": 2, "backoff_s": 0.0}).start()
    try:
        for role, fault, want in FAULTS:
            if mode == "pd_bootstrap" and role == "prefill" and fault["mode"] == "drop_after":
                continue  # the sim's bootstrap P answers after D took the KV: no reset window
            for s in c.sims:
                s.faults.set({"mode": "none"})
                s._apply_global_fault()
            for i in range(2):
                c.sim(role, i).faults.set(fault)
                c.sim(role, i)._apply_global_fault()
            for stream in (False, True):
                req = {"model": "m", "prompt": "hi " * 10, "max_tokens": 8, "stream": stream,
                       "ignore_eos": True}
                loop = asyncio.get_running_loop()
                t = loop.time()
                st, _, body = await http(c.gw.port, "POST", "/v1/completions", orjson.dumps(req),
                                         timeout=20)
                assert loop.time() - t < 15   # bounded by the configured timeouts
                if stream and st == 200 and role == "decode" and fault["mode"] == "drop_after":
                    # a decode broken mid-stream is continued as a new PD request (each
                    # decode drops after 3 tokens: 3 + 3 + 2 over three legs)
                    evs = _events(body)
                    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1, body
                    assert not any("error" in e for e in evs[:-1]), body
                    assert [e["choices"][0]["finish_reason"] for e in evs[:-1]
                            if e["choices"][0]["finish_reason"]] == ["length"]
                elif stream and st == 200:
                    evs = _events(body)
                    assert evs[-1] == "[DONE]" and "error" in evs[-2], (role, fault, body)
                    assert evs[-2]["error"]["code"] in (500, 502, 504)
                else:
                    assert st == want or (st >= 500 and want >= 500), (role, fault, st, body)
                    assert "error" in orjson.loads(body)
                for _ in range(100):
                    if c.gw.inflight() == 0:
                        break
                    await asyncio.sleep(0.01)
                assert c.gw.inflight() == 0, (role, fault, stream)
        for s in c.sims:
            s.faults.set({"mode": "none"})
            s._apply_global_fault()
    finally:
        await c.stop()


@run_async
async def test_pd_falls_back_to_union_or_503() -> None:
    s = SimServer(SimOptions(port=0, role="union", model="m", engine=EngineConfig(time_scale=0.05)))
    p = SimServer(SimOptions(port=0, role="prefill", model="m", engine=EngineConfig(time_scale=0.05)))
    await s.start()
    await p.start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", p.port), (Role.UNION, "127.0.0.1", s.port)],
                       mode="pd_prefill_first").start()
    gw2 = await Gateway([(Role.PREFILL, "127.0.0.1", p.port)], mode="pd_prefill_first").start()
    try:
        req = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 3})
        st, _, body = await http(gw.port, "POST", "/v1/completions", req)
        assert st == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 3
        st, _, body = await http(gw2.port, "POST", "/v1/completions", req)
        assert st == 503 and "no decode instance" in orjson.loads(body)["error"]["message"]
    finally:
        await gw.stop()
        await gw2.stop()
        await s.stop(0.2)
        await p.stop(0.2)


@run_async
async def test_pd_prefill_first_stream_with_prompt_logprobs_is_refused_like_vllm() -> None:
    # vLLM cannot stream prompt_logprobs (400 from its protocol check); D never computes the
    # prompt, so P's would be lost: refused before any leg, with vLLM's own error
    c = await Cluster("pd_prefill_first").start()
    try:
        for path, extra in (("/v1/completions", {"prompt": "hello " * 10}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hello"}]})):
            for plp in (1, -1):
                req = {"model": "m", "max_tokens": 3, "stream": True, "prompt_logprobs": plp,
                       **extra}
                st, _, body = await http(c.gw.port, "POST", path, orjson.dumps(req))
                assert st == 400, body
                err = orjson.loads(body)["error"]
                assert err["param"] == "prompt_logprobs" and "stream=True" in err["message"]
        assert c.bodies == []
        assert c.gw.inflight() == 0
        # prompt_logprobs 0 is allowed in a stream (as vLLM does)
        req = {"model": "m", "max_tokens": 3, "stream": True, "prompt_logprobs": 0,
               "prompt": "hello " * 10}
        st, _, body = await http(c.gw.port, "POST", "/v1/completions", orjson.dumps(req))
        assert st == 200 and _events(body)[-1] == "[DONE]"
    finally:
        await c.stop()


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_gateway_key_checked_and_worker_key_sent_to_both_legs(mode: str) -> None:
    c = await Cluster(mode, api_keys=["sk-gw"], worker_api_key="sk-worker").start()
    try:
        req = orjson.dumps({"model": "m", "prompt": "hello " * 10, "max_tokens": 3,
                            "stream": True})
        st, _, body = await http(c.gw.port, "POST", "/v1/completions", req)
        assert st == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
        assert c.bodies == []
        st, _, body = await http(c.gw.port, "POST", "/v1/completions", req,
                                 {"authorization": "Bearer sk-gw"})
        assert st == 200 and _events(body)[-1] == "[DONE]"
        assert len(c.auth) == 2 and set(c.auth) == {b"Bearer sk-worker"}
        assert c.gw.inflight() == 0
    finally:
        await c.stop()


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_request_id_empty_is_made_up_and_too_long_is_400(mode: str) -> None:
    c = await Cluster(mode).start()
    try:
        body = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 2})
        st, h, _ = await http(c.gw.port, "POST", "/v1/completions", body, {"x-request-id": ""})
        assert st == 200 and len(h["x-request-id"]) >= 16
        st, _, out = await http(c.gw.port, "POST", "/v1/completions", body,
                                {"x-request-id": "x" * 300})
        assert st == 400 and "x-request-id" in orjson.loads(out)["error"]["message"]
        assert c.gw.inflight() == 0
    finally:
        await c.stop()


@run_async
async def test_pd_prefill_retry_reuses_the_routing_key() -> None:
    """kv_affinity as prefill policy tokenizes a request once, also when its prefill leg is
    retried on another instance (503 from both prefills once)."""
    c = await Cluster("pd_prefill_first", pd={"prefill_policy": "kv_affinity"},
                      retries={"max_attempts": 3, "backoff_s": 0.0}).start()
    try:
        policy = c.gw.coord.path.prefill_policy
        calls = []
        orig = policy.prepare

        def counting(info: Any, route: str, body: dict[str, Any],
                     off_loop: bool = False) -> Any:
            calls.append(route)
            return orig(info, route, body, off_loop)
        policy.prepare = counting  # type: ignore[method-assign]
        for i in range(2):
            c.sim("prefill", i).faults.set({"mode": "error", "status": 503, "count": 1})
        req = {"model": "m", "prompt": "retry me " * 8, "max_tokens": 4}
        st, _, body = await http(c.gw.port, "POST", "/v1/completions", orjson.dumps(req),
                                 timeout=20)
        assert st == 200, body
        assert len([b for r, _, b in c.bodies if r == "prefill"]) == 3   # 503, 503, answer
        assert calls == ["completions"]
    finally:
        await c.stop()


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_a_long_prompt_is_tokenized_off_the_event_loop(mode: str, tmp_path: Any) -> None:
    """kv_affinity as prefill policy with a tokenizer directory: a chat whose new text is
    longer than the tokenizers' ``off_loop_min_chars`` is encoded in their pool, as the
    union path does, not on the event loop that every other request waits on."""
    from motor.sim.tokenizer import write_model_dir
    tokdir = str(write_model_dir(tmp_path))
    c = await Cluster(mode, pd={"prefill_policy": "kv_affinity"},
                      kv={"tokenizers": {"*": tokdir}}).start()
    try:
        toks = c.gw.coord.path.prefill_policy.router.tokenizers
        toks.off_loop_min_chars = 1000      # (4096 by default: past the sims' context)
        tok = toks.get("m")
        threads: list[str] = []
        orig = tok.encode_pieces

        def recording(pieces: list[str]) -> list[list[int]]:
            threads.append(threading.current_thread().name)
            return orig(pieces)
        tok.encode_pieces = recording  # type: ignore[method-assign]
        text = "lorem ipsum dolor " * 100
        req = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        st, _, body = await http(c.gw.port, "POST", "/v1/chat/completions", orjson.dumps(req),
                                 timeout=30)
        assert st == 200, body
        assert threads and all(t.startswith("motor-tokenize") for t in threads), threads
        assert threading.current_thread().name not in threads
        assert c.log("prefill")                 # the legs went out as usual
    finally:
        await c.stop()


@run_async
async def test_decode_pulls_only_the_blocks_past_its_own_prefix_hit() -> None:
    # the sim's decode role reads from P only what its prefix cache lacks, as vLLM's
    # NixlConnector does; the second time the prompt's whole blocks are cached on D
    sims = [SimServer(SimOptions(port=0, role=role, model="m",
                                 engine=EngineConfig(time_scale=0.05)))
            for role in ("prefill", "decode")]
    for s in sims:
        await s.start()
    p, d = sims
    try:
        prompt = "hello " * 100
        pulled = []
        for _ in range(2):
            st, _, pb = await http(p.port, "POST", "/v1/completions", orjson.dumps(
                {"model": "m", "prompt": prompt, "max_tokens": 1,
                 "kv_transfer_params": {"do_remote_decode": True}}))
            assert st == 200, pb
            ktp = orjson.loads(pb)["kv_transfer_params"]
            before = d.pd.stats["pulled_blocks"]
            st, _, db = await http(d.port, "POST", "/v1/completions", orjson.dumps(
                {"model": "m", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": ktp}))
            assert st == 200, db
            pulled.append(d.pd.stats["pulled_blocks"] - before)
        # the second time: at most the partial last block (not a whole block: never cached)
        assert pulled[0] > 4 and pulled[1] <= 1, pulled
        assert d.pd.stats["pulled"] == 2
    finally:
        for s in sims:
            await s.stop(0.2)

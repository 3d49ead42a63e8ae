"""Chaos acceptance of issue 7: 64 concurrent streams over 4 `motor sim` processes, two of them
killed with SIGKILL mid-stream. Every request must complete with exactly ``max_tokens``
tokens, the same text as a fault-free run of the same seeds (no token lost or duplicated),
a correct usage, and the load counters must be back to 0.

The sims run with ``--context-keyed-text`` (each token depends on the seed and the whole
context, like greedy decoding), so a continuation on another instance produces the tokens
the killed one would have produced. The coordinator runs in this process (its load counters
are read directly); the sims are real processes, all stopped at the end.
"""
from __future__ import annotations

import asyncio
import os
import signal

import orjson
import pytest

from motor.config.schema import Role
from motor.coordinator import metrics
from tests.cases.harness import stream
from tests.support.gateway import Gateway, run_async
from tests.support.procs import free_ports, pids_matching, spawn, stop, wait_http

N_REQUESTS = 64
N_SIMS = 4
MAX_TOKENS = 64


def body(i: int, usage: bool = True) -> bytes:
    """Request ``i``; without ``usage`` (no ``stream_options``) the coordinator sets its
    failover up from the scan of the bytes and parses the body only for a continuation."""
    req = {"model": "motor-sim", "stream": True, "max_tokens": MAX_TOKENS, "seed": i}
    if usage:
        req["stream_options"] = {"include_usage": True}
    if i % 2:
        req["messages"] = [{"role": "user", "content": f"story number {i}"}]
    else:
        req["prompt"] = f"story number {i}"
    return orjson.dumps(req)


def with_usage(i: int) -> bool:
    return (i // 4) % 2 == 0


def path(i: int) -> str:
    return "/v1/chat/completions" if i % 2 else "/v1/completions"


def parse(i: int, payloads: list[bytes]) -> tuple[str, dict, int]:
    """(text, usage, number of [DONE]); fails on an error event or visible token ids."""
    text, usage, done = "", {}, 0
    for p in payloads:
        if p == b"[DONE]":
            done += 1
            continue
        o = orjson.loads(p)
        assert "error" not in o, (i, o)
        if o.get("usage"):
            usage = o["usage"]
        for c in o.get("choices") or []:
            assert "token_ids" not in c and "prompt_token_ids" not in o
            text += c["delta"].get("content") or "" if "delta" in c else c["text"]
    return text, usage, done


@pytest.fixture
def sims(tmp_path):
    ports = free_ports(N_SIMS)
    procs = [spawn(["sim", "--port", str(p), "--context-keyed-text", "--time-scale", "8",
                    "--model-dir", str(tmp_path / "tok")], str(tmp_path / f"sim{p}.log"))
             for p in ports]
    try:
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", 30)
        yield ports, procs
    finally:
        for pr in procs:
            stop(pr, 5)
        for p in ports:
            assert pids_matching("motor", "sim", "--port", str(p)) == []


async def run_all(port: int, on_event=None) -> list[tuple[str, dict, int]]:
    """Every request, half of each route's without a usage chunk (``i // 4`` odd: round
    robin gives each sim some of both, killed or not)."""
    res = await asyncio.gather(*(stream(port, path(i), body(i, with_usage(i)), on_event=on_event,
                                        timeout_s=60)
                                 for i in range(N_REQUESTS)))
    out = []
    for i, (st, _, payloads, _) in enumerate(res):
        assert st == 200
        out.append(parse(i, payloads))
    return out


@run_async
async def test_kill_two_of_four_sims_mid_stream(sims):
    ports, procs = sims
    gw = await Gateway([(Role.UNION, "127.0.0.1", p) for p in ports],
                       breaker={"open_s": 5.0}).start()
    try:
        reference = await run_all(gw.port)                    # fault-free, same seeds
        for i, (text, usage, done) in enumerate(reference):
            assert len(text) == MAX_TOKENS and done == 1
            assert usage["completion_tokens"] == MAX_TOKENS if with_usage(i) else usage == {}
        assert gw.inflight() == 0

        failovers = sum(metrics.FAILOVERS.labels(r)._value.get() for r in ("broken", "restart"))
        seen = [0]
        killed = asyncio.Event()

        def on_event(p: bytes) -> None:
            seen[0] += 1
            # every stream is well under way: kill two sims that have streams in flight
            if seen[0] == N_REQUESTS * 8 and not killed.is_set():
                killed.set()
                for pr in procs[:2]:
                    os.killpg(pr.pid, signal.SIGKILL)

        chaos = await run_all(gw.port, on_event)
        assert killed.is_set()
        assert all(pr.poll() is not None for pr in procs[:2])
        after = sum(metrics.FAILOVERS.labels(r)._value.get() for r in ("broken", "restart"))
        assert after - failovers >= 2                          # streams really moved
        for i, (got, ref) in enumerate(zip(chaos, reference)):
            assert got[0] == ref[0], f"request {i}: text differs from the fault-free run"
            assert got[1] == ref[1], f"request {i}: usage {got[1]} != {ref[1]}"
            assert got[2] == 1
        assert gw.inflight() == 0
        assert all(e.inflight == 0 and e.inflight_tokens == 0 for e in gw.table.endpoints.values())
    finally:
        await gw.stop()


# -- PD modes: a decode instance killed mid-stream ---------------------------------------
PD_MODES = ["pd_prefill_first", "pd_decode_first", "pd_bootstrap"]
PD_REQUESTS = 16


@pytest.fixture
def pd_sims(tmp_path):
    """2 prefill + 2 decode `motor sim` processes (context-keyed text)."""
    roles = ["prefill", "prefill", "decode", "decode"]
    ports = free_ports(len(roles))
    procs = [spawn(["sim", "--port", str(p), "--role", r, "--context-keyed-text",
                    "--time-scale", "8", "--bootstrap-timeout-s", "10",
                    "--model-dir", str(tmp_path / "tok")], str(tmp_path / f"sim{p}.log"))
             for p, r in zip(ports, roles)]
    try:
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", 30)
        yield list(zip(roles, ports)), procs
    finally:
        for pr in procs:
            stop(pr, 5)
        for p in ports:
            assert pids_matching("motor", "sim", "--port", str(p)) == []


async def run_pd(port: int, on_event=None) -> list[tuple[str, dict, int]]:
    res = await asyncio.gather(*(stream(port, path(i), body(i), on_event=on_event, timeout_s=60)
                                 for i in range(PD_REQUESTS)))
    out = []
    for i, (st, _, payloads, _) in enumerate(res):
        assert st == 200
        out.append(parse(i, payloads))
    return out


def _tokens(usage: dict) -> tuple:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


@pytest.mark.parametrize("mode", PD_MODES)
@run_async
async def test_pd_decode_killed_mid_stream_is_continued(pd_sims, mode):
    backends, procs = pd_sims
    gw = await Gateway([(Role.PREFILL if r == "prefill" else Role.DECODE, "127.0.0.1", p)
                        for r, p in backends], mode=mode, breaker={"open_s": 5.0}).start()
    if mode == "pd_decode_first":
        gw.coord.path.metaserver_url = f"http://127.0.0.1:{gw.port}/v1/metaserver"
    try:
        reference = await run_pd(gw.port)                     # fault-free, same seeds
        for text, usage, done in reference:
            assert len(text) == MAX_TOKENS and done == 1
            assert usage["completion_tokens"] == MAX_TOKENS
        assert gw.inflight() == 0

        failovers = sum(metrics.FAILOVERS.labels(r)._value.get()
                        for r in ("broken", "restart", "engine_error"))
        seen = [0]
        killed = asyncio.Event()

        def on_event(p: bytes) -> None:
            seen[0] += 1
            if seen[0] == PD_REQUESTS * 8 and not killed.is_set():
                killed.set()
                os.killpg(procs[2].pid, signal.SIGKILL)      # one of the two decodes

        chaos = await run_pd(gw.port, on_event)
        assert killed.is_set() and procs[2].poll() is not None
        after = sum(metrics.FAILOVERS.labels(r)._value.get()
                    for r in ("broken", "restart", "engine_error"))
        assert after - failovers >= 1                           # streams really moved
        for i, (got, ref) in enumerate(zip(chaos, reference)):
            assert got[0] == ref[0], f"request {i}: text differs from the fault-free run"
            assert _tokens(got[1]) == _tokens(ref[1]), f"request {i}: {got[1]} != {ref[1]}"
            assert got[2] == 1
        assert gw.inflight() == 0
        assert all(e.inflight == 0 and e.inflight_tokens == 0 for e in gw.table.endpoints.values())
    finally:
        await gw.stop()

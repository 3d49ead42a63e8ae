"""PD legs under per-instance caps, and the joint (prefill, decode) choice end to end: an
in-process coordinator in front of 2 prefill + 2 decode ``motor sim`` instances with
``--max-num-seqs N`` and ``admission.max_inflight_per_instance: N``, offered 4x their
capacity at once, in each PD handshake, with the sequential and the joint choice."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from motor.coordinator import metrics
from motor.sim.engine import EngineConfig
from motor.sim.server import SimServer
from tests.support.gateway import Gateway, http, run_async
from tests.support.pd_sims import pd_cluster, stop_pd

N = 2
MODES = ["pd_prefill_first", "pd_decode_first", "pd_bootstrap"]


async def cluster(mode: str, hook: Any = None, **cfg: Any
                  ) -> tuple[Gateway, list[SimServer], list[tuple]]:
    """``hook(sim)``: called as each request reaches a sim, before it is served."""
    return await pd_cluster(mode, EngineConfig(time_scale=1.0, max_num_seqs=N), hook, **cfg)


stop = stop_pd


@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_pd_legs_never_exceed_the_instance_cap(mode: str, joint: bool) -> None:
    gw, sims, _ = await cluster(
        mode, admission={"max_inflight_per_instance": N, "queue_timeout_s": 0.3},
        pd={"joint": {"enabled": joint}})
    try:
        async def one(i: int) -> tuple[int, dict[str, str], bytes]:
            body = {"model": "m", "prompt": f"request {i} " + "word " * (8 + 40 * (i % 3)),
                    "max_tokens": 48, "ignore_eos": True, "stream": i % 2 == 1}
            return await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                              {"content-type": "application/json"}, timeout=60.0)

        answers = await asyncio.gather(*(one(i) for i in range(4 * 4 * N)))
        statuses = sorted(a[0] for a in answers)
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 2 * N, statuses
        for status, hdrs, body in answers:
            if status == 503:
                assert int(hdrs["retry-after"]) >= 1
                assert orjson.loads(body)["error"]["code"] == 503
            else:
                assert body  # one terminal answer: a whole body or a stream to [DONE]
                if hdrs.get("content-type", "").startswith("text/event-stream"):
                    assert body.rstrip().endswith(b"data: [DONE]")
        for s in sims:
            assert s.engine is not None
            assert s.engine.max_held <= N, (s.opts.role, s.engine.max_held)
        assert gw.inflight() == 0
    finally:
        await stop(gw, sims)


def _route(mode: str, decision: str, reason: str) -> float:
    return metrics.PD_ROUTE.labels(mode, decision, reason)._value.get()


@pytest.mark.parametrize("mode", ["pd_prefill_first", "pd_decode_first"])
@run_async
async def test_joint_choice_serves_a_short_prompt_on_an_idle_decode_instance_alone(
        mode: str) -> None:
    gw, sims, seen = await cluster(mode, pd={"joint": {"enabled": True}})
    before = _route(mode, "local", "short_prompt")
    try:
        for stream in (False, True):
            body = {"model": "m", "prompt": "hello there", "max_tokens": 4,
                    "ignore_eos": True, "stream": stream}
            st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                                    {"content-type": "application/json"})
            assert st == 200, out
        assert [r for r, _ in seen] == ["decode", "decode"]
        assert all("kv_transfer_params" not in b for _, b in seen)
        # the streamed local leg's first token fed the hand-off's learning
        assert gw.coord.path.joint.handoff_observations == (0, 1)
        assert _route(mode, "local", "short_prompt") == before + 2
    finally:
        await stop(gw, sims)


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_joint_choice_without_local_prefill_runs_both_legs(mode: str) -> None:
    gw, sims, seen = await cluster(mode, pd={"joint": {"enabled": True,
                                                       "local_prefill": False}})
    try:
        body = {"model": "m", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
        st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                                {"content-type": "application/json"})
        assert st == 200, out
        assert sorted(r for r, _ in seen) == ["decode", "prefill"]
    finally:
        await stop(gw, sims)


@run_async
async def test_bootstrap_never_serves_a_decode_instance_alone() -> None:
    gw, sims, seen = await cluster("pd_bootstrap", pd={"joint": {"enabled": True}})
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                                {"content-type": "application/json"})
        assert st == 200, out
        assert sorted(r for r, _ in seen) == ["decode", "prefill"]
    finally:
        await stop(gw, sims)


@run_async
async def test_prefill_first_chooses_the_decode_instance_again_after_the_prefill() -> None:
    """The decode instance planned with the pair got busy while the prefill ran: the decode
    leg goes to the other one (the joint cost on the load of that moment), and the prefill
    leg counted only the tokens its instance computes as in-flight prefill."""
    plans: list[Any] = []
    busy: list[Any] = []
    p_work: list[int] = []
    d_ports: list[int] = []

    def hook(s: SimServer) -> None:
        if s.opts.role == "prefill":
            d = plans[-1].d
            p_work.append(plans[-1].p.inflight_prefill_tokens)
            for _ in range(32):     # 32 sequences start decoding on the planned D
                d.acquire(100, 0, 64)
            busy.append(d)
        else:
            d_ports.append(s.port)

    gw, sims, _ = await cluster("pd_prefill_first", hook,
                                pd={"joint": {"enabled": True, "local_prefill": False}})
    joint = gw.coord.path.joint
    assert joint is not None
    choose = joint.choose

    def spy(info: Any, ps: Any, ds: Any, local: bool, mode: str = "",
            reason: Any = None) -> Any:
        ch = choose(info, ps, ds, local, mode, reason)
        if "decode leg" not in mode:    # the plan (decode_for names the decode leg)
            plans.append(ch)
        return ch
    joint.choose = spy  # type: ignore[method-assign]
    try:
        body = {"model": "m", "prompt": "hello there " * 8, "max_tokens": 8,
                "ignore_eos": True}
        st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                                {"content-type": "application/json"})
        assert st == 200, out
        assert len(plans) == 1 and len(busy) == 1 and len(d_ports) == 1
        assert d_ports[0] != busy[0].port
        assert p_work == [plans[0].p_uncached]
    finally:
        for d in busy:
            for _ in range(32):
                d.release(100, 0, 64)
        await stop(gw, sims)

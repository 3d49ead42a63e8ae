"""What the PD legs count and say, end to end (an in-process coordinator in front of 2
prefill + 2 decode ``motor sim`` instances): the in-flight prefill tokens of a prefill leg
chosen one policy after the other, the debug line of a decode instance chosen again after
the prefill, and the outcome a client error counts as."""
from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from motor.config.schema import Role
from motor.coordinator import metrics
from motor.sim.engine import EngineConfig
from motor.sim.server import SimServer
from tests.support.gateway import Gateway, http, run_async
from tests.support.pd_sims import pd_cluster, stop_pd

MODES = ["pd_prefill_first", "pd_decode_first", "pd_bootstrap"]


async def cluster(mode: str, hook: Any = None, max_model_len: int = 4096, **cfg: Any
                  ) -> tuple[Gateway, list[SimServer]]:
    """``hook(sim)``: called as each request reaches a sim, before it is served."""
    gw, sims, _ = await pd_cluster(mode, EngineConfig(time_scale=1.0, max_model_len=max_model_len),
                                   hook, **cfg)
    return gw, sims


stop = stop_pd


async def post(gw: Gateway, body: dict[str, Any]) -> tuple[int, bytes]:
    st, _, out = await http(gw.port, "POST", "/v1/completions", orjson.dumps(body),
                            {"content-type": "application/json"}, timeout=30.0)
    return st, out


def _outcome(mode: str, outcome: str) -> float:
    return metrics.PD_REQUESTS.labels(mode, outcome)._value.get()


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_a_sequential_prefill_leg_counts_only_the_uncached_prompt(mode: str) -> None:
    """pd.joint off, kv_affinity picks P: the second request of the same prompt goes to the
    P that holds its blocks, and P's in-flight prefill counts only the tokens past them."""
    seen: list[tuple[int, int]] = []     # (port, P's in-flight prefill tokens) per P request

    def hook(s: SimServer) -> None:
        if s.opts.role == "prefill":
            ep = next(e for e in gw.table.endpoints.values() if e.port == s.port)
            seen.append((s.port, ep.inflight_prefill_tokens))

    gw, sims = await cluster(mode, hook, policy="kv_affinity")
    policy = gw.coord.path.prefill_policy
    assert policy.name == "kv_affinity"
    try:
        body = {"model": "m", "prompt": "the same long prompt " * 60, "max_tokens": 2,
                "ignore_eos": True}
        for _ in range(2):
            st, out = await post(gw, body)
            assert st == 200, out
        assert len(seen) == 2 and seen[0][0] == seen[1][0], seen
        info = gw.coord.path.prefill_policy.router.request_hashes("completions", body)
        assert info is not None
        prompt = info[0]
        bs = policy.router.block_size
        assert prompt > 2 * bs
        assert seen[0][1] == prompt                  # nothing cached yet: the whole prompt
        assert seen[1][1] == prompt - bs * (prompt // bs)   # the tail past the cached blocks
        assert gw.inflight() == 0
    finally:
        await stop(gw, sims)


@run_async
async def test_the_decode_leg_chosen_after_the_prefill_logs_its_mode_and_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    """pd_prefill_first, joint with local prefill: a pair (both decode instances busy), then
    D chosen again after the prefill; both debug lines name the mode and the reason, and
    the decode leg's time to its first token is learned from."""
    gw, sims = await cluster("pd_prefill_first", pd={"joint": {"enabled": True}})
    ds = [e for e in gw.table.endpoints.values() if e.role is Role.DECODE]
    for d in ds:
        for _ in range(64):             # 64 sequences decoding on each decode instance
            d.acquire(100, 0, 16)
    try:
        with caplog.at_level(logging.DEBUG, logger="motor.coordinator.policy.pairs"):
            st, out = await post(gw, {"model": "m", "prompt": "word " * 500,
                                      "max_tokens": 4, "ignore_eos": True, "stream": True})
        assert st == 200 and out.rstrip().endswith(b"data: [DONE]"), out
        # the streamed decode leg's first token fed the hand-off's learning
        assert gw.coord.path.joint.handoff_observations == (1, 0)
        lines = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("pd joint choice")]
        assert len(lines) == 2, lines
        plan, again = lines
        assert plan.startswith("pd joint choice pd_prefill_first:") and ", cost;" in plan
        assert again.startswith("pd joint choice pd_prefill_first (decode leg chosen after "
                                "the prefill):"), again
        assert ", cost;" in again and "local_off" not in again, again
    finally:
        for d in ds:
            for _ in range(64):
                d.release(100, 0, 16)
        await stop(gw, sims)


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_a_client_error_of_a_local_request_is_not_a_decode_failure(stream: bool) -> None:
    """Conditional disaggregation: a short prompt served by a decode instance alone asks for
    more tokens than the context holds; the engine's 400 reaches the client and counts as
    ``client_error``, not ``decode_failed``."""
    mode = "pd_prefill_first"
    gw, sims = await cluster(mode, max_model_len=256, pd={"joint": {"enabled": True}})
    local = metrics.PD_ROUTE.labels(mode, "local", "short_prompt")._value.get()
    before = {k: _outcome(mode, k) for k in ("client_error", "decode_failed")}
    try:
        st, out = await post(gw, {"model": "m", "prompt": "hello there", "max_tokens": 1000,
                                  "stream": stream})
        assert st == 400, out
        assert "maximum context length" in orjson.loads(out)["error"]["message"]
        assert metrics.PD_ROUTE.labels(mode, "local", "short_prompt")._value.get() == local + 1
        assert _outcome(mode, "client_error") == before["client_error"] + 1
        assert _outcome(mode, "decode_failed") == before["decode_failed"]
        assert gw.inflight() == 0
    finally:
        await stop(gw, sims)


@pytest.mark.parametrize("mode", MODES)
@run_async
async def test_a_prompt_longer_than_the_context_is_a_client_error_in_every_mode(
        mode: str) -> None:
    """Both legs (pd.joint off): the leg that meets the oversize prompt first answers 400,
    passed on, counted as ``client_error`` rather than as that leg's failure."""
    gw, sims = await cluster(mode, max_model_len=64)
    before = {k: _outcome(mode, k) for k in ("client_error", "prefill_failed", "decode_failed")}
    try:
        st, out = await post(gw, {"model": "m", "prompt": "word " * 200, "max_tokens": 4})
        assert st == 400, out
        assert "maximum context length" in orjson.loads(out)["error"]["message"]
        assert _outcome(mode, "client_error") == before["client_error"] + 1
        assert _outcome(mode, "prefill_failed") == before["prefill_failed"]
        assert _outcome(mode, "decode_failed") == before["decode_failed"]
    finally:
        await stop(gw, sims)

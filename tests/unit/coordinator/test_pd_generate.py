"""SGLang's native ``POST /generate`` through the gateway (issue 18 item 4): in
``pd_bootstrap`` both legs get the bootstrap fields, a batch (``text`` list, ``input_ids``
list of lists) one distinct room per element; in the other PD modes the request is passed
through to an engine, whose 404 comes back as an OpenAI error body (never motor's 503)."""
from __future__ import annotations

import orjson
import pytest

from motor.config.schema import Role
from tests.cases.harness import FB, http, run_async
from tests.support.gateway import Gateway


async def sglang_like(fb, req, resp, e):
    if e.path != "/generate":
        resp.send(404, b'{"detail":"Not Found"}')
        return
    body = orjson.loads(req.body)
    k = len(body["text"]) if isinstance(body.get("text"), list) else (
        len(body["input_ids"]) if isinstance(body.get("input_ids"), list)
        and isinstance(body["input_ids"][0], list) else None)
    one = {"text": f"from {fb.role}", "meta_info": {"finish_reason": {"type": "length"}}}
    resp.send(200, orjson.dumps([one] * k if k else one))


async def vllm_like(fb, req, resp, e):
    resp.send(404, b'{"detail":"Not Found"}')    # vLLM serves no /generate


async def _cluster(mode: str, behave):
    p, d = FB(behave=behave), FB(behave=behave)
    p.role, d.role = "prefill", "decode"  # type: ignore[attr-defined]
    for fb in (p, d):
        await fb.start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", p.port), (Role.DECODE, "127.0.0.1", d.port)],
                       mode=mode).start()
    return p, d, gw


@pytest.mark.parametrize("batch", [
    {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4}},
    {"input_ids": [[1, 2], [3, 4], [5, 6]], "sampling_params": {"max_new_tokens": 4}},
], ids=["text", "input_ids"])
@run_async
async def test_bootstrap_generate_batch_gets_a_room_per_element(batch):
    p, d, gw = await _cluster("pd_bootstrap", sglang_like)
    try:
        st, _, out = await http(gw.port, "POST", "/generate", orjson.dumps(batch))
        assert st == 200, out
        answer = orjson.loads(out)
        assert [a["text"] for a in answer] == ["from decode"] * 3      # D's answer
        (pb,), (db,) = [e.json for e in p.log], [e.json for e in d.log]
        assert pb == db                                   # both legs: the same body
        rooms = pb["bootstrap_room"]
        assert isinstance(rooms, list) and len(set(rooms)) == 3
        assert pb["bootstrap_host"] == ["127.0.0.1"] * 3 and len(pb["bootstrap_port"]) == 3
        assert {k: v for k, v in pb.items() if not k.startswith("bootstrap_")} == batch
        st, _, out = await http(gw.port, "POST", "/generate",
                                b'{"text":"one","sampling_params":{"max_new_tokens":2}}')
        assert st == 200 and orjson.loads(out)["text"] == "from decode"
        assert isinstance(p.log[-1].json["bootstrap_room"], int)
    finally:
        await gw.stop()
        for fb in (p, d):
            await fb.stop()


@pytest.mark.parametrize("mode", ["pd_prefill_first", "pd_decode_first"])
@run_async
async def test_generate_in_vllm_pd_modes_is_the_engines_404(mode):
    p, d, gw = await _cluster(mode, vllm_like)
    try:
        st, _, out = await http(gw.port, "POST", "/generate", b'{"text":"x"}')
        err = orjson.loads(out)["error"]
        assert st == 404 and err["code"] == 404 and "Not Found" in err["message"]
        assert len(d.log) == 1 and not p.log             # passed through to one engine
    finally:
        await gw.stop()
        for fb in (p, d):
            await fb.stop()

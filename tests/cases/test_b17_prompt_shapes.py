"""B17: ``prompt`` / ``input`` as a string, list of strings, token ids or nested token ids pass
as sent (no flattening, no templating); the empty list gets 400 (from the engine), never 500."""
from __future__ import annotations

import orjson
import pytest

from tests.cases.harness import FB, cluster, http, run_async

SHAPES = ["hello", ["hello", "world"], [15339, 1917, 0], [[15339, 1917], [9906]]]


async def echo_prompt(fb, req, resp, e):
    body = orjson.loads(req.body)
    key = "input" if e.path == "/v1/embeddings" else "prompt"
    p = body.get(key)
    if p == []:
        resp.send(400, b'{"error":{"message":"prompt must not be empty","type":"BadRequestError","param":"prompt","code":400}}')
        return
    items = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    if e.path == "/v1/embeddings":
        out = {"object": "list", "model": "m",
               "data": [{"object": "embedding", "index": i, "embedding": [0.1]} for i in range(len(items))]}
    else:
        out = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": i, "text": orjson.dumps(it).decode(), "finish_reason": "length"}
                           for i, it in enumerate(items)]}
    resp.send(200, orjson.dumps(out))


@pytest.mark.parametrize("path,key", [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
@run_async
async def test_prompt_shapes_pass_as_sent(path, key):
    async with cluster(2, fbs=[FB(behave=echo_prompt), FB(behave=echo_prompt)]) as (fbs, gw):
        for shape in SHAPES:
            req = {"model": "m", key: shape, "max_tokens": 4}
            st, _, out = await http(gw.port, "POST", path, orjson.dumps(req))
            assert st == 200, out
            got = [e for fb in fbs for e in fb.log][-1] if False else max(
                (e for fb in fbs for e in fb.log), key=lambda e: e.arrived)
            assert got.json[key] == shape
            if isinstance(shape, list) and not isinstance(shape[0], int):
                data = orjson.loads(out)["data" if key == "input" else "choices"]
                assert [d["index"] for d in data] == [0, 1]
        st, _, out = await http(gw.port, "POST", path, orjson.dumps({"model": "m", key: []}))
        assert st == 400 and orjson.loads(out)["error"]["code"] == 400


@run_async
async def test_token_prompt_affinity_under_a_prefix_aware_policy():
    """Criterion 3: token-id prompts are not "no prefix" - 10 repeats of a 2,000-id prompt
    land on one FB with ``kv_affinity`` (approximate mode: no KV events from fakes)."""
    async with cluster(2, fbs=[FB(behave=echo_prompt), FB(behave=echo_prompt)],
                       policy="kv_affinity") as (fbs, gw):
        prompt = [15339, 1917, 0] + list(range(1000, 2997))
        for _ in range(10):
            st, _, _ = await http(gw.port, "POST", "/v1/completions",
                                  orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}))
            assert st == 200
        assert sorted(len(fb.log) for fb in fbs) == [0, 10]

"""N03: the engine routes beyond chat/completions reach the engines through the gateway:
``/v1/responses`` (whole and streamed, ``event:`` lines intact; ``previous_response_id``
reaching the engine that stored the response), ``/tokenize``, ``/detokenize``, rerank, score,
and a multipart audio transcription routed by its form's ``model``; bodies byte-identical,
unknown model or path a 404 OpenAI error."""
from __future__ import annotations

import hashlib
import itertools

import openai
import orjson

from tests.cases.harness import FB, cluster, http, run_async, wait_for

_ids = itertools.count(1)


async def engine(fb, req, resp, e):
    """vLLM-like extra routes; each echoes the body's sha256."""
    sha = hashlib.sha256(req.body).hexdigest()
    if e.path == "/v1/responses":
        body = orjson.loads(req.body)
        prev = body.get("previous_response_id")
        if prev is not None and prev not in fb.stored:
            resp.send(404, orjson.dumps({"error": {"message": f"Response with id '{prev}' not "
                                                   "found.", "type": "NotFoundError",
                                                   "param": None, "code": 404}}))
            return
        rid = f"resp_{next(_ids)}"
        fb.stored.add(rid)
        obj = {"id": rid, "object": "response", "model": body["model"], "status": "completed",
               "output": [{"type": "message", "content": [{"type": "output_text",
                                                           "text": "hello"}]}], "sha": sha}
        if not body.get("stream"):
            resp.send(200, orjson.dumps(obj))
            return
        resp.start(200)
        for kind, data in (("response.created", {"type": "response.created",
                                                 "response": dict(obj, status="in_progress")}),
                           ("response.output_text.delta", {"type": "response.output_text.delta",
                                                           "delta": "hello"}),
                           ("response.completed", {"type": "response.completed",
                                                   "response": obj})):
            resp.write(f"event: {kind}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n")
            await resp.drain()
        resp.end()
        return
    if e.path == "/v1/embeddings":
        resp.send(200, orjson.dumps({"object": "list", "model": "m", "data": [
            {"object": "embedding", "index": 0, "embedding": [0.25, 0.5]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1}}))
        return
    resp.send(200, orjson.dumps({"path": e.path, "sha": sha, "served_by": fb.port,
                                 "text": f"served by {fb.port}"}))


def _fb(models=("m",)) -> FB:
    fb = FB(models=models, behave=engine)
    fb.stored = set()  # type: ignore[attr-defined]
    return fb


def _models_learned(gw) -> bool:
    return all(ep.models and ep.ready for ep in gw.table.endpoints.values())


@run_async
async def test_engine_routes_pass_through():
    a, b, w = _fb(), _fb(), _fb(("whisper",))
    async with cluster(fbs=[a, b, w], probe=True, health_check_interval_s=0.2) as (_, gw):
        assert await wait_for(lambda: _models_learned(gw))
        hdr = {"content-type": "application/json", "x-request-id": "n03-1"}
        # 1. a stored response, whole; the body reaches one engine byte for byte
        body1 = b'{"model":"m","input":"hi"}'
        st, h, out = await http(gw.port, "POST", "/v1/responses", body1, hdr)
        assert st == 200 and h.get("x-request-id") == "n03-1"
        first = orjson.loads(out)
        holder = a if first["id"] in a.stored else b
        (e,) = [x for x in holder.log if x.path == "/v1/responses"]
        assert e.body == body1 and e.headers["x-request-id"] == "n03-1"
        assert first["sha"] == hashlib.sha256(body1).hexdigest()
        # 2. streamed: the engine's SSE records arrive with their event: lines
        st, _, out = await http(gw.port, "POST", "/v1/responses",
                                b'{"model":"m","input":"hi","stream":true}', hdr)
        assert st == 200
        for kind in (b"response.created", b"response.output_text.delta", b"response.completed"):
            assert b"event: " + kind + b"\ndata: " in out
        # 3. previous_response_id: every follow-up reaches the engine that stored it
        for _ in range(5):
            st, _, out = await http(gw.port, "POST", "/v1/responses", orjson.dumps(
                {"model": "m", "input": "and then?", "previous_response_id": first["id"]}), hdr)
            assert st == 200, out
        follow = [x for fb in (a, b) for x in fb.log if b"previous_response_id" in x.body]
        assert len(follow) == 5 and all(x in holder.log for x in follow)
        # 4./5. tokenize, detokenize, rerank, score: passed through, answers as sent
        for path, body in (("/tokenize", b'{"model":"m","prompt":"hello"}'),
                           ("/detokenize", b'{"model":"m","tokens":[104,105]}'),
                           ("/v1/rerank", b'{"model":"m","query":"q","documents":["a","b"]}'),
                           ("/v1/score", b'{"model":"m","text_1":"a","text_2":"b"}')):
            st, _, out = await http(gw.port, "POST", path, body, hdr)
            got = orjson.loads(out)
            assert st == 200 and got["path"] == path
            assert got["sha"] == hashlib.sha256(body).hexdigest()
        # a multipart transcription is routed by its form's model field
        form = (b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n"
                b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x01\x02\r\n--XyZ--\r\n")
        st, _, out = await http(gw.port, "POST", "/v1/audio/transcriptions", form,
                                {"content-type": "multipart/form-data; boundary=XyZ"})
        got = orjson.loads(out)
        assert st == 200 and got["served_by"] == w.port
        assert got["sha"] == hashlib.sha256(form).hexdigest()
        # 6. unknown model, unknown path: 404 with an OpenAI error body
        st, _, out = await http(gw.port, "POST", "/v1/responses", b'{"model":"nope","input":"hi"}',
                                hdr)
        assert st == 404 and orjson.loads(out)["error"]["code"] == 404
        st, _, out = await http(gw.port, "POST", "/v1/does-not-exist", b"{}", hdr)
        assert st == 404 and orjson.loads(out)["error"]["code"] == 404


@run_async
async def test_unknown_previous_response_is_found_on_its_engine():
    # another worker created the response: this one does not know it; the 404 of the wrong
    # engine is retried on the next one
    a, b = _fb(), _fb()
    async with cluster(fbs=[a, b], probe=True, health_check_interval_s=0.2) as (_, gw):
        assert await wait_for(lambda: _models_learned(gw))
        b.stored.add("resp_elsewhere")
        for _ in range(4):
            st, _, out = await http(gw.port, "POST", "/v1/responses", orjson.dumps(
                {"model": "m", "input": "x", "previous_response_id": "resp_elsewhere"}))
            assert st == 200, out
        st, _, out = await http(gw.port, "POST", "/v1/responses", orjson.dumps(
            {"model": "m", "input": "x", "previous_response_id": "resp_nowhere"}))
        assert st == 404 and b"not found" in out        # the engine's own answer, not a 5xx


@run_async
async def test_openai_sdk_calls():
    a, b, w = _fb(), _fb(), _fb(("whisper",))
    async with cluster(fbs=[a, b, w], probe=True, health_check_interval_s=0.2) as (_, gw):
        assert await wait_for(lambda: _models_learned(gw))
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="none",
                                    max_retries=0)
        try:
            await _sdk_calls(client, w)
        finally:
            await client.close()


async def _sdk_calls(client: openai.AsyncOpenAI, w: FB) -> None:
    r = await client.responses.create(model="m", input="hi")
    assert r.id.startswith("resp_") and r.output_text == "hello"
    kinds = [ev.type async for ev in await client.responses.create(model="m", input="hi",
                                                                    stream=True)]
    assert kinds == ["response.created", "response.output_text.delta", "response.completed"]
    for _ in range(3):
        follow = await client.responses.create(model="m", input="more",
                                               previous_response_id=r.id)
        assert follow.id != r.id
    emb = await client.embeddings.create(model="m", input="hello", encoding_format="float")
    assert emb.data[0].embedding == [0.25, 0.5]
    tr = await client.audio.transcriptions.create(model="whisper",
                                                  file=("a.wav", b"RIFF\x00\x01", "audio/wav"))
    assert tr.text == f"served by {w.port}"
    try:
        await client.responses.create(model="nope", input="hi")
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as e:
        assert e.status_code == 404

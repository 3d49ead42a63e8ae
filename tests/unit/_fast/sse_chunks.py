"""Engine SSE chunks for the scanner's tests (tests/unit/_fast/test_sse.py, the recovery
comparison and the fuzz lane): builders and hypothesis strategies of vLLM / SGLang-shaped
chunks (fields present, null or absent, random key order, extra fields, any text)."""
from __future__ import annotations

import json

import orjson
from hypothesis import strategies as st


def data(obj, spaced: bool = False) -> bytes:
    if spaced:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat(content="a", ids=(7,), finish=None, **extra):
    c = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = list(ids)
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [c], **extra}


def cmpl(text="a", ids=(7,), finish=None, prompt_ids=None, **extra):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
         "stop_reason": None}
    if ids is not None:
        c["token_ids"] = list(ids)
        c["prompt_token_ids"] = prompt_ids
    return {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
            "choices": [c], "usage": None, **extra}


def events(out: bytes) -> list[object]:
    """The client's events: ``data:`` payloads parsed, other lines as bytes."""
    res: list[object] = []
    for ev in out.split(b"\n\n"):
        if not ev:
            continue
        if ev.startswith(b"data:"):
            payload = ev[5:].strip()
            try:
                res.append(orjson.loads(payload))
                continue
            except orjson.JSONDecodeError:
                pass
        res.append(ev)
    return res


_text = st.text(max_size=12)
_ids = st.lists(st.integers(0, 200_000), max_size=6)
_extra = st.dictionaries(st.sampled_from(["service_tier", "system_fingerprint", "x_a", "k"]),
                         st.one_of(st.none(), st.integers(-5, 5), _text,
                                   st.lists(st.integers(0, 9), max_size=3),
                                   st.dictionaries(_text, st.integers(0, 9), max_size=2)),
                         max_size=3)


@st.composite
def chunk(draw, chat_mode: bool) -> dict:
    """One engine chunk of either engine's shape (fields present, null or absent)."""
    c: dict = {"index": 0}
    if chat_mode:
        delta: dict = {}
        if draw(st.booleans()):
            delta["content"] = draw(st.one_of(st.none(), _text))
        if draw(st.integers(0, 5)) == 0:
            delta["role"] = "assistant"
        if draw(st.integers(0, 9)) == 0:
            delta["reasoning_content"] = draw(_text)
        c["delta"] = delta if draw(st.integers(0, 9)) else None
    else:
        c["text"] = draw(st.one_of(st.none(), _text))
        if draw(st.booleans()):
            c["prompt_token_ids"] = draw(st.one_of(st.none(), _ids))
            if draw(st.booleans()):
                c["prompt_text"] = draw(st.one_of(st.none(), _text))
    if draw(st.integers(0, 4)):
        c["token_ids"] = draw(st.one_of(st.none(), _ids)) if draw(st.integers(0, 9)) \
            else None
    c["finish_reason"] = draw(st.sampled_from([None, None, None, "stop", "length"]))
    if draw(st.booleans()):
        c["stop_reason"] = draw(st.sampled_from([None, 7, "</s>"]))
    c["logprobs"] = None
    c.update({f"c_{k}": v for k, v in draw(_extra).items()})
    obj: dict = {}
    if draw(st.integers(0, 9)):
        obj["id"] = draw(st.sampled_from(["cmpl-1", "chatcmpl-x", None]))
    obj["object"] = "chunk"
    if draw(st.booleans()):
        obj["created"] = draw(st.integers(0, 2 ** 40))
    obj["model"] = draw(st.sampled_from(["m", "org/model"]))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        obj["choices"] = []
        obj["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    elif kind == 1:
        obj["usage"] = draw(st.one_of(st.none(), st.just({"prompt_tokens": 1})))
    else:
        obj["choices"] = [c]
        if draw(st.booleans()):
            obj["usage"] = None
    if draw(st.integers(0, 4)) == 0:
        obj["prompt_token_ids"] = draw(st.one_of(st.none(), _ids))
        if draw(st.booleans()):
            obj["prompt_text"] = draw(_text)
    obj.update(draw(_extra))
    keys = draw(st.permutations(list(obj)))
    return {k: obj[k] for k in keys}


@st.composite
def stream(draw):
    chat_mode = draw(st.booleans())
    evs = draw(st.lists(chunk(chat_mode), min_size=1, max_size=8))
    spaced = draw(st.booleans())
    raw = [data(e, spaced) for e in evs]
    if draw(st.integers(0, 5)) == 0:
        raw.insert(draw(st.integers(0, len(raw))), b": keep-alive\n\n")
    if draw(st.booleans()):
        raw.append(b"data: [DONE]\n\n")
    return chat_mode, draw(st.booleans()), _in_blocks(draw, raw)


def _in_blocks(draw, raw: list[bytes]) -> list[bytes]:
    """``raw`` (events) cut into blocks of consecutive events at drawn places."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    blocks, last = [], 0
    for c in cuts + [len(raw)]:
        if c > last:
            blocks.append(b"".join(raw[last:c]))
            last = c
    return blocks


def _revalue(obj: dict, chat_mode: bool, text, ids) -> dict:
    """``obj`` (one chunk) with its choice's text and token ids replaced, key order kept."""
    out = dict(obj)
    choices = out.get("choices")
    if not choices:
        return out
    c = dict(choices[0])
    if chat_mode:
        if isinstance(c.get("delta"), dict) and "content" in c["delta"]:
            c["delta"] = {**c["delta"], "content": text}
    elif "text" in c:
        c["text"] = text
    if "token_ids" in c:
        c["token_ids"] = ids
    out["choices"] = [c]
    return out


@st.composite
def shaped_stream(draw):
    """A stream whose events repeat one chunk but for their text and token ids (an engine's
    usual stream), with now and then one that differs elsewhere (another finish reason,
    spacing, a null text), cut into blocks; as :func:`stream` returns it."""
    chat_mode = draw(st.booleans())
    base = draw(chunk(chat_mode))
    spaced = draw(st.booleans())
    raw = []
    for _ in range(draw(st.integers(2, 12))):
        text = draw(st.one_of(_text, _text, _text, st.none()))
        ids = draw(st.one_of(_ids, _ids, _ids, st.none()))
        ev = _revalue(base, chat_mode, text, ids)
        if draw(st.integers(0, 7)) == 0:
            ev = draw(chunk(chat_mode))             # another shape
        raw.append(data(ev, spaced if draw(st.integers(0, 7)) else not spaced))
    if draw(st.booleans()):
        raw.append(b"data: [DONE]\n\n")
    return chat_mode, draw(st.booleans()), _in_blocks(draw, raw)

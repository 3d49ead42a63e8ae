"""motor._fast.reqscan.scan_request and motor._fast.jsongrammar against orjson.

The reference is what the request path did with every body before the scan: ``orjson.loads``
and the checks of ``parse_request``. Properties (hypothesis): whenever the scan decides a
body, orjson parses it and the reference reads the same model, stream flag and length
bound; a plain body (what clients send: no escaped names, a string model, messages) is
decided by the scan, not handed back.
"""
from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from motor._fast.jsongrammar import value_end
from motor._fast.reqscan import STREAM_KEYS, scan_request
from motor.coordinator.recovery import (_NOT_CONTINUABLE_KEYS, StreamRecovery, continuable,
                                        inject_token_ids, with_token_ids)
from motor.protocol.openai import max_tokens_field, max_tokens_of

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)


Scan = tuple[str | None, bool, int, bool, int | None]


def reference(raw: bytes, chat: bool) -> Scan | None:
    """What ``parse_request`` reads of ``raw`` with orjson, and whether a stream's set-up
    needs only the length bound (``plain``, then the bound's value); ``None`` where it
    answers 400 or where the scan must hand the body back (a token-id prompt)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return None
    if chat:
        msgs = body.get("messages")
        if type(msgs) is not list or not msgs:
            return None
    if isinstance(body.get("prompt"), list):
        return None
    mt = max_tokens_field(body, chat)
    plain = body.keys().isdisjoint(STREAM_KEYS) and (
        mt is None or (type(mt) is int and abs(mt) < 10 ** 18))
    return (model, body.get("stream") is True, max_tokens_of(body, chat), plain,
            mt if plain else None)


def check(raw: bytes, chat: bool) -> Scan | None:
    """The scan's answer; asserts it agrees with the reference when it decides."""
    got = scan_request(raw, chat)
    if got is not None:
        assert reference(raw, chat) == got, raw
    return got


# -- bodies ------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10 ** 20), 10 ** 20),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
bounds = st.one_of(st.integers(-3, 40000), st.none(), st.booleans(), st.just(16.0),
                   st.just("16"), st.integers(10 ** 17, 10 ** 19))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                           "content": st.text(max_size=40)}), max_size=3)
known: dict[str, Any] = {
    "model": st.one_of(st.text(max_size=12), st.none(), st.integers(0, 3)),
    "stream": st.one_of(st.booleans(), st.none(), st.just("true"), st.just(1)),
    "max_tokens": bounds, "max_completion_tokens": bounds, "messages": messages,
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 50000), max_size=4)),
}


@st.composite
def body(draw: Any) -> dict[str, Any]:
    """A request-like object: some of the members the scan reads, some others."""
    out: dict[str, Any] = {}
    for k in draw(st.permutations(list(known) + ["temperature", "user", "extra"])):
        if draw(st.booleans()):
            out[k] = draw(known[k]) if k in known else draw(values)
    return out


def dumps(v: Any) -> bytes:
    """Compact JSON as orjson writes it (UTF-8, no ASCII escapes), for any integer."""
    return json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()


@st.composite
def encoded(draw: Any) -> bytes:
    """A body's bytes as clients write them: orjson, or json with ASCII escapes and
    whitespace (LF included), sometimes a member twice (the last one counts)."""
    b = draw(body())
    how = draw(st.integers(0, 2))
    if how == 0:
        raw = dumps(b)
    elif how == 1:
        raw = json.dumps(b, ensure_ascii=draw(st.booleans()),
                         indent=draw(st.sampled_from([None, 1]))).encode()
    else:
        raw = b" \n{ " + b" ,\r\n\t".join(dumps(k) + b" : " + dumps(v)
                                          for k, v in b.items()) + b" }\n"
    if b and draw(st.booleans()):     # a member twice: the first one's value differs
        k = draw(st.sampled_from(sorted(b)))
        first = dumps({k: draw(known[k]) if k in known else 0})[1:-1]
        raw = raw.replace(b"{", b"{" + first + b",", 1)
    return raw


@SETTINGS
@given(encoded(), st.booleans())
def test_a_decided_body_reads_as_orjson_reads_it(raw, chat):
    check(raw, chat)


@SETTINGS
@given(body(), st.booleans())
def test_a_plain_body_is_decided_not_handed_back(b, chat):
    """orjson's own bytes of a body whose model has no character JSON escapes, with a
    chat's messages, no token-id prompt, and integers the grammar takes: decided."""
    if chat and not b.get("messages"):
        b["messages"] = [{"role": "user", "content": "hi"}]
    b.pop("prompt", None) if isinstance(b.get("prompt"), list) else None
    m = b.get("model")
    if m is not None and not (isinstance(m, str) and orjson.dumps(m) == b'"' + m.encode() + b'"'):
        b["model"] = "m"
    for k in ("max_tokens", "max_completion_tokens"):
        v = b.get(k)
        if isinstance(v, int) and abs(v) >= 10 ** 18:
            b[k] = 7
    b = {k: v for k, v in b.items() if k in known}
    raw = orjson.dumps(b)
    got = check(raw, chat)
    assert got == reference(raw, chat) and got is not None


@SETTINGS
@given(st.one_of(values.map(dumps), st.binary(max_size=40)))
def test_the_grammar_takes_only_what_orjson_parses(doc):
    end = value_end(doc)
    if end == len(doc):
        orjson.loads(doc)
    assert end == -1 or 0 < end <= len(doc)


# -- cases ---------------------------------------------------------------------------------
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]'


@pytest.mark.parametrize("raw,chat,want", [
    (CHAT + b',"max_tokens":16,"stream":true}', True, ("m", True, 16, True, 16)),
    (CHAT + b',"max_completion_tokens":null,"max_tokens":9}', True, ("m", False, 9, True, 9)),
    (CHAT + b',"max_completion_tokens":5,"max_tokens":9}', True, ("m", False, 5, True, 5)),
    (CHAT + b',"max_completion_tokens":5,"max_tokens":9}', False, ("m", False, 9, True, 9)),
    (CHAT + b',"max_tokens":true}', True, ("m", False, 0, False, None)),
    (CHAT + b',"max_tokens":16.0}', True, ("m", False, 0, False, None)),
    (CHAT + b',"max_tokens":1e2}', True, ("m", False, 0, False, None)),
    (CHAT + b',"max_tokens":-4}', True, ("m", False, 0, True, -4)),
    (CHAT + b',"max_tokens":"16"}', True, ("m", False, 0, False, None)),
    (CHAT + b',"max_tokens":null}', True, ("m", False, 0, True, None)),
    (CHAT + b',"max_tokens":8,"stop":null}', True, ("m", False, 8, False, None)),
    (CHAT + b',"stream_options":{"include_usage":true}}', True, ("m", False, 0, False, None)),
    (CHAT + b',"stream":true,"stream":false}', True, ("m", False, 0, True, None)),
    (CHAT + b',"stream":"true"}', True, ("m", False, 0, True, None)),
    (CHAT + b',"model":null}', True, (None, False, 0, True, None)),
    (b'{"model":"\xc3\xa9t\xc3\xa9","prompt":"x"}', False,
     ("\u00e9t\u00e9", False, 0, True, None)),
    (b'{"prompt":"x"}', False, (None, False, 0, True, None)),
    (b"{}", False, (None, False, 0, True, None)),
    (b" \r\n\t{ } \n", False, (None, False, 0, True, None)),
    (b'{"messages":[]}', False, (None, False, 0, True, None)),
])
def test_cases(raw, chat, want):
    assert check(raw, chat) == want


@pytest.mark.parametrize("raw,chat", [
    (b"", False), (b"[]", False), (b'"x"', False), (b"{", False), (b"{}}", False),
    (b"{} x", False),
    (b'{"model":1}', False),                           # the path's 400
    (b'{"model":"a\\u00e9"}', False),                  # a model with an escape
    (b'{"mod\\u0065l":"m"}', False),                   # an escaped name
    (b'{"prompt":[1,2]}', False),                      # a token-id prompt: its length
    (b'{"messages":[]}', True),                        # the path's 400
    (b'{"messages":{}}', True),
    (b'{"model":"m"}', True),                          # no messages
    (CHAT + b',"x":"\xed\xa0\x80"}', True),            # a UTF-8 surrogate
    (CHAT + b',"x":"\\ud83d\\ude00"}', True),          # escaped surrogates: orjson decides
    (CHAT + b',"x":1234567890123456789}', True),       # over 18 digits
    (CHAT + b',"x":"a\x01"}', True),                   # a control character
    (CHAT + b',}', True),
    (CHAT + b',"x":01}', True),
    (CHAT + b',"x":' + b"[" * 70 + b"]" * 70 + b"}", True),   # deeper than the grammar
])
def test_handed_back(raw, chat):
    assert scan_request(raw, chat) is None


def test_none_is_handed_back():
    assert scan_request(None, True) is None


def test_stream_keys_are_what_a_streams_set_up_reads():
    assert STREAM_KEYS == _NOT_CONTINUABLE_KEYS | {"return_token_ids", "stream_options",
                                                   "min_tokens"}


@SETTINGS
@given(encoded(), st.booleans())
def test_a_plain_stream_is_set_up_from_the_scan_as_from_the_body(raw, chat):
    """What ``union`` builds from a plain scan (no parse) equals what it builds from the
    parsed body: continuable, the same recovery state, the same body sent upstream."""
    got = check(raw, chat)
    if got is None or not got[3]:
        return
    body = orjson.loads(raw)
    assert continuable(chat, body) is None
    assert with_token_ids(raw) == inject_token_ids(raw, body)
    assert orjson.loads(with_token_ids(raw)) == dict(body, return_token_ids=True)

    class Lazy:
        body = orjson.loads(raw)

    a, b = StreamRecovery(chat, body), StreamRecovery(chat, None, parsed=Lazy(), bound=got[4])
    for k in ("client_ids", "include_usage", "max_tokens", "min_tokens", "leg_is_cmpl"):
        assert getattr(a, k) == getattr(b, k), k
    assert b.body == body and b.body is Lazy.body

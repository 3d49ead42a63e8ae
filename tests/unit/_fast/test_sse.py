"""motor._fast.sse.EventScanner against its reference model (tests/unit/_fast/reference.py).

Behaviour tests run on both; the hypothesis comparisons generate vLLM / SGLang-shaped
chunks (random key order, extra fields, compact or spaced JSON, any text) and require the
compiled scanner to understand them and to agree with the reference: same bytes for the
client as parsed JSON, same token ids, same stream state.
"""
from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from motor._fast import sse
from tests.unit._fast import reference as ref
from tests.unit._fast.sse_chunks import chat, cmpl, data, events, shaped_stream, stream

IMPLS = {"compiled": sse.EventScanner, "reference": ref.EventScanner}
STATE = ref.EventScanner.STATE
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(params=sorted(IMPLS))
def Scanner(request):
    return IMPLS[request.param]


# -- behaviour (both) ---------------------------------------------------------------------
def test_token_ids_are_collected_and_cut_when_the_client_did_not_ask(Scanner):
    s, gen = Scanner(True, False), []
    out = s.feed(data(chat("he", [11, 12])) + data(chat("llo", [13])), gen)
    assert gen == [11, 12, 13]
    got = events(out)
    assert [e["choices"][0]["delta"]["content"] for e in got] == ["he", "llo"]
    assert all("token_ids" not in e["choices"][0] for e in got)
    assert s.events == 2 and not s.ids_missing


def test_token_ids_stay_when_the_client_asked_for_them(Scanner):
    s, gen = Scanner(True, True), []
    block = data(chat("he", [11, 12]))
    assert s.feed(block, gen) == block
    assert gen == [11, 12]


def test_the_first_event_gives_id_created_model(Scanner):
    s = Scanner(True, False)
    s.feed(data(chat()), [])
    assert s.news and s.captured and s.have_id
    assert (s.resp_id, s.created, s.model) == ("chatcmpl-1", 5, "m")
    s.feed(data(chat()), [])
    assert not s.captured


def test_chat_prompt_ids_are_recorded_once_and_cut(Scanner):
    s = Scanner(True, False)
    first = chat("", None, prompt_token_ids=[1, 2, 3], prompt_text="hi")
    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    out = s.feed(data(first), [])
    assert s.prompt_ids == [1, 2, 3] and s.have_prompt and s.role_sent
    (e,) = events(out)
    assert "prompt_token_ids" not in e and "prompt_text" not in e
    assert e["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_prompt_ids_stay_for_a_client_that_asked(Scanner):
    s = Scanner(True, True)
    first = chat("", None, prompt_token_ids=[1, 2, 3])
    block = data(first)
    assert s.feed(block, []) == block
    assert s.prompt_ids == [1, 2, 3]


def test_completion_prompt_ids_and_text_are_cut_and_a_null_goes_with_them(Scanner):
    s, gen = Scanner(False, False), []
    a = cmpl("x", [5], prompt_ids=[1, 2])
    a["choices"][0]["prompt_text"] = "hi"
    out = s.feed(data(a) + data(cmpl("y", [6])), gen)
    assert gen == [5, 6] and s.prompt_ids == [1, 2]
    for e in events(out):
        c = e["choices"][0]
        assert "token_ids" not in c and "prompt_token_ids" not in c and "prompt_text" not in c


def test_a_null_prompt_id_field_stays_when_nothing_else_is_cut(Scanner):
    s = Scanner(False, True)
    block = data(cmpl("y", [6]))
    assert s.feed(block, []) == block


def test_a_restarted_legs_role_chunk_is_dropped(Scanner):
    s = Scanner(True, False)
    s.sync(**{**dict.fromkeys(STATE, False), "role_sent": True, "have_id": True})
    role = chat("", None)
    role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    assert s.feed(data(role), []) == b""
    with_text = chat("a", [3])
    with_text["choices"][0]["delta"]["role"] = "assistant"
    (e,) = events(s.feed(data(with_text), []))
    assert e["choices"][0]["delta"] == {"content": "a"}


def test_finish_and_done(Scanner):
    s, gen = Scanner(True, False), []
    block = data(chat("a", [1], finish="length")) + b"data: [DONE]\n\n"
    out = s.feed(block, gen)
    assert s.finished and s.done and s.finish_reason == "length"
    assert events(out)[-1] == b"data: [DONE]"


def test_done_before_a_finishing_chunk_is_left_to_the_json_path(Scanner):
    s, gen = Scanner(True, False), []
    assert s.feed(data(chat("a", [1])) + b"data: [DONE]\n\n", gen) is None
    assert gen == [] and not s.done and s.fallbacks == 1


def test_the_usage_chunk(Scanner):
    s = Scanner(False, False)
    usage = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                      "total_tokens": 4}}
    block = data(usage)
    assert s.feed(block, []) == block
    assert s.usage_sent


def test_comments_and_other_fields_pass(Scanner):
    s = Scanner(True, False)
    block = b": keep-alive\n\nevent: x\n\n"
    assert s.feed(block, []) == block
    assert s.events == 0


def test_text_without_ids_and_reasoning_are_told(Scanner):
    s = Scanner(True, False)
    s.feed(data(chat("a", None)), [])
    assert s.ids_missing and not s.blocked
    r = chat("", [1])
    r["choices"][0]["delta"] = {"reasoning_content": "hm"}
    s.feed(data(r), [])
    assert s.blocked


@pytest.mark.parametrize("obj", [
    {"error": {"message": "boom", "code": 500}},
    {"id": "x", "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]},
    {"id": "x", "choices": [{"index": 0, "text": "", "stop_reason": "recomputed"}]},
    {"id": "x", "choices": [{"index": 0, "text": 5}]},
    {"id": "x", "choices": [{"index": 0, "text": "a", "token_ids": [1.5]}]},
    {"id": "x", "choices": [{"index": 0, "text": "a", "token_ids": [-1]}]},
    {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": 3}]},
    {"id": "x", "choices": {"index": 0}},
    {"id": 1.5, "choices": []},
    [1, 2],
], ids=["error", "two choices", "recomputed", "text number", "float id", "negative id",
        "finish number", "choices object", "id float", "array"])
def test_events_the_json_path_must_handle_record_nothing(Scanner, obj):
    s, gen = Scanner(False, False), []
    before = {k: getattr(s, k) for k in STATE}
    assert s.feed(data(obj) + data(cmpl("a", [1])), gen) is None
    assert gen == [] and {k: getattr(s, k) for k in STATE} == before and not s.news


# -- the compiled scanner's lexical limits ------------------------------------------------
@pytest.mark.parametrize("payload", [
    b'{"id":"x","choices":[{"text":"a","tok\\u0065n_ids":[1]}]}',     # escaped key
    b'{"id":"x","choices":[{"text":"\\ud83d\\ude00","token_ids":[1]}]}',  # surrogate escape
    b'{"id":"x","choices":[{"text":"\xff","token_ids":[1]}]}',          # not UTF-8
    b'{"id":"x","choices":[{"text":"\xc0\x80","token_ids":[1]}]}',      # overlong
    b'{"id":"x","choices":[{"text":"\xed\xa0\x80","token_ids":[1]}]}',  # surrogate in UTF-8
    b'{"id":"x","choices":[{"text":"a\x01","token_ids":[1]}]}',         # control character
    b'{"id":"x","choices":[{"text":"a","token_ids":[1],"token_ids":[2]}]}',  # duplicate
    b'{"id":"x","choices":[{"text":"a","token_ids":[1234567890123456789]}]}',
    b'{"id":"x","n":1e100,"choices":[{"text":"a","token_ids":[1]}]}',
    b'{"id":"x","n":' + b"[" * 70 + b"]" * 70 + b',"choices":[{"text":"a"}]}',
    b'{"id":"x",' + b",".join(b'"k%d":0' % i for i in range(60)) + b',"choices":[]}',
    b'{"id":"x","choices":[{"text":"a","token_ids":[1]}]} x',
    b'{"id":"x","choices":[{"text":"a","token_ids":[01]}]}',
    b'{"id":"x","choices":[{"text":"a","token_ids":[1,]}]}',
    b'{"id":"x","choices":[{"text":"a"}],}',
    b'{"id":"x","choices":[{"text":"a","finish_reason":"st\\u006fp"}]}',
    b'{"id":"x","choices":[{"text":"a","stop_reason":"recomp\\u0075ted"}]}',
    b'{"id":"x" "choices":[]}',
    b'{"id":nul,"choices":[]}',
], ids=lambda b: b[:40].decode("latin-1"))
def test_the_compiled_scanner_leaves_what_it_does_not_take_to_the_json_path(payload):
    s, gen = sse.EventScanner(False, False), []
    assert s.feed(b"data: " + payload + b"\n\n", gen) is None
    assert gen == [] and s.fallbacks == 1


@pytest.mark.parametrize("block", [
    b'data: {"id":"x","choices":[{"text":"abc',          # the block ends in a string
    b'data: {"id":"x","choices":[{"text":"abc\n\n',      # the event ends in one
    b'data: {"id":"abc\\',                               # ... after an escape's backslash
    b'data: {"id":"abc\\u00',                            # ... in a \u escape
    b'data: {"id":"ab\xc3',                              # ... in a UTF-8 sequence
    b'data: {"id":"ab\x00c","choices":[]}\n\n',          # a NUL inside a string
])
def test_a_string_cut_by_the_events_end_is_left_to_the_json_path(block):
    """A string's scan stops at the event's end (its line break, or the block's end) with
    no bound check a byte: whatever follows in the block is never read as the string's."""
    s = sse.EventScanner(False, False)
    assert s.feed(block, []) is None and s.fallbacks == 1
    tail = b'","choices":[{"text":"a","finish_reason":"stop"}]}\n\n'
    s = sse.EventScanner(False, False)
    assert s.feed(b'data: {"id":"abc\n\ndata: {"id":"x' + tail, []) is None


def test_a_line_break_inside_an_event_is_left_to_the_json_path():
    s = sse.EventScanner(False, False)
    assert s.feed(b'data: {"id":"x","choices":[]}\ndata: [DONE]\n\n', []) is None


@pytest.mark.parametrize("payload", [
    b'{ "id" : "x" , "choices" : [ { "text" : "a" , "token_ids" : [ 1 , 2 ] } ] }',
    b'{"choices":[{"token_ids":[1,2],"text":"a"}],"id":"x"}',
    b'{"choices":[{"token_ids":[1,2]}],"id":"x"}',
    b'{"choices":[{"text":"a","token_ids":[1,2]}],"id":"x"}',
    b'{"id":"x","choices":[{"prompt_token_ids":null,"token_ids":[1,2],"prompt_text":null}]}',
    b'{\t"id":"x",\r"choices":[{"token_ids":[1,2],"text":"\\"q\\"\\n\xc3\xa9\xf0\x9f\x98\x80"}]}',
], ids=range(6))
def test_cuts_leave_valid_json_whatever_the_layout(payload):
    s, gen = sse.EventScanner(False, False), []
    out = s.feed(b"data:" + payload + b"\n\n", gen)
    assert out is not None and gen == [1, 2]
    want = orjson.loads(payload)
    c = want["choices"][0]
    c.pop("token_ids")
    if c.get("prompt_token_ids", 0) is None:
        c.pop("prompt_token_ids")
    (got,) = events(out)
    assert got == want


def test_an_unchanged_block_is_returned_as_it_came():
    s = sse.EventScanner(True, True)
    block = data(chat()) + data(chat())
    assert s.feed(block, []) is block


# -- hypothesis: compiled == reference ----------------------------------------------------
def _state(s) -> dict:
    return {k: getattr(s, k) for k in (*STATE, "news", "captured", "finish_reason",
                                       "prompt_ids", "events", "fallbacks")} | (
        {"id": (s.resp_id, s.created, s.model)} if s.captured else {})


@SETTINGS
@given(stream())
def test_compiled_agrees_with_the_reference(case):
    chat_mode, client_ids, blocks = case
    a, b = sse.EventScanner(chat_mode, client_ids), ref.EventScanner(chat_mode, client_ids)
    gen_a: list[int] = []
    gen_b: list[int] = []
    for block in blocks:
        out_a = a.feed(block, gen_a)
        out_b = b.feed(block, gen_b)
        assert (out_a is None) == (out_b is None), block
        if out_a is None:          # same fallbacks: copy the JSON path's state to both
            state = dict.fromkeys(STATE, False)
            a.sync(**state)
            b.sync(**state)
            continue
        assert events(out_a) == events(out_b), block
        assert gen_a == gen_b
        assert _state(a) == _state(b), block


@SETTINGS
@given(stream())
def test_generated_chunks_are_understood_unless_they_end_before_finishing(case):
    chat_mode, client_ids, blocks = case
    s = sse.EventScanner(chat_mode, client_ids)
    for block in blocks:
        if s.feed(block, []) is None:
            assert b"[DONE]" in block and not s.finished
            return


# -- shapes: events that repeat the last one scanned in full ------------------------------
def _feed_all(s, blocks):
    gen: list[int] = []
    outs = []
    for block in blocks:
        out = s.feed(block, gen)
        if out is None:
            s.sync(**dict.fromkeys(STATE, False))
        outs.append(out)
    return outs, gen


def test_events_that_repeat_the_last_ones_shape_are_read_from_it():
    texts = ["Hello", "", ' w"or\\ld\n', "\u00e9t\u00e9", "a" * 40, "\U0001F600", "x"]
    role = data(chat(content="", ids=(), usage=None)).replace(
        b'"content":""', b'"role":"assistant","content":""')
    raw = [role] + [data(chat(content=t, ids=range(i, i + i % 3), usage=None))
                    for i, t in enumerate(texts)]
    raw.append(data(chat(content="", ids=(9,), finish="length", usage=None)))
    raw.append(b"data: [DONE]\n\n")
    for blocks in (raw, [b"".join(raw)]):
        on, off = sse.EventScanner(True, False), sse.EventScanner(True, False, shapes=False)
        outs_on, gen_on = _feed_all(on, blocks)
        outs_off, gen_off = _feed_all(off, blocks)
        assert outs_on == outs_off and gen_on == gen_off
        assert _state(on) == _state(off)
        assert gen_on == [x for i in range(len(texts)) for x in range(i, i + i % 3)] + [9]
        assert b"token_ids" not in b"".join(outs_on)
        # the role chunk and the first text chunk are read in full, the finishing one too
        assert on.shaped == len(texts) - 1 and off.shaped == 0
        assert on.finished and on.done


@pytest.mark.parametrize("other", [
    chat(content=None, ids=(3,)),                 # the text null: not a string slot
    chat(content="b", ids=None),                  # token ids absent
    {**chat(content="b"), "choices": [{**chat()["choices"][0], "token_ids": None}]},
    chat(content="b", ids=(3,), finish="stop"),   # another finish reason
    chat(content="b", ids=(3,), created=6),
    chat(content="b", ids=(3,), x_extra=1),
])
def test_an_event_that_differs_from_the_shape_elsewhere_is_read_in_full(other):
    blocks = [data(chat(content="a", ids=(1, 2))), data(chat(content="c", ids=(2,))),
              data(other), data(chat(content="d", ids=(4,)))]
    on, off = sse.EventScanner(True, False), sse.EventScanner(True, False, shapes=False)
    assert _feed_all(on, blocks) == _feed_all(off, blocks)
    assert _state(on) == _state(off)
    assert on.shaped == 1          # the second event; the third and fourth are read in full


def test_invalid_json_in_a_slot_is_not_taken_from_the_shape():
    good = data(chat(content="ab", ids=(1,)))
    for bad in (good.replace(b'"ab"', b'"a\x01"'), good.replace(b'"ab"', b'"a\\q"'),
                good.replace(b"[1]", b"[1,]"), good.replace(b"[1]", b"[-1]"),
                good.replace(b'"ab"', b'"a\xff"')):
        s = sse.EventScanner(True, False)
        assert s.feed(good, []) is not None
        gen: list[int] = []
        assert s.feed(bad, gen) is None and gen == [] and s.shaped == 0


@SETTINGS
@given(shaped_stream())
def test_shapes_change_nothing_the_client_or_the_stream_sees(case):
    chat_mode, client_ids, blocks = case
    on = sse.EventScanner(chat_mode, client_ids)
    off = sse.EventScanner(chat_mode, client_ids, shapes=False)
    r = ref.EventScanner(chat_mode, client_ids)
    outs_on, gen_on = _feed_all(on, blocks)
    assert (outs_on, gen_on) == _feed_all(off, blocks)
    assert _state(on) == _state(off)
    outs_r, gen_r = _feed_all(r, blocks)
    assert [o is None for o in outs_on] == [o is None for o in outs_r]
    assert [events(o) for o in outs_on if o is not None] == \
        [events(o) for o in outs_r if o is not None]
    assert gen_on == gen_r

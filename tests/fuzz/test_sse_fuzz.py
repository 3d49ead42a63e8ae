"""Fuzz lane: the SSE byte scanner (motor._fast.sse) on garbage, truncated and mutated engine
streams, split across upstream chunks at any byte (hypothesis).

Properties: the scanner never raises, and records nothing for a block it gives back
(``None``); a StreamRecovery that reads its first leg with the scanner gives the client
the same JSON, and the failover the same state, as one on the JSON path alone, with the
blocks cut as ``relay_sse`` cuts them (at the last blank line of what arrived).
Bounded: a few hundred examples, ~10 s on 2 cores.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from motor._fast.sse import EventScanner
from motor.coordinator.recovery import StreamRecovery
from tests.unit._fast.sse_chunks import chunk, data, events, shaped_stream
from tests.unit.coordinator.test_recovery_scan import state

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw, shaped: bool = False) -> tuple[bool, bytes]:
    """An engine stream's bytes, then damaged: bytes flipped, inserted, deleted, cut off.
    ``shaped``: events that repeat one chunk but for their text and token ids (the
    scanner's shapes, ``EventScanner._fit``), so most damage lands in a repeated event."""
    if shaped:
        chat_mode, _, blocks = draw(shaped_stream())
        raw = bytearray(b"".join(blocks))
    else:
        chat_mode = draw(st.booleans())
        raw = bytearray(b"".join(data(e, draw(st.booleans()))
                                 for e in draw(st.lists(chunk(chat_mode), max_size=6))))
        if draw(st.booleans()):
            raw += b"data: [DONE]\n\n"
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.integers(0, 3))
        at = draw(st.integers(0, len(raw)))
        if op == 0 and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif op == 1:
            raw[at:at] = draw(st.sampled_from([b"\n", b"\n\n", b'"', b"\\", b"{", b"}", b",",
                                               b"\xff", b"\xe2\x82", b"data: ", b"[DONE]"]))
        elif op == 2:
            del raw[at:at + draw(st.integers(1, 8))]
        else:
            del raw[at:]
    return chat_mode, bytes(raw)


def relay_blocks(raw: bytes, splits: list[int]) -> list[bytes]:
    """The blocks ``relay_sse`` hands its feed for ``raw`` arriving in pieces cut at
    ``splits``: each cut at the last blank line so far, the tail with a blank line added."""
    blocks: list[bytes] = []
    tail = b""
    last = 0
    for s in sorted(set(splits)) + [len(raw)]:
        chunk_ = tail + raw[last:s]
        last = s
        cut = chunk_.rfind(b"\n\n")
        if cut < 0:
            tail = chunk_
            continue
        tail = chunk_[cut + 2:]
        blocks.append(chunk_[:cut + 2])
    if tail:
        blocks.append(tail + b"\n\n")
    return blocks


@SETTINGS
@given(st.binary(max_size=300), st.booleans(), st.booleans())
def test_garbage_never_raises_and_records_nothing_when_given_back(raw, chat_mode, client_ids):
    s = EventScanner(chat_mode, client_ids)
    gen: list[int] = []
    out = s.feed(raw, gen)
    if out is None:
        assert gen == [] and not s.news
    else:
        assert all(type(x) is int and x >= 0 for x in gen)


@SETTINGS
@given(st.one_of(mutated(), mutated(shaped=True)), st.lists(st.integers(0, 2000), max_size=6),
       st.booleans())
def test_damaged_streams_split_anywhere_read_the_same_as_the_json_path(case, splits,
                                                                       client_ids):
    chat_mode, raw = case
    body = {"model": "m", "stream": True, "max_tokens": 16,
            "messages" if chat_mode else "prompt": [{"role": "user", "content": "x"}]
            if chat_mode else "x"}
    if client_ids:
        body["return_token_ids"] = True
    fast, slow = StreamRecovery(chat_mode, body), StreamRecovery(chat_mode, body, scan=False)
    for block in relay_blocks(raw, [s for s in splits if s < len(raw)]):
        assert events(fast.feed(block)) == events(slow.feed(block)), block
        assert state(fast) == state(slow), block

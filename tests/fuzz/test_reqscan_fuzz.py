"""Fuzz lane: the request-body scanner (motor._fast.reqscan, over motor._fast.jsongrammar) on
damaged request bodies: bytes flipped, inserted (quotes, escapes, invalid UTF-8, a UTF-16
surrogate, NUL, out-of-range numbers, brackets), deleted, cut off.

Property: the scan decides a body only when orjson parses it, and then reads from it what
``parse_request`` reads from orjson's dict (``check``); anything else is handed back.
Bounded: a few hundred examples, a few seconds on 2 cores.
"""
from __future__ import annotations

from hypothesis import given, strategies as st

from tests.unit._fast.test_reqscan import SETTINGS, check, encoded


@SETTINGS
@given(encoded(), st.booleans(), st.data())
def test_damaged_bodies_are_decided_only_when_orjson_reads_them(raw: bytes, chat: bool,
                                                                 data: st.DataObject) -> None:
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.integers(0, 3))
        at = data.draw(st.integers(0, len(buf)))
        if op == 0 and at < len(buf):
            buf[at] = data.draw(st.integers(0, 255))
        elif op == 1:
            buf[at:at] = data.draw(st.sampled_from([b'"', b"\\", b"{", b"}", b",", b":",
                                                    b"\xff", b"\xe2\x82", b"\xed\xa0\x80",
                                                    b"\\ud800", b"\x00", b"1e999", b"-",
                                                    b"nul", b"[", b"]", b" "]))
        elif op == 2:
            del buf[at:at + data.draw(st.integers(1, 8))]
        else:
            del buf[at:]
    check(bytes(buf), chat)

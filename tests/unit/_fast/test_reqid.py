"""motor._fast.reqid: made-up request ids, 32 lower-case hex digits, never repeated."""
from __future__ import annotations

import re

import pytest

from motor._fast.reqid import RequestIds
from motor.coordinator.routing.base import new_request_id

HEX32 = re.compile(rb"[0-9a-f]{32}")


def test_the_request_path_ids_are_32_lower_case_hex_digits() -> None:
    ids = [new_request_id() for _ in range(1000)]
    assert all(type(i) is bytes and HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == 1000


def test_no_id_repeats_in_one_generator_nor_across_two() -> None:
    a, b = RequestIds(), RequestIds()
    xs = [a() for _ in range(200_000)]
    ys = [b() for _ in range(50_000)]
    assert len(set(xs)) == len(xs)
    assert not set(xs) & set(ys)


def test_a_seed_gives_its_sequence_and_another_seed_another() -> None:
    s1, s2 = bytes(range(16)), bytes(range(1, 17))
    one, again, other = RequestIds(s1), RequestIds(s1), RequestIds(s2)
    seq = [one() for _ in range(100)]
    assert seq == [again() for _ in range(100)]
    assert not set(seq) & {other() for _ in range(100)}


def test_every_bit_of_the_ids_varies() -> None:
    """Over 20,000 ids of a fixed seed each of the 128 bits is set in 47-53 % of them (a
    counter, or a word left constant, fails this)."""
    g = RequestIds(b"\x00" * 16)          # the worst seed: all zero
    n = 20_000
    counts = [0] * 128
    for _ in range(n):
        v = int(g(), 16)
        for bit in range(128):
            counts[bit] += (v >> bit) & 1
    assert all(0.47 * n < c < 0.53 * n for c in counts), counts


@pytest.mark.parametrize("seed", [b"", b"x" * 15, b"x" * 17])
def test_a_seed_of_another_length_is_refused(seed: bytes) -> None:
    with pytest.raises(ValueError, match="seed: expected 16 bytes, got"):
        RequestIds(seed)

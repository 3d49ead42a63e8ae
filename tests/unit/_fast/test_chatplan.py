"""motor._fast.chatplan: the cached prefix's end and the assembled ids of a chat plan, as the
Python loops they replaced computed them, on random plans and caches (hits, misses,
the LRU order, the counters, a piece's encode error)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast.chatplan import assemble, plan_cut
from motor.coordinator.tokenize import TokenCache

TEXTS = ["sys", "user\nhi", "\n", "assistant\n", "a", "b", "\u00e9t\u00e9", "x" * 40]


def encode(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]


def cut_reference(plan: list[str | int], pieces: dict[str, list[int]]) -> tuple[int, int]:
    cut, chars = -1, 0
    for i, p in enumerate(plan):
        if type(p) is str and p not in pieces:
            chars += len(p)
            if cut < 0:
                cut = i
    return (cut if cut >= 0 else len(plan)), chars


def assemble_reference(plan: list[str | int], start: int, cache: TokenCache,
                       head: list[int] | None) -> list[int]:
    out = list(head or [])
    d = cache._d
    for p in plan[start:]:
        if type(p) is int:
            out.append(p)
            continue
        got = d.get(p)
        if got is None:
            cache.misses += 1
            got = encode(p)
            cache.put(p, got)
        else:
            d.move_to_end(p)
            cache.hits += 1
        out += got
    return out


plans = st.lists(st.one_of(st.sampled_from(TEXTS), st.integers(256, 300)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(plan=plans, cached=st.lists(st.sampled_from(TEXTS), unique=True),
       data=st.data(), with_head=st.booleans(), max_entries=st.integers(1, 6))
def test_the_compiled_loops_are_the_python_ones(plan, cached, data, with_head, max_entries):
    caches = []
    for _ in range(2):
        c = TokenCache(max_entries=max_entries)
        for t in cached:
            c.put(t, encode(t))
        caches.append(c)
    a, b = caches
    assert plan_cut(plan, a._d) == cut_reference(plan, b._d)
    start = data.draw(st.integers(0, len(plan)))
    head = [7, 8] if with_head else None
    got = assemble(plan, start, a, encode, head)
    want = assemble_reference(plan, start, b, head)
    assert got == want
    assert list(a._d.items()) == list(b._d.items())        # the same LRU order and bound
    assert (a.hits, a.misses, a.tokens) == (b.hits, b.misses, b.tokens)
    if head is not None:
        assert head == [7, 8]                                  # copied, not changed


def test_an_ordered_dict_is_a_dict_and_bad_arguments_are_named():
    assert plan_cut([257, "a", 258, "b"], OrderedDict(a=[1])) == (3, 1)
    assert plan_cut([257], {}) == (1, 0)
    with pytest.raises(TypeError, match="pieces is expected to be a dict, got list"):
        plan_cut(["a"], [])  # type: ignore[arg-type]
    c = TokenCache()
    with pytest.raises(IndexError, match=r"start is expected in 0\.\.2, got 3"):
        assemble(["a", 1], 3, c, encode)
    with pytest.raises(IndexError):
        assemble(["a", 1], -1, c, encode)


def test_a_failing_encode_leaves_the_hits_counted_and_nothing_kept():
    c = TokenCache()
    c.put("a", [1, 2])

    def broken(text: str) -> list[int]:
        raise ValueError(f"cannot encode {text!r}")
    with pytest.raises(ValueError, match="cannot encode 'b'"):
        assemble(["a", 5, "b"], 0, c, broken)
    assert (c.hits, c.misses) == (1, 1) and "b" not in c

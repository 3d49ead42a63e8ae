"""motor._fast.splice: a spliced chat's plan from its segments' splits is the added-token
split of the whole text, or ``None`` where a token could start in a content; the structure
key is the one :class:`~motor.coordinator.chat_splice.SpliceCache` renders by."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from motor._fast.pretok import split_added
from motor._fast.splice import plan_of, shape_of

NAMES = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
IDS = {"<|im_start|>": 257, "<|im_end|>": 258, "<|endoftext|>": 256}
PRE = "<|"


def split(text: str) -> list[str | int]:
    return split_added(text, PRE, NAMES, IDS)


_bits = st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|",
                                  "<|im_", "end|>", "|>", "<", "|", "user\n", "a", " b",
                                  "\n", "é", "✓", ""]), max_size=6).map("".join)


@settings(max_examples=800, deadline=None, derandomize=True)
@given(st.lists(_bits, min_size=1, max_size=5), st.lists(_bits, min_size=1, max_size=4),
       st.data())
def test_the_plan_is_the_split_of_the_spliced_text(segs: list[str], contents: list[str],
                                                  data: st.DataObject) -> None:
    n = len(segs) - 1
    idx = tuple(data.draw(st.integers(0, len(contents) - 1)) for _ in range(n))
    text = segs[0] + "".join(contents[i] + segs[k + 1] for k, i in enumerate(idx))
    whole = split(text)
    seg_plans = tuple(tuple(split(s)) for s in segs)
    got = plan_of(seg_plans, idx, contents, PRE)
    if got is not None:
        assert got == whole
    # no content can start a token or end one begun in a segment, and the segments' text
    # holds no partial token: the splice gives the plan
    if not any("<" in c or "|" in c for c in contents) and not any(
            type(x) is str and PRE in x for p in seg_plans for x in p):
        assert got == whole


def test_a_content_that_holds_the_prefix_falls_back() -> None:
    segs = (("a",), (258,))
    assert plan_of(segs, (0,), ["x <| y"], PRE) is None
    assert plan_of(segs, (0,), ["x y"], PRE) == ["ax y", 258]
    # a segment's own text holding the prefix, no content in its piece: kept as it is
    assert plan_of(((257, "<|x", 258), ("b",)), (0,), ["c"], PRE) == [257, "<|x", 258, "cb"]


def test_empty_pieces_are_dropped_and_contents_run_together() -> None:
    segs = ((257, "user\n"), (), (258,), ())
    assert plan_of(segs, (0, 1, 2), ["a", "b", ""], PRE) == [257, "user\nab", 258]
    assert plan_of(((257,), (258,)), (0,), [""], PRE) == [257, 258]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        plan_of(((),), (), [], "")
    with pytest.raises(ValueError, match="segments"):
        plan_of(((), ()), (), [], PRE)
    with pytest.raises(ValueError, match="index contents"):
        plan_of(((), ()), (1,), ["a"], PRE)
    with pytest.raises(TypeError):
        plan_of((["a"], ()), (0,), ["a"], PRE)


def test_the_structure_key_is_flags_roles_and_names() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "n"}]
    assert shape_of(msgs, True) == ((True, "system", ("user", "n")), ["s", "u"])
    assert shape_of([], False) == ((False,), [])
    for bad in ({"role": "user", "content": ["parts"]}, {"role": 1, "content": "x"},
                {"role": "user", "content": "x", "name": 2},
                {"role": "user", "content": "x", "tool_calls": []},
                {"role": "user", "content": "x", "name": "n", "other": 1},
                {"content": "x"}, "not a dict"):
        assert shape_of([msgs[0], bad], True) is None, bad

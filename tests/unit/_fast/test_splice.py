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
#: one memo for every example of the property test: pieces of other structures in it
_MEMO: list[str] = []


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
    # with a memo shared by every example (its pieces reused only where equal)
    assert plan_of(seg_plans, idx, contents, PRE, _MEMO) == got
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


def test_an_equal_piece_is_the_last_plans_object() -> None:
    segs = ((257, "system\n"), (258, 257, "user\n"), (258,))
    memo: list[str] = []
    sys_a = "be brief " * 50
    sys_b = "".join(["be brief "] * 50)         # equal, another object
    p1 = plan_of(segs, (0, 1), [sys_a, "one"], PRE, memo)
    p2 = plan_of(segs, (0, 1), [sys_b, "two"], PRE, memo)
    assert p1 == [257, "system\n" + sys_a, 258, 257, "user\none", 258]
    assert p2 == [257, "system\n" + sys_a, 258, 257, "user\ntwo", 258]
    assert p2[1] is p1[1] and memo == [p1[1], "user\ntwo"]
    p3 = plan_of(segs, (0, 1), ["be brief!", "é✓"], PRE, memo)       # changed: replaced
    assert p3 == [257, "system\nbe brief!", 258, 257, "user\né✓", 258]
    assert p3[1] is not p1[1] and memo == [p3[1], p3[4]]
    assert plan_of(segs, (0, 1), ["be brief!", "<|im_end|>"], PRE, memo) is None
    assert plan_of(segs, (0, 1), ["be brief!", "é✓"], PRE, memo)[4] is p3[4]
    # one character of the content differs, a narrow template text before a wide content
    assert plan_of(segs, (0, 1), ["be brief!", "é✔"], PRE, memo)[4] == "user\né✔"
    assert plan_of(segs, (0, 1), ["be brief!", "é✔"], PRE, memo)[4] is memo[1]
    assert plan_of(segs, (0, 1), ["be brief!", "\U0001F600"], PRE, memo)[4] == "user\n\U0001F600"


def test_a_known_structure_is_planned_in_one_call_as_plan_of_plans_it() -> None:
    """plan_known: NOT_KNOWN for a structure not in the table or not split yet, None for a
    chat that is not spliceable or a structure that does not cut, else plan_of's plan (with
    the entry's memo)."""
    from motor._fast.splice import NOT_KNOWN, plan_known

    class Entry:
        def __init__(self, splits, idx=(), memo=None):
            self.splits, self.idx, self.memo = splits, idx, memo if memo is not None else []

    missing = object()
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    key, contents = shape_of(msgs, True)
    splits = ((257, "system\n"), (258, "\n", 257, "user\n"), (258, "\n", 257, "assistant\n"))
    entry = Entry(splits, (0, 1))
    assert plan_known({}, msgs, True, "<|", missing) is NOT_KNOWN
    assert plan_known({key: Entry(missing)}, msgs, True, "<|", missing) is NOT_KNOWN
    assert plan_known({key: Entry(None)}, msgs, True, "<|", missing) is None
    assert plan_known({key: entry}, [{"role": "user", "content": 3}], True, "<|",
                      missing) is None
    got = plan_known({key: entry}, msgs, True, "<|", missing)
    assert got == plan_of(splits, (0, 1), contents, "<|", []) == \
        [257, "system\nsys", 258, "\n", 257, "user\nhi", 258, "\n", 257, "assistant\n"]
    assert entry.memo == ["system\nsys", "user\nhi"]
    again = plan_known({key: entry}, [dict(m) for m in msgs], True, "<|", missing)
    assert again[1] is got[1]                       # the memo's object again
    assert plan_known({key: entry}, msgs, False, "<|", missing) is NOT_KNOWN  # other flags
    assert plan_known({key: entry}, [msgs[0], {"role": "user", "content": "<|x"}], True,
                      "<|", missing) is None        # a content holds the prefix

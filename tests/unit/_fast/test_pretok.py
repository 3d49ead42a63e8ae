"""motor._fast.pretok: GPT-2's word split of ASCII text equals the regex the routing
tokenizer states it by (``_BYTE_LEVEL_ASCII``, itself tested equal to ``tokenizers``), and
the word-cached ids are the words' ids in order."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from motor._fast.pretok import encode_ascii_words, split_ascii_words
from motor.coordinator.tokenize import _BYTE_LEVEL_ASCII

#: one character of every class the split tells apart: letters (those of the contractions
#: among them), a digit, the six white-space characters, the apostrophe, other punctuation,
#: a control character that is not white space, DEL
_ALPHABET = "sdtmrevlaZ0 \t\n\x0b\x0c\r'!\x1c\x7f"


def test_every_short_text_over_the_classes_splits_as_the_regex() -> None:
    for n in range(5):
        for t in itertools.product(_ALPHABET[:12] if n == 4 else _ALPHABET, repeat=n):
            text = "".join(t)
            assert split_ascii_words(text) == _BYTE_LEVEL_ASCII.findall(text), repr(text)


_ascii = st.text(st.characters(max_codepoint=127), max_size=80)
_wordy = st.lists(st.sampled_from(["'s", "'t", "'re", "'ve", "'ll", "'m", "'d", "'x", "'",
                                   " ", "  ", "\n", "\n\n", " \n ", "a", "Bc", " de", "12",
                                   " 3", "!?", " ..", "\t", "\x0b", "\x1c"]),
                  max_size=20).map("".join)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.one_of(_ascii, _wordy))
def test_any_ascii_text_splits_as_the_regex(text: str) -> None:
    words = split_ascii_words(text)
    assert words == _BYTE_LEVEL_ASCII.findall(text)
    assert "".join(words) == text and all(words)


class Words:
    """A word cache whose miss may start a new generation (``cur`` replaced)."""

    def __init__(self, known: dict[str, list[int]], roll_every: int = 0) -> None:
        self.cur = dict(known)
        self.roll_every = roll_every
        self.missed: list[str] = []

    def miss(self, w: str) -> list[int]:
        self.missed.append(w)
        if self.roll_every and len(self.missed) % self.roll_every == 0:
            self.cur = {}
        ids = [len(w), ord(w[0])]
        self.cur[w] = ids
        return ids


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(_ascii, _wordy), st.sampled_from([0, 1, 2]))
def test_ids_are_the_words_ids_in_order_and_only_missing_words_are_computed(
        text: str, roll_every: int) -> None:
    words = _BYTE_LEVEL_ASCII.findall(text)
    known = {w: [i] for i, w in enumerate(words[::2])}
    c = Words(known, roll_every)
    got = encode_ascii_words(text, c, c.miss)
    want: list[int] = []
    cur, missed = dict(known), []
    for w in words:
        if w not in cur:
            missed.append(w)
            if roll_every and len(missed) % roll_every == 0:
                cur = {}
            cur[w] = [len(w), ord(w[0])]
        want += cur[w]
    assert got == want and c.missed == missed


def _ids(w: str) -> list[int]:
    return [len(w), *map(ord, w)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.one_of(_ascii, _wordy), max_size=6), st.sampled_from([1, 2, 4, 64]))
def test_the_table_of_recent_words_gives_the_words_ids(texts: list[str], slots: int) -> None:
    from motor._fast.pretok import WordIds
    front = WordIds(slots)
    c = Words({})
    c.miss = lambda w: c.cur.setdefault(w, _ids(w))     # type: ignore[method-assign]
    for text in texts * 2:
        want = [t for w in _BYTE_LEVEL_ASCII.findall(text) for t in _ids(w)]
        assert encode_ascii_words(text, c, c.miss, front) == want
        if len(c.cur) > 3:
            c.cur.clear()                               # the cache forgets; the table not
    assert len(front) <= slots


def test_a_recent_word_needs_no_cache_look_up() -> None:
    from motor._fast.pretok import WordIds
    front = WordIds(64)
    c = Words({})
    assert encode_ascii_words("ab cd", c, c.miss, front) == [2, 97, 3, 32] and \
        c.missed == ["ab", " cd"]
    c.cur.clear()                                       # not in the cache any more
    assert encode_ascii_words("ab cd", c, c.miss, front) == [2, 97, 3, 32]
    assert c.missed == ["ab", " cd"] and len(front) == 2
    with pytest.raises(ValueError, match="power of two"):
        WordIds(3)


def test_non_ascii_text_is_refused() -> None:
    with pytest.raises(ValueError, match="ASCII"):
        split_ascii_words("x\u00e9y")
    c = Words({})
    with pytest.raises(ValueError, match="ASCII"):
        encode_ascii_words("\u00e9", c, c.miss)
    assert split_ascii_words("") == [] and encode_ascii_words("", c, c.miss) == []


def test_what_the_miss_raises_goes_through() -> None:
    def boom(w: str) -> list[int]:
        raise KeyError(w)
    with pytest.raises(KeyError):
        encode_ascii_words("a b", Words({}), boom)


# -- the split at added tokens ---------------------------------------------------------

#: token sets: ChatML's; one where a token is another's prefix and one is the common prefix
#: itself; Latin-1 names; names wider than one byte a character
_TOKEN_SETS = [
    {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258},
    {"<|": 5, "<|a|>": 6, "<|a|>b": 7, "<|ab": 8, "<|b": 9},
    {"\u00e9<": 1, "\u00e9<x>": 2, "\u00e9<xy>": 3},
    {"<\u65e5": 11, "<\u65e5\u672c>": 12, "<x>": 13},
]


def _reference(text: str, added: dict[str, int]) -> list[str | int]:
    from motor.coordinator.tokenize import _capturing
    parts = _capturing(added).split(text)
    return [added[p] if i & 1 else p for i, p in enumerate(parts) if p]


def _args(added: dict[str, int]) -> tuple[str, tuple[str, ...], dict[str, int]]:
    import os
    names = tuple(sorted(added, key=len, reverse=True))
    return os.path.commonprefix(names), names, added


_fragments = st.sampled_from(["<", "|", ">", "<|", "|>", "<|im_", "im_end", "<|im_end|>",
                              "<|im_start|>", "<|endoftext|>", "a", "b", "ab", "<|a|>", "x",
                              "\u00e9", "\u00e9<", "<x>", "xy>", "<\u65e5", "\u672c>", "\u65e5",
                              "\n", " ", "system\n", "user"])


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.sampled_from(range(len(_TOKEN_SETS))),
       st.one_of(st.lists(_fragments, max_size=16).map("".join), st.text(max_size=30)))
def test_the_split_at_added_tokens_is_the_regexs(which: int, text: str) -> None:
    from motor._fast.pretok import split_added
    added = _TOKEN_SETS[which]
    got = split_added(text, *_args(added))
    assert got == _reference(text, added)


def test_the_split_needs_a_prefix() -> None:
    from motor._fast.pretok import split_added
    with pytest.raises(ValueError, match="prefix"):
        split_added("a", "", ("a",), {"a": 1})

"""motor._fast.bpe: the compiled merges of a byte-level BPE give the ids the ``tokenizers``
model gives the same word (``Model.tokenize`` of the word in the byte-level alphabet), with
the merge list in either of its formats and with ``ignore_merges`` either way."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from motor._fast.bpe import ByteLevelBpe, byte_level
from motor.coordinator.tokenize import _BYTE_CHARS, compiled_bpe

#: the letters the trained model's merges are made of, digits, the apostrophe, and the
#: characters the alphabet moves (space, newline, DEL, a control character)
_CHARS = "abcdefgh 1'\n\x7f\x01Z"


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    """The ``model`` of a byte-level BPE trained here on random words over a few letters
    (so its merges nest deeply and compete: many of ~600 ranks apply to one word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefgh '1") for _ in range(rng.randint(1, 12)))
             for _ in range(3000)]
    tk.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, 3000, 20)] * 3,
                           trainers.BpeTrainer(vocab_size=900,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model: dict[str, Any] = json.loads(tk.to_str())["model"]
    assert len(model["merges"]) > 500
    return model


def _library(model: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, models
    return Tokenizer(models.BPE(model["vocab"], [tuple(m) for m in model["merges"]],
                                ignore_merges=model.get("ignore_merges", False))).model


_words = st.text(st.sampled_from(_CHARS), max_size=300)    # > 64: the arrays on the heap;
#                                                             > 256: the library's


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(_words, min_size=1, max_size=8))
def test_the_ids_of_any_word_are_the_librarys(trained: dict[str, Any], words: list[str]) -> None:
    for ignore in (False, True):
        model = dict(trained, ignore_merges=ignore)
        lib, bpe = _library(model), ByteLevelBpe(model["vocab"], model["merges"], ignore)
        for w in words:
            want = [t.id for t in lib.tokenize(byte_level(w))]
            assert bpe.encode(w) == (want if len(w) <= 256 else None), (ignore, w)


def test_ignore_merges_takes_a_whole_word_from_the_vocabulary(trained: dict[str, Any]) -> None:
    vocab = dict(trained["vocab"], **{"habe": 5000})      # a token no merge sequence makes
    merged = ByteLevelBpe(vocab, trained["merges"]).encode("habe")
    assert merged is not None and len(merged) > 1
    assert ByteLevelBpe(vocab, trained["merges"], True).encode("habe") == [5000]


def test_both_merge_formats_and_a_repeated_merge_rank_alike(trained: dict[str, Any]) -> None:
    pairs = trained["merges"]
    legacy = [f"{a} {b}" for a, b in pairs]
    words = ["".join(random.Random(i).choice(_CHARS) for _ in range(i % 20)) for i in range(300)]
    a, b = ByteLevelBpe(trained["vocab"], pairs), ByteLevelBpe(trained["vocab"], legacy)
    assert a.n_merges == b.n_merges == len(pairs)
    assert [a.encode(w) for w in words] == [b.encode(w) for w in words]
    # a merge listed again keeps its last rank, as the library's map does
    again = pairs + [pairs[0]]
    lib = _library(dict(trained, merges=again))
    c = ByteLevelBpe(trained["vocab"], again)
    assert c.n_merges == len(pairs)
    assert [c.encode(w) for w in words] == [[t.id for t in lib.tokenize(byte_level(w))]
                                            for w in words]


def test_a_character_without_a_token_or_a_long_word_is_left_to_the_library() -> None:
    bpe = ByteLevelBpe({"a": 0, "b": 1, "ab": 2}, ["a b"])
    assert bpe.encode("ab") == [2] and bpe.encode("aba") == [2, 0]
    assert bpe.encode("ac") is None and bpe.encode("") == []
    # merging rescans the pairs (quadratic): a word past 256 characters is the library's
    assert bpe.encode("ab" * 128) == [2] * 128 and bpe.encode("ab" * 128 + "a") is None
    with pytest.raises(ValueError, match="ASCII"):
        bpe.encode("é")


@pytest.mark.parametrize(("merges", "match"), [
    (["a"], "two tokens"), (["a b c"], "two tokens"), (["a x"], "not in the vocabulary"),
    ([["b", "b"]], "not in the vocabulary")])
def test_a_bad_merge_list_is_refused(merges: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ByteLevelBpe({"a": 0, "b": 1, "ab": 2}, merges)


def test_a_vocabulary_with_a_shared_id_is_refused() -> None:
    # the library loads it and tells a stale merge by its result's id alone, so its ids
    # differ ("caca": the library's [14, 0], merged here [2, 14]): left to the library
    with pytest.raises(ValueError, match="its own id"):
        ByteLevelBpe({"a": 0, "b": 1, "ab": 2, "c": 2}, ["a b"])


def test_the_byte_level_alphabet_is_the_routing_tokenizers() -> None:
    text = "".join(map(chr, range(128)))
    assert byte_level(text) == text.translate(_BYTE_CHARS)
    assert byte_level("plain") == "plain"


def test_the_routing_tokenizer_compiles_only_models_it_can_apply(trained: dict[str, Any]
                                                                 ) -> None:
    tj = {"model": dict(trained, type="BPE")}
    assert isinstance(compiled_bpe(tj), ByteLevelBpe)
    assert compiled_bpe({"model": dict(trained, continuing_subword_prefix="##")}) is None
    assert compiled_bpe({"model": dict(trained, end_of_word_suffix="</w>")}) is None
    assert compiled_bpe({"model": dict(trained, merges=[["zz", "q"]])}) is None

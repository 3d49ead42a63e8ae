"""Type stubs for motor._fast.pretok (GPT-2's word split of ASCII text, word-cached ids)."""
from collections.abc import Callable
from typing import Any

from motor._fast.bpe import ByteLevelBpe

def split_ascii_words(text: str) -> list[str]:
    """The words (pre-tokens) of ASCII ``text`` in order; ValueError when not ASCII."""

class WordIds:
    """Direct-mapped table of recent words and their ids (``slots``: a power of two)."""
    def __init__(self, slots: int = 4096) -> None: ...
    def __len__(self) -> int: ...

def encode_ascii_words(text: str, words: Any, miss: Callable[[str], list[int]],
                       front: WordIds | None = None) -> list[int]:
    """The concatenated ids of ``text``'s words from ``front``, else ``words.cur`` (dict),
    else ``miss(word)``; ValueError when not ASCII."""

def split_added(text: str, prefix: str, names: tuple[str, ...],
                ids: dict[str, int]) -> list[str | int]:
    """``text`` cut at its added tokens (``names`` longest first, all starting with
    ``prefix``): non-empty text pieces and token ids in order."""

class ByteLevelMiss:
    """``encode_ascii_words``' ``miss`` for a byte-level BPE: a word's ids from ``words.old``
    (moved to ``words.cur``), else ``model.tokenize`` of its bytes in the byte-level
    alphabet (kept in ``words.cur``, generations as ``WordCache``'s); with ``bpe``, its
    compiled merges instead of ``model`` (which still takes a word with no token there)."""
    def __init__(self, words: Any, model: Any, bpe: ByteLevelBpe | None = None) -> None: ...
    def __call__(self, word: str) -> list[int]: ...

"""Type stubs for motor._fast.bpe (a byte-level BPE model's merges over ASCII words)."""
from collections.abc import Sequence

def byte_level(word: str) -> str:
    """ASCII ``word`` in the byte-level alphabet; ValueError when not ASCII."""

class ByteLevelBpe:
    """The merges of a byte-level BPE model (``vocab``, ``merges`` in rank order as
    ``"a b"`` or ``[a, b]``, ``ignore_merges``); ValueError for a merge not in ``vocab``."""
    n_merges: int
    def __init__(self, vocab: dict[str, int], merges: Sequence[str | Sequence[str]],
                 ignore_merges: bool = False) -> None: ...
    def encode(self, word: str) -> list[int] | None:
        """The model's ids of ASCII ``word``; None when a character has no token;
        ValueError when not ASCII."""

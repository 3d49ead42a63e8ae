"""Type stubs for motor._fast.hashing (chained 64-bit block hashes)."""
from typing import Final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

#: A block whose recurrence yields 0 gets this hash instead (0 is the root sentinel).
HASH_ZERO_REMAP: Final[int]
#: True when compiled with -DMOTOR_DEBUG=1.
DEBUG: Final[bool]

# ndarray is listed apart from Buffer: numpy's stubs declare ndarray.__buffer__ only for
# Python >= 3.12, so under python_version = 3.11 an array is not a Buffer to mypy
_Tokens = Buffer | npt.NDArray[np.uint32] | list[int] | tuple[int, ...]

def block_hashes(
    tokens: _Tokens, block_size: int, parent: int = 0, extra: int = 0
) -> npt.NDArray[np.uint64]:
    """uint32[n] tokens -> uint64[n // block_size] chained block hashes (never 0)."""

def block_hashes_into(
    tokens: _Tokens,
    block_size: int,
    out: Buffer | npt.NDArray[np.uint64],
    parent: int = 0,
    extra: int = 0,
) -> int:
    """Write n // block_size hashes into out (uint64, writable); return the count."""

def hash_block(parent: int, tokens: _Tokens, extra: int = 0) -> int:
    """Hash of one block (len(tokens) is the block size) chained to parent."""

def extend_hashes(
    prefix: Buffer | npt.NDArray[np.uint64], tokens: _Tokens, block_size: int, extra: int = 0
) -> npt.NDArray[np.uint64]:
    """uint64[m] hashes of leading blocks + uint32[n] tokens after them -> uint64[m + n //
    block_size]: prefix, then the tokens' blocks chained to prefix[-1] (root when empty)."""

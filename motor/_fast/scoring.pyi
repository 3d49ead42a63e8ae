"""Type stubs for motor._fast.scoring (candidate cost and argmin)."""
from typing import Final

import numpy as np
import numpy.typing as npt

DEBUG: Final[bool]

_F64 = npt.NDArray[np.float64]
_Cands = npt.NDArray[np.int32] | npt.NDArray[np.int64] | None

def pick(
    overlap: npt.NDArray[np.int32],
    prompt_tokens: int,
    block_size: int,
    tier_credit: _F64,
    prefill_tokens: _F64,
    decode_tokens: _F64,
    queue: _F64,
    candidates: _Cands = None,
    w_prefill: float = 1.0,
    w_decode: float = 0.0,
    w_queue: float = 0.0,
    guard_factor: float = 0.0,
    start: int = 0,
    favored: int = -1,
    favored_credit: float = 0.0,
    guard_min_load: float = 0.0,
) -> tuple[int, float]:
    """(instance index, cost in prefill-token equivalents, without the favored one's
    credit); (-1, inf) without candidates."""

def costs(
    overlap: npt.NDArray[np.int32],
    prompt_tokens: int,
    block_size: int,
    tier_credit: _F64,
    prefill_tokens: _F64,
    decode_tokens: _F64,
    queue: _F64,
    out: _F64,
    candidates: _Cands = None,
    w_prefill: float = 1.0,
    w_decode: float = 0.0,
    w_queue: float = 0.0,
    guard_factor: float = 0.0,
    start: int = 0,
) -> int:
    """Fill out[k] with each candidate's cost; return the chosen position (-1 if k == 0)."""

def pick_ttft(
    overlap: npt.NDArray[np.int32],
    prompt_tokens: int,
    block_size: int,
    tier_credit: _F64,
    queued_tokens: _F64,
    running: _F64,
    rates: _F64,
    candidates: _Cands = None,
    chunk_tokens: float = 8192.0,
    start: int = 0,
    out: _F64 | None = None,
    favored: int = -1,
    favored_credit: float = 0.0,
    stall_weight: float = 0.0,
) -> tuple[int, float]:
    """(instance index, predicted TTFT in seconds); (-1, inf) without candidates."""

"""Type stubs for motor._fast.columns (per-candidate columns of a routing decision)."""
from typing import Any

import numpy as np
import numpy.typing as npt

def gather(
    cands: list[Any],
    slot_of: dict[str, int],
    match_out: npt.NDArray[np.int32] | None,
    local_loads: bool,
    favored_key: str | None = None,
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int32], npt.NDArray[np.float64] | None, int,
           int]:
    """(slots intp[k], overlap int32[k, 3], loads float64[3, k] or None, missing count,
    position of ``favored_key`` or -1)."""

def uncached(
    overlap: npt.NDArray[np.int32],
    prompt_tokens: float,
    block_size: float,
    tier_credit: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(uncached prompt tokens float64[k], cached share of the prompt float64[k])."""

def member_offsets(tp: type) -> tuple[int, int, int, int]:
    """Byte offsets at which :func:`gather` reads ``key`` and the three counters on
    instances of ``tp`` (-1: read with ``getattr``)."""

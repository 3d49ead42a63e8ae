"""Type stubs for motor._fast.kvpick (kv_affinity's token-cost decision in one call)."""
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from motor._fast.radix import PrefixIndex

_F64 = npt.NDArray[np.float64]

class TokenPick:
    def __init__(
        self,
        block_size: int,
        tier_credit: Sequence[float],
        w_prefill: float = 1.0,
        w_decode: float = 0.0,
        w_queue: float = 0.0,
        guard_factor: float = 0.0,
        guard_min_load: float = 0.0,
    ) -> None: ...
    def pick(
        self,
        cands: list[Any],
        slot_of: dict[str, int],
        hashes: npt.NDArray[np.uint64] | None,
        exact: PrefixIndex | None,
        approx: PrefixIndex | None,
        prompt_tokens: int,
        start: int,
        alt_start: int = -1,
        favored_key: str | None = None,
        favored_credit: float = 0.0,
        loads: tuple[_F64, _F64, _F64] | None = None,
    ) -> tuple[int, float, int, int, int, int] | None:
        """(position, cost, device, host, disk blocks, favored position) or None when a
        candidate has no slot."""

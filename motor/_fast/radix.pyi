"""Type stubs for motor._fast.radix (prefix index over chained block hashes)."""
from typing import Final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

TIER_DEVICE: Final[int]  # 0, accelerator memory (HBM)
TIER_HOST: Final[int]    # 1, host DRAM
TIER_DISK: Final[int]    # 2, disk / remote store
N_TIERS: Final[int]      # 3
DEBUG: Final[bool]
REMAP_IN_PLACE: Final[bool]

# ndarray is listed apart from Buffer: numpy's stubs declare ndarray.__buffer__ only for
# Python >= 3.12, so under python_version = 3.11 an array is not a Buffer to mypy
_Hashes = Buffer | npt.NDArray[np.uint64] | list[int] | tuple[int, ...]

class PrefixIndex:
    """Per instance and tier, which leading blocks of a prompt are cached."""

    @property
    def max_instances(self) -> int: ...
    @property
    def n_nodes(self) -> int:
        """Distinct block hashes stored."""
    @property
    def n_blocks(self) -> int:
        """(instance, tier, block) holdings stored."""
    @property
    def n_orphan_stores(self) -> int:
        """store() calls whose non-zero parent_hash the instance did not hold."""
    @property
    def last_store_time(self) -> float: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def node_capacity(self) -> int: ...
    @property
    def _debug_rebuilds(self) -> int: ...
    @property
    def _debug_grows(self) -> int: ...
    _shrink_budget: int
    @property
    def _shrinking(self) -> bool: ...
    @property
    def _debug_checks(self) -> int: ...
    def __init__(self, max_instances: int = 256) -> None: ...
    def store(
        self, instance: int, tier: int, parent_hash: int, block_hashes: _Hashes, now: float = 0.0
    ) -> int: ...
    def remove(self, instance: int, tier: int, block_hashes: _Hashes) -> int: ...
    def clear(self, instance: int) -> int: ...
    def evict_older_than(self, cutoff: float) -> int: ...
    def evict_to_cap(self, max_nodes: int) -> int: ...
    def match(
        self, block_hashes: _Hashes, out: npt.NDArray[np.int32] | None = None
    ) -> npt.NDArray[np.int32]:
        """int32[max_instances, 3]: leading cached blocks per instance, by fastest tier."""
    def match_into(self, block_hashes: _Hashes, out: npt.NDArray[np.int32]) -> int:
        """Fill out like match(); return the longest cached prefix in blocks."""
    def instance_blocks(self, instance: int) -> int: ...
    def holders(self, block_hash: int) -> list[tuple[int, int]]: ...
    def lru_hashes(self) -> npt.NDArray[np.uint64]: ...
    def _check_invariants(self) -> bool: ...

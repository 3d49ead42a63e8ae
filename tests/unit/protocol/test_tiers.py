"""Tier numbers: the Python definition (motor.protocol.kv_events) equals the compiled one."""
from __future__ import annotations

import numpy as np
import pytest

from motor._fast import radix, scoring
from motor.protocol import kv_events


def test_protocol_tiers_equal_the_radix_modules() -> None:
    assert (kv_events.TIER_DEVICE, kv_events.TIER_HOST, kv_events.TIER_DISK, kv_events.N_TIERS) \
        == (radix.TIER_DEVICE, radix.TIER_HOST, radix.TIER_DISK, radix.N_TIERS)
    assert len(kv_events.TIER_NAMES) == kv_events.N_TIERS


def test_match_output_and_scoring_have_n_tiers_columns() -> None:
    ix = radix.PrefixIndex(4)
    h = np.array([11, 12, 13], np.uint64)
    ix.store(1, kv_events.TIER_DEVICE, 0, h[:1])
    ix.store(1, kv_events.TIER_HOST, 11, h[1:2])
    ix.store(1, kv_events.TIER_DISK, 12, h[2:])
    out = ix.match(h)
    assert out.shape == (4, kv_events.N_TIERS)
    assert list(out[1]) == [1, 1, 1]
    credit = np.ones(kv_events.N_TIERS)
    n = np.zeros(4)
    pos, _ = scoring.pick(out, 48, 16, credit, n, n, n)
    assert pos == 1
    with pytest.raises(ValueError):
        scoring.pick(np.zeros((4, kv_events.N_TIERS + 1), np.int32), 48, 16,
                     np.ones(kv_events.N_TIERS + 1), n, n, n)


@pytest.mark.parametrize(("medium", "tier"), [
    (None, radix.TIER_DEVICE), ("GPU", radix.TIER_DEVICE), ("CPU", radix.TIER_HOST),
    ("STORAGE", radix.TIER_DISK)])
def test_media_map_to_the_radix_tiers(medium: str | None, tier: int) -> None:
    assert kv_events.tier_of_medium(medium) == tier

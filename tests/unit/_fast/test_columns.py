"""motor._fast.columns.gather: slots, overlap rows, local loads, missing keys, the favored key."""
from __future__ import annotations

import numpy as np
import pytest

from motor._fast.columns import gather, member_offsets, uncached
from motor.coordinator.endpoints import EndpointState


class Ep:
    def __init__(self, key: str, prefill: int = 0, decode: int = 0, inflight: int = 0) -> None:
        self.key = key
        self.inflight_prefill_tokens = prefill
        self.inflight_decode_tokens = decode
        self.inflight = inflight


def test_rows_follow_the_slots_and_loads_the_counters() -> None:
    m = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    eps = [Ep("a", 10, 20, 1), Ep("b", 0, 5, 2), Ep("c", 7.5, 0, 0)]   # a float counter too
    slots, ov, loads, missing, fav = gather(eps, {"a": 4, "b": 0, "c": 2}, m, True)
    assert slots.tolist() == [4, 0, 2] and slots.dtype == np.intp
    assert ov.tolist() == [m[4].tolist(), m[0].tolist(), m[2].tolist()]
    assert ov.dtype == np.int32 and ov.flags.c_contiguous
    assert loads.tolist() == [[10.0, 0.0, 7.5], [20.0, 5.0, 0.0], [1.0, 2.0, 0.0]]
    assert (missing, fav) == (0, -1)


def test_no_match_no_loads_and_keys_without_a_slot() -> None:
    eps = [Ep("a"), Ep("new"), Ep("b")]
    slots, ov, loads, missing, fav = gather(eps, {"a": 1, "b": 3}, None, False, "b")
    assert slots.tolist() == [1, -1, 3]
    assert not ov.any() and ov.shape == (3, 3)
    assert loads is None
    assert (missing, fav) == (1, 2)


def test_the_favored_key_is_found_by_value_first_position() -> None:
    eps = [Ep("x#0"), Ep("y#0"), Ep("y#0")]
    key = "".join(["y", "#0"])          # equal, not the same object
    assert gather(eps, {}, None, False, key)[4] == 1
    assert gather(eps, {}, None, False, "z#0")[4] == -1
    assert gather([], {}, None, True, "y#0")[3:] == (0, -1)


def test_bad_inputs_are_named() -> None:
    m = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="slot of 'a' is expected to be in 0..1, got 2"):
        gather([Ep("a")], {"a": 2}, m, False)
    with pytest.raises(TypeError, match="dtype int32"):
        gather([Ep("a")], {"a": 0}, m.astype(np.int64), False)
    with pytest.raises(ValueError, match=r"shape \(n_slots, 3\)"):
        gather([Ep("a")], {"a": 0}, np.zeros((2, 4), np.int32), False)
    with pytest.raises(TypeError, match="numpy int32 array"):
        gather([Ep("a")], {"a": 0}, [[0, 0, 0]], False)
    with pytest.raises(AttributeError):
        gather([object()], {}, None, False)
    with pytest.raises(TypeError, match="unhashable"):     # not taken for a missing slot
        gather([Ep([])], {"a": 0}, None, False)              # type: ignore[arg-type]
    bad = Ep("a")
    bad.inflight = "many"               # type: ignore[assignment]
    with pytest.raises(TypeError):
        gather([bad], {"a": 0}, None, True)


class Slotted:
    __slots__ = ("key", "inflight_prefill_tokens", "inflight_decode_tokens", "inflight")

    def __init__(self, key: str, prefill: float = 0, decode: float = 0,
                 inflight: float = 0) -> None:
        self.key = key
        self.inflight_prefill_tokens = prefill
        self.inflight_decode_tokens = decode
        self.inflight = inflight


class Looked(Slotted):
    __slots__ = ()

    def __getattribute__(self, name: str) -> object:
        return "k" if name == "key" else 3


def test_slot_members_are_read_at_their_offsets_anything_else_by_getattr() -> None:
    offs = member_offsets(EndpointState)
    assert min(offs) > 0 and len(set(offs)) == 4
    assert min(member_offsets(Slotted)) > 0
    assert member_offsets(Ep) == (-1, -1, -1, -1)          # a __dict__: getattr
    assert member_offsets(Looked) == (-1, -1, -1, -1)      # its own lookup

    class Prop(Slotted):
        __slots__ = ()
        inflight = property(lambda self: 42.0, lambda self, v: None)  # type: ignore[assignment]

    assert member_offsets(Prop)[3] == -1 and member_offsets(Prop)[0] == member_offsets(Slotted)[0]
    eps = [Slotted("a", 1, 2, 3), Prop("b", 4, 5, 6), Looked("c"), Ep("d", 7, 8, 9),
           Slotted("e", 10.5, 11, 12)]
    slots, _, loads, missing, fav = gather(eps, {"a": 0, "b": 1, "k": 2, "d": 3, "e": 4},
                                           None, True, "e")
    assert slots.tolist() == [0, 1, 2, 3, 4] and (missing, fav) == (0, 4)
    assert loads.tolist() == [[1, 4, 3, 7, 10.5], [2, 5, 3, 8, 11], [3, 42, 3, 9, 12]]


def test_a_changed_type_and_an_unset_slot_are_read_as_getattr_would() -> None:
    class Mine(Slotted):
        __slots__ = ()

    eps = [Mine("a", 1, 2, 3)]
    assert gather(eps, {}, None, True)[2][:, 0].tolist() == [1, 2, 3]
    Mine.inflight = property(lambda self: 77.0)            # type: ignore[assignment]
    assert gather(eps, {}, None, True)[2][:, 0].tolist() == [1, 2, 77]
    del Mine.inflight                                      # type: ignore[attr-defined]
    assert gather(eps, {}, None, True)[2][:, 0].tolist() == [1, 2, 3]
    Slotted.inflight_decode_tokens = property(lambda self: 5.0)   # type: ignore[assignment]
    try:                                                   # a base changed
        assert gather(eps, {}, None, True)[2][:, 0].tolist() == [1, 5, 3]
    finally:
        del Slotted.inflight_decode_tokens                 # type: ignore[attr-defined]
    half = Mine.__new__(Mine)
    half.key = "h"
    with pytest.raises(AttributeError, match="inflight_prefill_tokens"):
        gather([half], {}, None, True)
    assert gather([half], {"h": 0}, None, False)[0].tolist() == [0]


def test_uncached_tokens_and_cached_share_per_row() -> None:
    ov = np.array([[10, 0, 0], [0, 4, 4], [0, 0, 0], [100, 0, 0]], np.int32)
    credit = np.array([1.0, 0.5, 0.25])
    unc, share = uncached(ov, 320.0, 16.0, credit)
    # saved: 160, 16 * (2 + 1) = 48, 0, 1600 (more than the prompt)
    assert unc.tolist() == [160.0, 272.0, 320.0, 0.0]
    assert share.tolist() == [0.5, 0.4, 0.0, 1.0]
    assert uncached(ov[:0], 320.0, 16.0, credit)[0].shape == (0,)
    assert uncached(ov[2:3], 0.0, 16.0, credit)[1].tolist() == [0.0]   # an empty prompt


def test_uncached_names_bad_inputs() -> None:
    ov = np.zeros((2, 3), np.int32)
    credit = np.ones(3)
    with pytest.raises(ValueError, match="block_size"):
        uncached(ov, 10.0, 0.0, credit)
    with pytest.raises(ValueError, match="prompt_tokens"):
        uncached(ov, -1.0, 16.0, credit)
    with pytest.raises(TypeError, match="int32"):
        uncached(ov.astype(np.int64), 10.0, 16.0, credit)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        uncached(ov, 10.0, 16.0, np.ones(2))
    with pytest.raises(TypeError, match="numpy arrays"):
        uncached(ov, 10.0, 16.0, [1.0, 1.0, 1.0])

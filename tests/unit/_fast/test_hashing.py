"""motor._fast.hashing: compiled vs reference model, prefix property, input handling, quality."""
from __future__ import annotations

import array
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast import hashing
from . import reference as ref

MASK64 = (1 << 64) - 1


def _ref_module() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        block_hashes=lambda t, bs, parent=0, extra=0: ref.block_hashes(
            np.asarray(t).tolist() if not isinstance(t, list) else t, bs, parent, extra),
        hash_block=lambda p, t, extra=0: ref.hash_block(
            p, np.asarray(t).tolist() if not isinstance(t, list) else t, extra),
    )


@pytest.fixture(params=["compiled", "reference"])
def impl(request):
    """Each behaviour test runs against the compiled module and the reference model."""
    return hashing if request.param == "compiled" else _ref_module()


def as_ints(xs) -> list[int]:
    return [int(x) for x in xs]


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=70)
u64 = st.integers(0, MASK64)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 17), parent=u64, extra=u64)
def test_compiled_matches_reference(tokens, block_size, parent, extra):
    arr = np.array(tokens, dtype=np.uint32)
    got = as_ints(hashing.block_hashes(arr, block_size, parent, extra))
    assert got == ref.block_hashes(tokens, block_size, parent, extra)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40), parent=u64,
       extra=u64)
def test_hash_block_matches_reference(tokens, parent, extra):
    assert hashing.hash_block(parent, np.array(tokens, dtype=np.uint32), extra) == \
        ref.hash_block(parent, tokens, extra)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_equal_prefix_gives_equal_hashes_and_divergence_changes_the_rest(data, block_size):
    n_blocks = data.draw(st.integers(1, 6))
    a = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n_blocks * block_size,
                           max_size=n_blocks * block_size))
    pos = data.draw(st.integers(0, len(a) - 1))
    b = list(a)
    b[pos] = (b[pos] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    ha = as_ints(hashing.block_hashes(np.array(a, np.uint32), block_size))
    hb = as_ints(hashing.block_hashes(np.array(b, np.uint32), block_size))
    first_diff = pos // block_size
    assert ha[:first_diff] == hb[:first_diff]
    # From the first differing block on every hash differs (chaining); equal
    # collisions would be a 2**-64 event.
    assert all(x != y for x, y in zip(ha[first_diff:], hb[first_diff:]))


def test_only_full_blocks_are_hashed(impl):
    t = np.arange(37, dtype=np.uint32)
    assert len(impl.block_hashes(t, 16)) == 2
    assert len(impl.block_hashes(t[:15], 16)) == 0
    assert as_ints(impl.block_hashes(t, 16)) == as_ints(impl.block_hashes(t[:32], 16))


def test_hash_block_chains_like_block_hashes(impl):
    t = np.arange(1000, 1064, dtype=np.uint32)
    hs = as_ints(impl.block_hashes(t, 16, 7, 99))
    parent = 7
    for k in range(4):
        h = impl.hash_block(parent, t[k * 16:(k + 1) * 16], 99)
        assert h == hs[k]
        parent = h


def test_parent_continues_a_chain(impl):
    t = np.arange(64, dtype=np.uint32)
    full = as_ints(impl.block_hashes(t, 16))
    tail = as_ints(impl.block_hashes(t[32:], 16, parent=full[1]))
    assert tail == full[2:]


def test_extra_and_block_size_change_every_hash(impl):
    t = np.arange(64, dtype=np.uint32)
    base = as_ints(impl.block_hashes(t, 16))
    salted = as_ints(impl.block_hashes(t, 16, extra=1))
    assert all(x != y for x, y in zip(base, salted))
    # Same 8 tokens as one block of 8 vs. prefix of a block of 16: different hashes.
    assert impl.hash_block(0, t[:8]) != impl.hash_block(0, t[:16])


def test_zero_is_remapped_so_it_stays_the_root_sentinel():
    # mix13 is a bijection with mix13(0) == 0, so choose the parent that makes the
    # chained input 0: parent * MP == content  (mod 2**64).
    tokens = list(range(16))
    content = ref.content_hash(tokens)
    parent = (content * pow(ref._MP, -1, 1 << 64)) & MASK64
    assert hashing.hash_block(parent, np.array(tokens, np.uint32)) == hashing.HASH_ZERO_REMAP
    assert ref.hash_block(parent, tokens) == ref.HASH_ZERO_REMAP == hashing.HASH_ZERO_REMAP
    assert int(hashing.block_hashes(np.array(tokens, np.uint32), 16, parent)[0]) == \
        hashing.HASH_ZERO_REMAP


@pytest.mark.parametrize("make", [
    lambda xs: np.array(xs, dtype=np.uint32),
    lambda xs: memoryview(np.array(xs, dtype=np.uint32)),
    lambda xs: array.array("I", xs),
    lambda xs: list(xs),
    lambda xs: tuple(xs),
    lambda xs: np.repeat(np.array(xs, dtype=np.uint32), 2)[::2],  # strided -> copied
], ids=["ndarray", "memoryview", "array_I", "list", "tuple", "strided"])
def test_accepted_token_containers_give_the_same_hashes(make):
    xs = list(range(5, 5 + 48))
    expected = as_ints(hashing.block_hashes(np.array(xs, np.uint32), 16))
    assert as_ints(hashing.block_hashes(make(xs), 16)) == expected
    assert hashing.hash_block(0, make(xs[:16])) == expected[0]


@pytest.mark.parametrize("bad", [
    np.arange(32, dtype=np.int32),
    np.arange(32, dtype=np.uint64),
    np.arange(32, dtype=np.float32),
    array.array("i", range(32)),
    b"\x00" * 64,
    "abcd",
    12,
], ids=["int32", "uint64", "float32", "array_i", "bytes", "str", "int"])
def test_wrong_dtype_raises_type_error(bad):
    with pytest.raises(TypeError, match="tokens"):
        hashing.block_hashes(bad, 16)
    with pytest.raises(TypeError, match="tokens"):
        hashing.hash_block(0, bad)


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_not_positive_raises_value_error(impl, block_size):
    with pytest.raises(ValueError, match="block_size"):
        impl.block_hashes(np.arange(32, dtype=np.uint32), block_size)


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        hashing.block_hashes(np.zeros((2, 16), dtype=np.uint32), 16)
    with pytest.raises(ValueError, match="one block"):
        hashing.hash_block(0, np.zeros(0, dtype=np.uint32))
    with pytest.raises(OverflowError):
        hashing.block_hashes(np.zeros(16, dtype=np.uint32), 16, parent=-1)
    with pytest.raises(OverflowError):
        hashing.block_hashes([2**32], 1)


def test_block_hashes_into_writes_the_same_values():
    t = np.arange(100, dtype=np.uint32)
    out = np.zeros(8, dtype=np.uint64)
    assert hashing.block_hashes_into(t, 16, out, 3, 4) == 6
    assert as_ints(out[:6]) == as_ints(hashing.block_hashes(t, 16, 3, 4))
    assert as_ints(out[6:]) == [0, 0]
    with pytest.raises(ValueError, match="out"):
        hashing.block_hashes_into(t, 16, np.zeros(5, dtype=np.uint64))
    with pytest.raises(TypeError, match="out"):
        hashing.block_hashes_into(t, 16, np.zeros(8, dtype=np.int64))
    ro = np.zeros(8, dtype=np.uint64)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="out"):
        hashing.block_hashes_into(t, 16, ro)


def test_avalanche_one_flipped_input_bit_flips_about_half_the_output_bits():
    rng = np.random.default_rng(12345)
    print("seed 12345")
    n = 4000
    blocks = rng.integers(0, 2**32, size=(n, 16), dtype=np.uint32)
    flipped = blocks.copy()
    pos = rng.integers(0, 16, size=n)
    bit = rng.integers(0, 32, size=n).astype(np.uint32)
    flipped[np.arange(n), pos] ^= (np.uint32(1) << bit)
    a = hashing.block_hashes(blocks.ravel(), 16, parent=0)  # chained, compare per block below
    # Hash each block independently from the root so only the flip differs.
    ha = np.array([hashing.hash_block(0, blocks[i]) for i in range(n)], dtype=np.uint64)
    hb = np.array([hashing.hash_block(0, flipped[i]) for i in range(n)], dtype=np.uint64)
    diff = ha ^ hb
    bits = np.unpackbits(diff.view(np.uint8)).reshape(n, 64)
    per_output_bit = bits.mean(axis=0)
    assert 0.48 < bits.mean() < 0.52
    assert per_output_bit.min() > 0.4 and per_output_bit.max() < 0.6
    assert len(a) == n
    # Parent avalanche: flipping one parent bit.
    parents = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    pb = rng.integers(0, 64, size=n).astype(np.uint64)
    tok = blocks[0]
    hp = np.array([hashing.hash_block(int(p), tok) for p in parents], dtype=np.uint64)
    hq = np.array([hashing.hash_block(int(p) ^ (1 << int(b)), tok)
                   for p, b in zip(parents, pb)], dtype=np.uint64)
    pbits = np.unpackbits((hp ^ hq).view(np.uint8)).reshape(n, 64)
    assert 0.48 < pbits.mean() < 0.52
    assert pbits.mean(axis=0).min() > 0.4


def test_no_collisions_on_structured_inputs():
    # Low-entropy inputs: every block of 16 tokens from a 3-symbol vocabulary
    # (3**12 = 531441 distinct blocks, rest of the block constant), plus
    # sequential ids with block sizes 1..4 from the root.
    vocab = np.array([0, 1, 2], dtype=np.uint32)
    idx = np.arange(3**12)
    digits = np.stack([(idx // 3**k) % 3 for k in range(12)], axis=1)
    blocks = np.zeros((len(idx), 16), dtype=np.uint32)
    blocks[:, :12] = vocab[digits]
    hs = [hashing.hash_block(0, b) for b in blocks[:200000]]
    assert len(set(hs)) == len(hs)
    assert 0 not in hs
    seq = np.arange(200000, dtype=np.uint32)
    for bs in (1, 2, 3, 4):
        chained = hashing.block_hashes(seq, bs)
        assert len(np.unique(chained)) == len(chained)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.sampled_from([1, 3, 16]),
       st.integers(0, 8), st.sampled_from([0, 7, 2**64 - 1]))
def test_extend_hashes_continues_the_chain_of_the_leading_blocks(tokens, bs, k, extra):
    k = min(k, len(tokens) // bs)
    head = hashing.block_hashes(tokens[:k * bs], bs, 0, extra)
    got = hashing.extend_hashes(head, tokens[k * bs:], bs, extra)
    assert got.dtype == np.uint64
    assert got.tolist() == hashing.block_hashes(tokens, bs, 0, extra).tolist()
    strided = np.repeat(head, 2)[::2]                      # a strided prefix is copied
    assert hashing.extend_hashes(strided, np.array(tokens[k * bs:], np.uint32), bs,
                         extra).tolist() == got.tolist()


def test_extend_hashes_refuses_wrong_inputs():
    with pytest.raises(ValueError):
        hashing.extend_hashes(np.zeros(1, np.uint64), [1], 0)
    with pytest.raises(TypeError):
        hashing.extend_hashes(np.zeros(1, np.uint32), [1], 1)


def test_a_list_of_ints_hashes_as_its_array_and_bad_items_are_named():
    ids = [0, 1, 255, 2**16, 2**30 - 1, 2**30, 2**31, 2**32 - 1] * 3
    want = as_ints(hashing.block_hashes(np.array(ids, dtype=np.uint32), 4, 7, 9))
    assert as_ints(hashing.block_hashes(ids, 4, 7, 9)) == want
    assert as_ints(hashing.block_hashes(tuple(ids), 4, 7, 9)) == want
    assert as_ints(hashing.extend_hashes(np.zeros(0, np.uint64), ids, 4, 9)) == \
        as_ints(hashing.block_hashes(ids, 4, 0, 9))
    # bool is an int (its value), an int subclass too
    assert as_ints(hashing.block_hashes([True, False, 3, 4], 4)) == \
        as_ints(hashing.block_hashes([1, 0, 3, 4], 4))
    for bad in (-1, -(2**31), 2**32, 2**33 + 5, 2**64, -(2**70)):
        with pytest.raises(OverflowError):
            hashing.block_hashes([1, 2, bad, 4], 4)
    with pytest.raises(TypeError, match=r"tokens is expected to hold ints, got str \(tokens\[2\]\)"):
        hashing.block_hashes([1, 2, "3", 4], 4)
    with pytest.raises(TypeError, match=r"got float \(tokens\[0\]\)"):
        hashing.block_hashes((1.0,), 1)

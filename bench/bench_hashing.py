"""Benchmarks for motor._fast.hashing.

Budget (docs/design/architecture.md, issue 3): >= 1 G tokens/s on one core at
block_size 16 and 128, i.e. <= 1 ns per token; for the 1 M-token input below
that is <= 1.0 ms per call.

Run::

    .venv/bin/python -m pytest bench/bench_hashing.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
import numpy as np
import pytest

from motor._fast import hashing

pytestmark = pytest.mark.fast_core

N_TOKENS = 1 << 20


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(1)
    return rng.integers(0, 150_000, size=N_TOKENS, dtype=np.uint32)


@pytest.mark.parametrize("block_size", [16, 128], ids=lambda b: f"tokens={N_TOKENS},block_size={b}")
def test_block_hashes(benchmark, rate, tokens, block_size):
    benchmark.group = "hashing.block_hashes"
    out = benchmark(hashing.block_hashes, tokens, block_size)
    assert len(out) == N_TOKENS // block_size
    rate("tokens_per_s", N_TOKENS, digits=None)


@pytest.mark.parametrize("block_size", [16, 128], ids=lambda b: f"tokens={N_TOKENS},block_size={b}")
def test_block_hashes_into(benchmark, rate, tokens, block_size):
    benchmark.group = "hashing.block_hashes_into"
    out = np.empty(N_TOKENS // block_size, dtype=np.uint64)
    benchmark(hashing.block_hashes_into, tokens, block_size, out)
    rate("tokens_per_s", N_TOKENS, digits=None)


@pytest.mark.parametrize("n_tokens", [2048, 32768], ids=lambda n: f"tokens={n},block_size=16")
def test_block_hashes_prompt(benchmark, rate, tokens, n_tokens):
    """One prompt per call, including the Python call and result allocation."""
    benchmark.group = "hashing.block_hashes_prompt"
    t = tokens[:n_tokens].copy()
    benchmark(hashing.block_hashes, t, 16)
    rate("tokens_per_s", n_tokens, digits=None)


def test_hash_block(benchmark, tokens):
    """Single block from a KV event (list of 16 ints, as decoded from msgpack)."""
    benchmark.group = "hashing.hash_block"
    block = [int(x) for x in tokens[:16]]
    benchmark(hashing.hash_block, 12345, block)


def test_hash_block_ndarray(benchmark, tokens):
    benchmark.group = "hashing.hash_block"
    block = tokens[:16].copy()
    benchmark(hashing.hash_block, 12345, block)


@pytest.mark.parametrize("n_tokens", [32768], ids=lambda n: f"tokens={n},block_size=16,list")
def test_block_hashes_list_prompt(benchmark, tokens, n_tokens):
    """A 32k-token prompt as the tokenizer returns it (Python list of ints)."""
    benchmark.group = "hashing.block_hashes_prompt"
    t = [int(x) for x in tokens[:n_tokens]]
    benchmark(hashing.block_hashes, t, 16)

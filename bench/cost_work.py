"""The fixed workloads of the counted-cost gate (``bench/cost_gate.py``); one per run.

Not a pytest suite: ``cost_gate.py`` runs ``python bench/cost_work.py FIGURE`` under
``valgrind --tool=callgrind`` with collection toggled on only inside the compiled function
that FIGURE measures (``--toggle-collect``), so the count is that function's instructions
(argument parsing included), whatever the setup costs. Inputs are seeded and fixed.

``--fast-dir DIR``: load the ``motor._fast`` extension modules found in DIR instead of the
installed ones (a build to compare, e.g. one compiled with other flags).

Figures (what one run does inside the counted function):

* ``hashing.block_hashes``: ``block_hashes`` of 32768 tokens, block size 16 (one call);
* ``radix.match``: ``PrefixIndex.match`` of a 2048-block (32768-token) prompt against an
  index of 64 instances holding 1 M stored blocks (one call);
* ``scoring.pick``: ``pick`` over 64 candidates at 32768 prompt tokens (one call);
* ``ring.push_pop``: 10 000 ``push`` + 10 000 ``pop`` of 64-byte records (single process).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import uuid
from collections.abc import Callable

import numpy as np

#: figure -> (callgrind --toggle-collect patterns: the Cython wrappers counted)
TOGGLES: dict[str, tuple[str, ...]] = {
    "hashing.block_hashes": ("__pyx_pw_5motor_5_fast_7hashing_*block_hashes",),
    "radix.match": ("__pyx_pw_5motor_5_fast_5radix_11PrefixIndex_*match",),
    "scoring.pick": ("__pyx_pw_5motor_5_fast_7scoring_*pick",),
    "ring.push_pop": ("__pyx_pw_5motor_5_fast_4ring_4Ring_*push",
                      "__pyx_pw_5motor_5_fast_4ring_4Ring_*pop"),
}


def load_fast(fast_dir: str | None) -> None:
    """Put the extension modules of ``fast_dir`` in place of the installed ``motor._fast.*``."""
    if not fast_dir:
        return
    import motor._fast  # noqa: F401  (the package first, then its modules from fast_dir)
    for path in sorted(glob.glob(os.path.join(fast_dir, "*.so"))):
        name = "motor._fast." + os.path.basename(path).split(".", 1)[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--fast-dir: cannot load {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


def _tokens(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 150_000, size=n, dtype=np.uint32)


def hashing_block_hashes() -> None:
    from motor._fast.hashing import block_hashes
    out = block_hashes(_tokens(32768), 16)
    assert len(out) == 2048


def radix_match() -> None:
    from motor._fast.hashing import block_hashes
    from motor._fast.radix import PrefixIndex
    n_instances, chain_blocks = 64, 2048
    ix = PrefixIndex(n_instances)
    rng = np.random.default_rng(7)
    chains = []
    while ix.n_nodes < 1_000_000:   # 1 M stored blocks, in 2048-block prompts
        c = block_hashes(rng.integers(0, 150_000, size=chain_blocks * 16, dtype=np.uint32), 16)
        ix.store(len(chains) % n_instances, 0, 0, c, 1.0)
        chains.append(c)
    out = ix.match(chains[len(chains) // 2])
    assert out.shape[0] == n_instances and int(out.max()) == chain_blocks


def scoring_pick() -> None:
    from motor._fast.scoring import pick
    n = 64
    rng = np.random.default_rng(3)
    ov = rng.integers(0, 200, size=(n, 3), dtype=np.int32)
    credit = np.array([1.0, 0.8, 0.5])
    prefill = rng.integers(0, 20000, n).astype(np.float64)
    decode = rng.integers(0, 200000, n).astype(np.float64)
    queue = rng.integers(0, 10, n).astype(np.float64)
    cands = np.arange(n, dtype=np.int32)
    best, _ = pick(ov, 32768, 16, credit, prefill, decode, queue, cands, 1.0, 0.1, 500.0, 2.0, 7)
    assert 0 <= best < n


def ring_push_pop() -> None:
    from motor._fast.ring import RECORD_USER, Ring
    ring = Ring.create(f"motor-cost-{os.getpid()}-{uuid.uuid4().hex[:8]}", 1 << 20)
    try:
        payload = bytes(range(64))
        push, pop = ring.push, ring.pop
        for _ in range(10_000):
            push(RECORD_USER, payload)
            assert pop() is not None
    finally:
        ring.unlink()
        ring.close()


WORK: dict[str, Callable[[], None]] = {
    "hashing.block_hashes": hashing_block_hashes,
    "radix.match": radix_match,
    "scoring.pick": scoring_pick,
    "ring.push_pop": ring_push_pop,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("figure", choices=sorted(WORK))
    ap.add_argument("--fast-dir", help="load motor._fast extension modules from this folder")
    args = ap.parse_args()
    load_fast(args.fast_dir)
    WORK[args.figure]()


if __name__ == "__main__":
    main()

"""Instructions per routing decision at the compiled-core budget's size (issue 19), counted
under callgrind, and the same decisions timed per call.

Decisions (the inputs of ``bench/bench_pd_decision.py`` and ``bench/bench_kv_decision.py``,
32768 prompt tokens, 64 candidates):

* ``pd``: ``PairChooser.choose`` over 32 prefill x 32 decode endpoints (``pd-local``: with
  local prefill);
* ``kv-time`` / ``kv-tokens``: ``KvAffinity.pick`` over 64 endpoints with
  ``coordinator.kv.cost`` time / tokens (``-session``: with a session).

``count``: ``valgrind --tool=callgrind --toggle-collect=starmap_next`` around
``--calls`` decisions (after 100 uncounted ones): each decision runs inside one
``itertools.starmap`` step, so the count is the decisions' own instructions (the call
included), divided by ``--calls``. Deterministic for a build (``PYTHONHASHSEED=0``).
``time``: per-call ``perf_counter_ns`` p50 / p99 of ``--calls`` decisions, ``--runs``
times (wall clock: noisy on a shared machine).

Run::

    .venv/bin/python bench/decision_cost.py count            # every decision, 2000 calls
    .venv/bin/python bench/decision_cost.py time --runs 5
    .venv/bin/python bench/decision_cost.py count --only pd
    .venv/bin/python bench/decision_cost.py time --fast-dir DIR   # another build's modules

``--fast-dir DIR``: load the ``motor._fast`` extension modules found in DIR instead of the
installed ones (``bench/cost_work.py``'s ``load_fast``), to compare builds.

Needs ``valgrind`` (Debian package ``valgrind``) for ``count``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

DECISIONS = ("pd", "pd-local", "kv-time", "kv-tokens", "kv-time-session", "kv-tokens-session")


def decision(name: str, pool: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(function, arguments) of decision ``name`` (one of :data:`DECISIONS`)."""
    if name.startswith("pd"):
        from bench_pd_decision import joint_case
        j, info, ps, ds = joint_case(pool)
        return j.choose, (info, ps, ds, name == "pd-local")
    from bench_kv_decision import kv_case
    parts = name.split("-")
    policy, eps, info = kv_case(pool, parts[1], parts[-1] == "session")
    return policy.pick, (eps, info, None)


def _run(name: str, calls: int, fast_dir: str | None = None) -> None:
    """The counted body (in the child under callgrind): 100 decisions, then ``calls``
    decisions, each one ``starmap`` step."""
    from cost_work import load_fast
    load_fast(fast_dir)
    from motor.http.client import Pool
    pool = Pool("127.0.0.1", 9)
    f, args = decision(name, pool)
    for _ in range(100):
        f(*args)
    deque(itertools.starmap(f, itertools.repeat(args, calls)), maxlen=0)
    pool.close()


def count(name: str, calls: int, fast_dir: str | None = None) -> float:
    """Instructions per decision ``name`` under callgrind (``calls`` decisions counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                        "--toggle-collect=starmap_next", f"--callgrind-out-file={out}",
                        sys.executable, __file__, "_run", "--only", name, "--calls",
                        str(calls)] + (["--fast-dir", fast_dir] if fast_dir else []),
                       check=True, env=env, capture_output=True)
        with open(out) as fh:
            total = int(re.search(r"^totals: (\d+)", fh.read(), re.M).group(1))  # type: ignore[union-attr]
    return total / calls


def timed(name: str, calls: int) -> tuple[float, float]:
    """(p50, p99) microseconds per decision ``name`` over ``calls`` calls."""
    import numpy as np

    from motor.http.client import Pool
    pool = Pool("127.0.0.1", 9)
    f, args = decision(name, pool)
    for _ in range(100):
        f(*args)
    ns = np.empty(calls)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        f(*args)
        ns[i] = clock() - t0
    pool.close()
    return float(np.percentile(ns, 50)) / 1e3, float(np.percentile(ns, 99)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("count", "time", "_run"))
    ap.add_argument("--only", action="append", choices=DECISIONS,
                    help="this decision (repeatable; default all)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3, help="time: runs per decision")
    ap.add_argument("--fast-dir", help="load motor._fast extension modules from this folder")
    args = ap.parse_args()
    names = args.only or list(DECISIONS)
    if args.what == "_run":
        _run(names[0], args.calls, args.fast_dir)
        return
    if args.what == "time":
        from cost_work import load_fast
        load_fast(args.fast_dir)
    for name in names:
        if args.what == "count":
            print(f"{name:18s} {count(name, args.calls, args.fast_dir):10,.0f} instructions per decision",
                  flush=True)
        else:
            runs = [timed(name, args.calls) for _ in range(args.runs)]
            print(f"{name:18s} p50 " + " ".join(f"{a:5.1f}" for a, _ in runs) + "  p99 "
                  + " ".join(f"{b:5.1f}" for _, b in runs) + " us", flush=True)


if __name__ == "__main__":
    main()

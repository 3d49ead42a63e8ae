"""pytest-benchmark suites: ``pytest bench/`` collects every ``bench/bench_*.py`` suite.

pytest collects only ``test_*.py`` from a directory; the suites are named ``bench_*.py``
so that ``pytest`` (``testpaths = tests``) never runs them by accident. This conftest
collects them when ``bench/`` is given, with one marker per area:

* ``fast_core``: the compiled pieces (``motor._fast``: hashing, radix, scoring, ring);
* ``proxy``: the coordinator in front of fast fake backends (``bench_proxy.py``);
* ``routing``: the routing policies' per-request work (``bench_routing.py``).

``pytest bench/ -m proxy`` runs one area. Scripts that are not pytest-benchmark suites
(``bench_kv_routing.py``, ``cost_gate.py``, ``fast_backend.py``) are not collected.
``--benchmark-disable`` runs every benchmark body once without timing (CI does, so no suite
rots); the ``rate`` fixture then records nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: runnable scripts under bench/, never collected as suites
SCRIPTS = frozenset({"bench_kv_routing.py", "bench_kv_sweep.py", "bench_pd_routing.py"})


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    name = file_path.name
    if file_path.suffix != ".py" or not name.startswith("bench_") or name in SCRIPTS:
        return None
    if parent.session.isinitpath(file_path):
        return None        # named on the command line: pytest's own collector takes it
    return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture
def percentiles(benchmark: Any) -> Callable[[], None]:
    """``percentiles()`` after the run: ``extra_info`` ``p50_us`` / ``p99_us`` of the rounds
    (microseconds). Nothing when timing is off (``--benchmark-disable``)."""
    def record() -> None:
        if benchmark.stats is None:
            return
        import numpy as np
        data = np.asarray(benchmark.stats.stats.data)
        benchmark.extra_info["p50_us"] = round(float(np.percentile(data, 50)) * 1e6, 2)
        benchmark.extra_info["p99_us"] = round(float(np.percentile(data, 99)) * 1e6, 2)
    return record


@pytest.fixture(scope="module")
def idle_pool() -> Any:
    """A client pool to 127.0.0.1:9 that never connects (endpoints need one to exist)."""
    from motor.http.client import Pool
    p = Pool("127.0.0.1", 9)
    yield p
    p.close()


@pytest.fixture
def rate(benchmark: Any) -> Callable[..., None]:
    """``rate(key, amount, digits=0)``: ``extra_info[key]`` = ``amount`` / median seconds
    (``digits=None``: not rounded). Nothing when timing is off (``--benchmark-disable``)."""
    def record(key: str, amount: float, digits: int | None = 0) -> None:
        stats = benchmark.stats
        if stats is None:
            return
        v = amount / stats.stats.median
        benchmark.extra_info[key] = v if digits is None else round(v, digits or None)
    return record

"""``motor bench``: load generator for OpenAI-compatible endpoints (library + CLI).

Library use (e.g. from ``motor demo``)::

    from motor.bench import BenchConfig, run_bench, format_table

    result = await run_bench(BenchConfig(url="http://127.0.0.1:8000", num_requests=50))
    print(format_table(result))
    sys.exit(result.exit_status)       # 0: no failure; 1: some failed

Imports here are lazy (``motor bench --help`` must not pull in aiohttp).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "BenchConfig", "BenchError", "BenchResult", "MetricStats", "RequestResult",
    "build_dataset", "format_table", "run_bench", "to_json", "write_json",
]

_WHERE = {
    "BenchConfig": "motor.bench.config",
    "BenchError": "motor.bench.config",
    "BenchResult": "motor.bench.results",
    "MetricStats": "motor.bench.results",
    "RequestResult": "motor.bench.results",
    "build_dataset": "motor.bench.datasets",
    "format_table": "motor.bench.report",
    "to_json": "motor.bench.report",
    "write_json": "motor.bench.report",
    "run_bench": "motor.bench.runner",
}

if TYPE_CHECKING:
    from motor.bench.config import BenchConfig, BenchError
    from motor.bench.datasets import build_dataset
    from motor.bench.report import format_table, to_json, write_json
    from motor.bench.results import BenchResult, MetricStats, RequestResult
    from motor.bench.runner import run_bench


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'motor.bench' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(mod), name)

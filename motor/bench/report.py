"""Text table and JSON output of a :class:`BenchResult`."""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, TextIO

import orjson

from motor.bench.results import METRICS, BenchResult, MetricStats

if TYPE_CHECKING:
    from motor.bench.config import BenchConfig

COLUMNS = ("Average", "Min", "Max", "Median", "P75", "P90", "P99", "N")


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _row_label(s: MetricStats) -> str:
    return f"{s.name} ({s.unit})" if s.unit in ("ms", "tok/s") else s.name


def format_metrics_table(metrics: dict[str, MetricStats]) -> str:
    """The metrics table alone: one row per metric, the columns of :data:`COLUMNS`."""
    rows = [["Metric", *COLUMNS]]
    for name, _unit in METRICS:
        s = metrics[name]
        rows.append([_row_label(s), _num(s.average), _num(s.min), _num(s.max), _num(s.median),
                     _num(s.p75), _num(s.p90), _num(s.p99), str(s.n)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def format_summary(result: BenchResult) -> str:
    """The summary lines: requests, duration, throughputs, cached share, failures."""
    lines = [
        f"Requests ok / failed:           {result.completed} / {result.failed}",
        f"Duration:                       {result.duration:.2f} s",
        f"Request throughput:             {result.request_throughput:.2f} req/s",
        f"Output token throughput:        {result.output_throughput:.2f} tok/s",
        f"Total input / output tokens:    {result.total_input_tokens} / {result.total_output_tokens}",
    ]
    if result.cached_share is not None:
        lines.append(f"Cached-token share:             {100.0 * result.cached_share:.1f} %"
                     f" ({result.cached_tokens} of the prompt tokens)")
    if result.failed:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(result.failure_reasons.items()))
        lines.append(f"Failures by reason:             {reasons}")
        for msg in result.failure_messages:
            lines.append(f"  {msg}")
    return "\n".join(lines)


def describe_run(c: BenchConfig, model: str) -> str:
    """One line naming the run: target, model, dataset, load, streaming."""
    conc = c.effective_concurrency()
    load = (f"rate {c.request_rate:g} req/s" if c.request_rate else "closed loop") + \
        (f", concurrency {conc}" if conc else ", no concurrency cap")
    return (f"{c.target_url}  model={model}  dataset={c.dataset}  "
            f"{load}  {'stream' if c.stream else 'no-stream'}")


def format_table(result: BenchResult) -> str:
    """The full text report: a header line, the metrics table and the summary."""
    head = "motor bench: " + describe_run(result.config, result.model)
    return "\n".join([head, "", format_metrics_table(result.metrics), "", format_summary(result)])


def to_json(result: BenchResult) -> bytes:
    """The result as indented JSON (config, summary, metrics, requests)."""
    return orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)


def write_json(result: BenchResult, path: str, stdout: TextIO | None = None) -> None:
    """Write :func:`to_json` to ``path`` (``-`` for standard output)."""
    data = to_json(result)
    if path == "-":
        out = stdout or sys.stdout
        out.write(data.decode() + "\n")
        out.flush()
    else:
        with open(path, "wb") as f:
            f.write(data + b"\n")

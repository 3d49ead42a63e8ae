"""Per-request measurements, per-metric statistics and the run's result."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from motor.bench.config import BenchConfig

#: (name, unit) of every metric, in table order
METRICS: tuple[tuple[str, str], ...] = (
    ("E2EL", "ms"),
    ("TTFT", "ms"),
    ("TPOT", "ms"),
    ("ITL", "ms"),
    ("InputTokens", "tokens"),
    ("OutputTokens", "tokens"),
    ("OutputTokenThroughput", "tok/s"),
)

#: how many failure messages a result keeps verbatim
MAX_FAILURE_MESSAGES = 5


@dataclass
class RequestResult:
    """One request.  Times in seconds; ``start`` is relative to the run's start.

    ``ttft`` is None for non-streamed requests (no first token to time) and
    for streams that carried no content.  ``itl`` holds the gaps between
    consecutive content-bearing SSE chunks.  ``input_tokens`` /
    ``output_tokens`` come from the server's ``usage`` when it sent one,
    otherwise they are estimates (prompt bytes; number of content chunks for
    a stream, answer bytes otherwise) and ``usage_reported`` is False.
    ``cached_tokens`` is ``usage.prompt_tokens_details.cached_tokens`` or None.
    On failure ``ok`` is False and ``reason`` (a short category such as
    ``http_500``, ``timeout``, ``transport``, ``stream_error``, ``no_done``,
    ``malformed``) and ``error`` (a message) say why.
    """
    conversation: int
    turn: int
    ok: bool
    start: float = 0.0
    e2el: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    status: int | None = None
    reason: str | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1); None when undefined."""
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def output_throughput(self) -> float | None:
        """Output tokens per second of this request."""
        if self.output_tokens is None or self.e2el <= 0:
            return None
        return self.output_tokens / self.e2el

    @property
    def end(self) -> float:
        """When the answer ended (or the request failed), seconds after the run's start."""
        return self.start + self.e2el

    def to_dict(self) -> dict[str, Any]:
        """The JSON record of this request: times rounded to the microsecond, ``start_s`` /
        ``end_s`` in seconds after the run's start (send and end of the answer), the
        latencies in ms (``ttft_ms`` null when not measured, ``itl_ms`` the gaps)."""
        return {
            "conversation": self.conversation, "turn": self.turn, "ok": self.ok,
            "start_s": round(self.start, 6), "end_s": round(self.end, 6),
            "e2el_ms": round(self.e2el * 1000.0, 3),
            "ttft_ms": None if self.ttft is None else round(self.ttft * 1000.0, 3),
            "itl_ms": [round(g * 1000.0, 3) for g in self.itl],
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens, "usage_reported": self.usage_reported,
            "status": self.status, "reason": self.reason, "error": self.error,
        }


@dataclass(frozen=True)
class MetricStats:
    """Average, min, max, median, P75, P90, P99 and count of one metric.

    Percentiles use linear interpolation (numpy's default).  With no samples
    ``n`` is 0 and every statistic is NaN.
    """
    name: str
    unit: str
    average: float
    min: float
    max: float
    median: float
    p75: float
    p90: float
    p99: float
    n: int

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else float(x)
        return {"unit": self.unit, "average": num(self.average), "min": num(self.min),
                "max": num(self.max), "median": num(self.median), "p75": num(self.p75),
                "p90": num(self.p90), "p99": num(self.p99), "n": self.n}


def metric_stats(name: str, unit: str, values: Sequence[float]) -> MetricStats:
    """Statistics of ``values`` (any order)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        nan = float("nan")
        return MetricStats(name, unit, nan, nan, nan, nan, nan, nan, nan, 0)
    p50, p75, p90, p99 = np.percentile(a, [50, 75, 90, 99])
    return MetricStats(name, unit, float(a.mean()), float(a.min()), float(a.max()),
                       float(p50), float(p75), float(p90), float(p99), int(a.size))


def compute_metrics(requests: Sequence[RequestResult]) -> dict[str, MetricStats]:
    """Statistics of every metric of :data:`METRICS` over the successful requests."""
    ok = [r for r in requests if r.ok]
    ms = 1000.0
    samples: dict[str, list[float]] = {
        "E2EL": [r.e2el * ms for r in ok],
        "TTFT": [r.ttft * ms for r in ok if r.ttft is not None],
        "TPOT": [t * ms for r in ok if (t := r.tpot) is not None],
        "ITL": [g * ms for r in ok for g in r.itl],
        "InputTokens": [r.input_tokens for r in ok if r.input_tokens is not None],
        "OutputTokens": [r.output_tokens for r in ok if r.output_tokens is not None],
        "OutputTokenThroughput": [t for r in ok if (t := r.output_throughput) is not None],
    }
    return {name: metric_stats(name, unit, samples[name]) for name, unit in METRICS}


class BenchResult:
    """The outcome of a run: every request plus the summary numbers.

    Attributes: ``config``, ``model``, ``requests`` (list of
    :class:`RequestResult`), ``duration`` (s, first send to last answer),
    ``metrics`` (name -> :class:`MetricStats`), ``completed`` / ``failed``
    (counts), ``failure_reasons`` (reason -> count), ``failure_messages``
    (the most frequent distinct ones, ``(xN)`` when repeated), ``request_throughput`` (completed/s),
    ``output_throughput`` (output tok/s, all requests),
    ``total_input_tokens``, ``total_output_tokens``, ``cached_tokens`` and
    ``cached_share`` (cached prompt tokens / prompt tokens over the requests
    whose usage reported cached tokens; None when none did).
    """

    def __init__(self, config: BenchConfig, model: str, requests: list[RequestResult],
                 duration: float):
        self.config = config
        self.model = model
        self.requests = requests
        self.duration = duration
        self.metrics = compute_metrics(requests)
        ok = [r for r in requests if r.ok]
        bad = [r for r in requests if not r.ok]
        self.completed = len(ok)
        self.failed = len(bad)
        self.failure_reasons: dict[str, int] = dict(Counter(r.reason or "unknown" for r in bad))
        # distinct messages, the most frequent first, each with its count when repeated
        counts = Counter(f"{r.reason}: {r.error}" for r in bad)
        self.failure_messages: list[str] = [
            msg if n == 1 else f"{msg} (x{n})"
            for msg, n in counts.most_common(MAX_FAILURE_MESSAGES)]
        self.total_input_tokens = sum(r.input_tokens or 0 for r in ok)
        self.total_output_tokens = sum(r.output_tokens or 0 for r in ok)
        self.request_throughput = self.completed / duration if duration > 0 else 0.0
        self.output_throughput = self.total_output_tokens / duration if duration > 0 else 0.0
        with_cache = [r for r in ok if r.cached_tokens is not None]
        self.cached_tokens: int | None = None
        self.cached_share: float | None = None
        if with_cache:
            self.cached_tokens = sum(r.cached_tokens or 0 for r in with_cache)
            prompt = sum(r.input_tokens or 0 for r in with_cache)
            self.cached_share = self.cached_tokens / prompt if prompt else 0.0

    @property
    def ok(self) -> bool:
        """True when no request failed and at least one completed."""
        return self.failed == 0 and self.completed > 0

    @property
    def exit_status(self) -> int:
        """0 when :attr:`ok`, else 1 (the CLI's exit status)."""
        return 0 if self.ok else 1

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "requests_completed": self.completed,
            "requests_failed": self.failed,
            "duration_s": self.duration,
            "request_throughput": self.request_throughput,
            "output_token_throughput": self.output_throughput,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_token_share": self.cached_share,
            "failure_reasons": dict(self.failure_reasons),
            "failure_messages": list(self.failure_messages),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: config, summary, per-metric statistics and one record per request
        (:meth:`RequestResult.to_dict`, in the order the requests ended)."""
        return {
            "config": self.config.to_dict(),
            "summary": self.summary(),
            "metrics": {name: s.to_dict() for name, s in self.metrics.items()},
            "requests": [r.to_dict() for r in self.requests],
        }

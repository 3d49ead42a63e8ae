"""Load figures read from an engine's Prometheus ``GET /metrics`` text (exposition format
0.0.4: ``name{labels} value`` lines, ``#`` comments).

The gauges read, by column of :func:`parse_engine_metrics`' answer:

==========  ===============================  =============================
column      vLLM                             SGLang
==========  ===============================  =============================
waiting     ``vllm:num_requests_waiting``    ``sglang:num_queue_reqs``
running     ``vllm:num_requests_running``    ``sglang:num_running_reqs``
KV usage    ``vllm:kv_cache_usage_perc``,    ``sglang:token_usage``
            ``vllm:gpu_cache_usage_perc``
==========  ===============================  =============================

Sources: vLLM's Prometheus stat logger (``vllm/v1/metrics/loggers.py``; the V0 engine,
``vllm/engine/metrics.py``, named the KV-cache gauge ``vllm:gpu_cache_usage_perc``),
SGLang's metrics collector (``python/sglang/srt/metrics/collector.py``, listed in its
``docs/references/production_metrics.md``). KV usage is a fraction, 0..1, in both.
``motor sim`` publishes the vLLM names (:mod:`motor.sim.metrics`).
"""
from __future__ import annotations

#: columns of :func:`parse_engine_metrics`' answer
WAITING, RUNNING, KV_USAGE = 0, 1, 2

VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_V0 = "vllm:gpu_cache_usage_perc"
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"

#: metric name -> column
ENGINE_METRICS: dict[str, int] = {
    VLLM_WAITING: WAITING, SGLANG_WAITING: WAITING,
    VLLM_RUNNING: RUNNING, SGLANG_RUNNING: RUNNING,
    VLLM_KV_USAGE: KV_USAGE, VLLM_KV_USAGE_V0: KV_USAGE, SGLANG_KV_USAGE: KV_USAGE,
}


def parse_engine_metrics(text: str) -> tuple[float, float, float]:
    """(waiting requests, running requests, KV usage 0..1) from an engine's Prometheus
    text: the samples of each column summed over their label sets (and over both names
    of a column), KV usage averaged over its samples. A column without samples is 0;
    lines that do not parse are skipped (never raises)."""
    vals = [0.0, 0.0, 0.0]
    n_kv = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        col = ENGINE_METRICS.get(name)
        if col is None:
            continue
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        vals[col] += v
        n_kv += col == KV_USAGE
    if n_kv > 1:
        vals[KV_USAGE] /= n_kv
    return vals[WAITING], vals[RUNNING], vals[KV_USAGE]


__all__ = [
    "ENGINE_METRICS",
    "KV_USAGE",
    "RUNNING",
    "SGLANG_KV_USAGE",
    "SGLANG_RUNNING",
    "SGLANG_WAITING",
    "VLLM_KV_USAGE",
    "VLLM_KV_USAGE_V0",
    "VLLM_RUNNING",
    "VLLM_WAITING",
    "WAITING",
    "parse_engine_metrics",
]

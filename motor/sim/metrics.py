"""Prometheus metrics of the simulator, under vLLM's names (V ``v1/metrics/loggers.py``).

Every metric carries the labels ``model_name`` and ``engine`` (``"0"``). Each
:class:`SimMetrics` owns its :class:`~prometheus_client.CollectorRegistry`, so several
simulators can live in one process (tests) without clashing. Gauges are set when
``/metrics`` is scraped (:meth:`SimMetrics.render`), not on every engine step.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from motor.protocol.engine_metrics import VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    m = 1
    while True:
        for k in (1, 2, 5):
            v = k * m
            if v > max_model_len:
                return out
            out.append(float(v))
        m *= 10


class SimMetrics:
    """The simulator's metrics, with label values bound once."""

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0") -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": engine}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**lv)

        # the load gauges the coordinator reads (motor.protocol.engine_metrics)
        self.num_requests_running = gauge(VLLM_RUNNING,
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(VLLM_WAITING,
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(VLLM_KV_USAGE,
                                         "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(finished_reason=reason, **lv)
                                for reason in FINISHED_REASONS}
        tok_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens",
                                          "Number of prefill tokens processed.", tok_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Number of generation tokens processed.",
                                              tok_buckets)
        self.time_to_first_token = hist("vllm:time_to_first_token_seconds",
                                        "Histogram of time to first token in seconds.",
                                        TTFT_BUCKETS)
        self.inter_token_latency = hist("vllm:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.",
                                        ITL_BUCKETS)
        self.e2e_request_latency = hist("vllm:e2e_request_latency_seconds",
                                        "Histogram of e2e request latency in seconds.",
                                        LATENCY_BUCKETS)
        self.request_queue_time = hist("vllm:request_queue_time_seconds",
                                       "Histogram of time spent in WAITING phase for request.",
                                       LATENCY_BUCKETS)
        self.request_prefill_time = hist("vllm:request_prefill_time_seconds",
                                         "Histogram of time spent in PREFILL phase for request.",
                                         LATENCY_BUCKETS)
        self.request_decode_time = hist("vllm:request_decode_time_seconds",
                                        "Histogram of time spent in DECODE phase for request.",
                                        LATENCY_BUCKETS)

    def render(self, running: int, waiting: int, kv_usage: float) -> bytes:
        """The text exposition, with the gauges set to the given current values."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage_perc.set(kv_usage)
        return generate_latest(self.registry)

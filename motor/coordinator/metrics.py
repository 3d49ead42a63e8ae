"""Every metric of the coordinator, declared in one place (``motor_coordinator_*``), and
their ``/metrics`` text (:func:`render_metrics`)."""
from __future__ import annotations

import os
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from motor.config.schema import Role
from motor.coordinator import mpvalues

# one process: prometheus values without the library's per-update lock (mpvalues); before
# the first metric is made (multiprocess mode: the children install theirs before import)
mpvalues.install_in_process()

REGISTRY = CollectorRegistry(auto_describe=True)

#: prometheus-client's multiprocess mode (``coordinator.workers > 1``: every worker writes
#: its samples to files in ``PROMETHEUS_MULTIPROC_DIR``, read once at import as the client
#: does): gauges there must be set as they change, not computed at scrape time
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 120.0, 300.0)

REQUESTS = Counter(
    "motor_coordinator_requests_total",
    "Requests answered, by route and HTTP status sent to the client "
    "(a stream that ended with an SSE error event counts under the error's status).",
    ["route", "status"], registry=REGISTRY)
#: several workers: summed over the live ones (a dead worker's requests died with it; the
#: library's default mode "all" kept its last value as a series of its own, for good)
INFLIGHT = Gauge(
    "motor_coordinator_inflight_requests",
    "Requests in flight per endpoint.", ["instance", "endpoint"], registry=REGISTRY,
    multiprocess_mode="livesum")
RETRIES = Counter(
    "motor_coordinator_retries_total",
    "Attempts re-sent to another endpoint before the first byte reached the client, by reason.",
    ["reason"], registry=REGISTRY)
UPSTREAM_ERRORS = Counter(
    "motor_coordinator_upstream_errors_total",
    "Upstream failures by endpoint and kind (connect, timeout, closed, status).",
    ["endpoint", "kind"], registry=REGISTRY)
ENDPOINTS = Gauge(
    "motor_coordinator_endpoints",
    "Endpoints known, by role and whether they are routable (1) or not (0).",
    ["role", "routable"], registry=REGISTRY)
TABLE_VERSION = Gauge(
    "motor_coordinator_instance_table_version",
    "Version of the controller's instance table last applied (0 in standalone mode).",
    registry=REGISTRY)

# -- per instance: the latency each instance gives (children cached by instance_timing) ---
#: TPOT buckets: 0.5 ms to 2.5 s per token
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 1.0, 2.5)


class LoopHistogramChild:
    """One label set of a :class:`LoopHistogram`: counts per bucket and the sum, in plain
    Python numbers (no lock: only the worker's event-loop thread observes)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """Count ``amount`` (seconds) in the first bucket whose bound is >= it."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


def counter_inc(child: Any) -> Any:
    """The update of a ``Counter`` child for a caller that counts on every request:
    ``inc(amount)`` of the child's value itself (the compiled or file-backed value that
    :mod:`motor.coordinator.mpvalues` installed), without the library's checks around it
    (a child is always observable; callers add positive amounts); the child's own ``inc``
    when it has no such value."""
    value = getattr(child, "_value", None)
    inc = getattr(value, "inc", None)
    return inc if inc is not None else child.inc


try:
    from motor._fast.metricvalue import BucketCounts as _BucketCounts
except ImportError:  # pragma: no cover - the extensions not built: the Python class
    _BucketCounts = None  # type: ignore[assignment, misc]

#: the children :class:`LoopHistogram` makes: :class:`LoopHistogramChild` compiled
#: (``motor._fast.metricvalue.BucketCounts``, the same counts for the same observations)
#: when the extension is built
LOOP_CHILD: Any = _BucketCounts if _BucketCounts is not None else LoopHistogramChild


class LoopHistogram:
    """A histogram for one process, for series observed on every request: an observation
    is a ``bisect`` and two additions (about 0.1 us), where prometheus-client's
    ``Histogram`` child takes two locks (about 0.6 us). Exposed like a ``Histogram``
    (``_bucket{le}`` cumulative, ``_sum``, ``_count``; no ``_created``). With
    ``PROMETHEUS_MULTIPROC_DIR`` set use a ``Histogram`` instead (:func:`_histogram`):
    only it writes the shared files."""

    def __init__(self, name: str, documentation: str, labelnames: list[str],
                 buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        """The child of ``values`` (one per label name, in order), made on first use.

        Raises
        ------
        ValueError
            when the number of values is not the number of label names.
        """
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self.name}: expected {len(self._labelnames)} label values "
                             f"{self._labelnames}, got {len(values)}")
        key = tuple(str(v) for v in values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = LOOP_CHILD(self.bounds)
        return c

    def remove(self, *values: str) -> None:
        """Drop the child of ``values``.

        Raises
        ------
        KeyError
            when there is none.
        """
        del self._children[tuple(str(v) for v in values)]

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self._labelnames)]

    def collect(self) -> list[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self._labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, c in list(self._children.items()):
            acc, cum = 0, []
            for le, n in zip(les, c.counts):
                acc += n
                cum.append((le, acc))
            fam.add_metric(list(key), cum, c.sum)
        return [fam]


try:
    from motor._fast.metricvalue import MmapBuckets as _MmapBuckets
    from motor._fast.metricvalue import MmapCount as _MmapCount
except ImportError:  # pragma: no cover - the extensions not built
    _MmapBuckets = None  # type: ignore[assignment, misc]
    _MmapCount = None  # type: ignore[assignment, misc]


def gauge_counter(child: Any) -> Any:
    """What counts a multiprocess ``Gauge`` child up and down by one on every request:
    :class:`motor._fast.metricvalue.MmapCount` over its value (the same writes as its
    ``inc()`` / ``dec()``, from C) when that value is the compiled one, else the child."""
    if _MmapCount is None:
        return child
    value: Any = getattr(child, "_value", None)
    try:
        return _MmapCount(value)
    except TypeError:       # the library's own value (mpvalues not compiled)
        return child


class MpHistogram:
    """A prometheus-client ``Histogram`` (multiprocess mode) whose children, as
    :meth:`labels` gives them, observe from C (:class:`motor._fast.metricvalue.MmapBuckets`:
    the same values written to the same files as the library's ``observe``, without its
    Python loop over the bounds) when the compiled values are installed; the library's
    child otherwise. No ``remove``: a multiprocess series is never dropped
    (:func:`forget_instance`)."""

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist

    def labels(self, *values: str) -> Any:
        child = self.hist.labels(*values)
        if _MmapBuckets is None:
            return child
        try:
            return _MmapBuckets(child)
        except TypeError:       # the library's own values (mpvalues not compiled)
            return child


def _histogram(name: str, documentation: str, labelnames: list[str],
               buckets: tuple[float, ...]) -> Any:
    """A :class:`LoopHistogram` in :data:`REGISTRY`, or in multiprocess mode a ``Histogram``
    (:class:`MpHistogram`: its children observe from C)."""
    if MULTIPROCESS:
        return MpHistogram(Histogram(name, documentation, labelnames, buckets=buckets,
                                     registry=REGISTRY))
    return LoopHistogram(name, documentation, labelnames, buckets, REGISTRY)


# observed on every request: a LoopHistogram in one process (no locks), a Histogram with
# several workers (_histogram)
TTFT = _histogram(
    "motor_coordinator_time_to_first_token_seconds",
    "Request received -> first byte of the answer's body sent to the client (streams).",
    ["route"], _LAT_BUCKETS)
E2E = _histogram(
    "motor_coordinator_e2e_request_latency_seconds",
    "Request received -> last byte of the answer sent.",
    ["route"], _LAT_BUCKETS)
INSTANCE_TTFT = _histogram(
    "motor_coordinator_instance_time_to_first_token_seconds",
    "Request received -> first byte of the answer's body sent to the client, by the instance "
    "that sent it (the decode instance in PD modes) and its role.",
    ["instance", "role"], _LAT_BUCKETS)
INSTANCE_TPOT = _histogram(
    "motor_coordinator_instance_time_per_output_token_seconds",
    "Streams: first event past the prefill -> end of the leg, divided by the data events "
    "relayed after it ([DONE] not counted), by instance and role.",
    ["instance", "role"], _TPOT_BUCKETS)


class InstanceTiming:
    """An instance's children of :data:`INSTANCE_TTFT` and :data:`INSTANCE_TPOT`."""

    __slots__ = ("role", "ttft", "tpot")

    def __init__(self, instance_id: str, role: Role) -> None:
        self.role = role
        self.ttft = INSTANCE_TTFT.labels(instance_id, role.value)
        self.tpot = INSTANCE_TPOT.labels(instance_id, role.value)


_TIMINGS: dict[str, InstanceTiming] = {}


def instance_timing(instance_id: str, role: Role) -> InstanceTiming:
    """The :class:`InstanceTiming` of ``instance_id`` (made once per instance id and role;
    series are as many as the instance ids this process has routed to)."""
    t = _TIMINGS.get(instance_id)
    if t is None or t.role is not role:
        if t is not None:
            forget_instance(instance_id)
        t = _TIMINGS[instance_id] = InstanceTiming(instance_id, role)
    return t


def forget_instance(instance_id: str) -> None:
    """Drop the per-instance histogram series of ``instance_id`` (it left the table); a
    no-op for an instance never timed, and for the series with several workers."""
    t = _TIMINGS.pop(instance_id, None)
    if t is None or MULTIPROCESS:
        # several workers: the series stays in the files (prometheus-client removes none
        # there), and the child is kept, so that one made again for the instance coming
        # back writes the same values as the old one's still observing, not counts of its own
        return
    for h in (INSTANCE_TTFT, INSTANCE_TPOT):
        try:
            h.remove(instance_id, t.role.value)
        except KeyError:
            pass


# -- KV-aware routing (policy kv_affinity, docs/kv-routing.md) --------------------------
KV_PROMPT_TOKENS = Counter(
    "motor_coordinator_kv_prompt_tokens_total",
    "Prompt tokens of requests routed by kv_affinity with a routing key, at each leg's first "
    "decision (a retry is not counted again; the hit ratio's denominator).", registry=REGISTRY)
KV_MATCHED_TOKENS = Counter(
    "motor_coordinator_kv_matched_tokens_total",
    "Prompt tokens found cached (any tier) on the instance chosen by kv_affinity at each "
    "leg's first decision; prefix hit ratio = this / "
    "motor_coordinator_kv_prompt_tokens_total.", registry=REGISTRY)
KV_SESSION_ROUTES = Counter(
    "motor_coordinator_kv_session_routes_total",
    "Requests of a named session routed by kv_affinity, by outcome: kept (the endpoint that "
    "served the session last), moved (another), new (a session this worker does not "
    "remember).", ["outcome"], registry=REGISTRY)
KV_EVENTS_APPLIED = Counter(
    "motor_coordinator_kv_events_applied_total",
    "Engine KV events applied to the prefix index, by kind (stored, removed, cleared).",
    ["kind"], registry=REGISTRY)
KV_EVENTS_DROPPED = Counter(
    "motor_coordinator_kv_events_dropped_total",
    "Engine KV events (or batches) not applied, by reason (orphan: parent block unknown; "
    "block_size; unknown_type; malformed; duplicate).", ["reason"], registry=REGISTRY)
KV_EVENT_BATCHES = Counter(
    "motor_coordinator_kv_event_batches_total",
    "KV event batches received from engine publishers (live and replayed).", ["source"],
    registry=REGISTRY)
KV_EVENT_LAG = Histogram(
    "motor_coordinator_kv_event_lag_seconds",
    "Engine batch timestamp -> applied to the index (wall clocks of both hosts).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
    registry=REGISTRY)
KV_EVENT_GAPS = Counter(
    "motor_coordinator_kv_event_gaps_total",
    "Sequence gaps in an engine's KV events, by outcome (replayed: fetched from the replay "
    "socket; purged: the instance's blocks were dropped).", ["outcome"], registry=REGISTRY)
KV_PURGES = Counter(
    "motor_coordinator_kv_purges_total",
    "Instances whose blocks were dropped from the index, by reason (removed, gap, restart).",
    ["reason"], registry=REGISTRY)
KV_INDEX_BLOCKS = Gauge(
    "motor_coordinator_kv_index_blocks",
    "(instance, tier, block) holdings in the prefix index, by index (exact, approximate).",
    ["index"], registry=REGISTRY)
KV_INDEX_BYTES = Gauge(
    "motor_coordinator_kv_index_bytes",
    "Memory of the prefix index (with the engine-hash maps for exact), by index.",
    ["index"], registry=REGISTRY)
KV_APPROX_EVICTED = Counter(
    "motor_coordinator_kv_approximate_evicted_blocks_total",
    "Blocks dropped from approximate indexes, by reason (ttl, cap).", ["reason"],
    registry=REGISTRY)
KV_SUBSCRIPTIONS = Gauge(
    "motor_coordinator_kv_event_subscriptions",
    "Engine KV-event publishers this coordinator is subscribed to.", registry=REGISTRY)
FAILOVERS = Counter(
    "motor_coordinator_failovers_total",
    "Streams continued on another instance after their engine failed mid-stream, by reason "
    "(broken = transport, engine_error = an SSE error event, recomputed = vLLM-Ascend's "
    "stop_reason, restart = failed before the first event).",
    ["reason"], registry=REGISTRY)
FAILOVER_REFUSED = Counter(
    "motor_coordinator_failover_refused_total",
    "Broken streams that could not be continued and ended with an SSE error event, by reason "
    "(refused: not continuable; client_error: the engine's in-band 4xx error, passed on).",
    ["reason"], registry=REGISTRY)
BREAKER_STATE = Gauge(
    "motor_coordinator_breaker_state",
    "Circuit breaker state per endpoint: 0=closed, 1=open, 2=half_open.",
    ["instance", "endpoint"], registry=REGISTRY)
CLIENT_DISCONNECTS = Counter(
    "motor_coordinator_client_disconnects_total",
    "Requests whose client went away before the answer ended (the upstream request was aborted), "
    "by phase (before_answer, streaming).",
    ["phase"], registry=REGISTRY)

# -- PD modes (motor.coordinator.routing.pd_*, docs/pd.md) -------------------------------
_PD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               120.0, 300.0)
PD_TTFT = Histogram(
    "motor_coordinator_pd_time_to_first_token_seconds",
    "PD modes: request received -> first byte of the decode answer sent to the client.",
    ["mode"], buckets=_PD_BUCKETS, registry=REGISTRY)
PD_PREFILL = Histogram(
    "motor_coordinator_pd_prefill_seconds",
    "PD modes: prefill leg sent -> prefill answer complete (bootstrap: P's answer; "
    "decode-first: metaserver callback -> P done).", ["mode"], buckets=_PD_BUCKETS,
    registry=REGISTRY)
PD_DECODE = Histogram(
    "motor_coordinator_pd_decode_seconds",
    "PD modes: decode leg sent -> decode answer complete.", ["mode"], buckets=_PD_BUCKETS,
    registry=REGISTRY)
PD_REQUESTS = Counter(
    "motor_coordinator_pd_requests_total",
    "PD requests by mode and outcome (ok, prefill_failed, decode_failed, client_error, "
    "fallback_union, no_instance, client_gone, instance_cap).", ["mode", "outcome"], registry=REGISTRY)
PD_ROUTE = Counter(
    "motor_coordinator_pd_route_decisions_total",
    "PD modes with pd.joint.enabled: how each request was served (decision: disaggregated = "
    "a prefill + decode pair, local = a decode instance alone) and why (reason: cost = the "
    "pair was predicted cheaper, local_off = local prefill not allowed, short_prompt / "
    "cached_on_decode = local prefill predicted cheaper, the prompt mostly uncached / mostly "
    "cached there).", ["mode", "decision", "reason"], registry=REGISTRY)

#: ``content-type`` of :func:`render_metrics`' text (Prometheus text exposition 0.0.4)
# -- the edge: API keys, rate limits, admission (docs/security.md) -------------------------
EDGE_REQUESTS = Counter(
    "motor_coordinator_key_requests_total",
    "Inference requests by API key name (never the key) and outcome: admitted, "
    "unauthorized, rate_limited_requests, rate_limited_tokens, queue_full, displaced, queue_timeout, "
    "predicted_wait.",
    ["key", "outcome"], registry=REGISTRY)
EDGE_TOKENS = Counter(
    "motor_coordinator_key_tokens_total",
    "Tokens charged to an API key name by its rate limit (the answer's usage.total_tokens "
    "when seen, else the admission estimate).", ["key"], registry=REGISTRY)
ADMISSION_QUEUED = Gauge(
    "motor_coordinator_admission_queue_requests",
    "Requests waiting in this worker's admission queue.", registry=REGISTRY,
    multiprocess_mode="livesum")
INSTANCE_CAP_WAITS = Counter(
    "motor_coordinator_instance_cap_waits",
    "Requests that found every candidate instance at its limit of requests in flight "
    "(InstanceSpec.max_inflight / admission.max_inflight_per_instance) and waited for a slot.",
    registry=REGISTRY)
INSTANCE_CAP_REFUSALS = Counter(
    "motor_coordinator_instance_cap_refusals",
    "Requests answered 503 after waiting admission.queue_timeout_s for a slot on a capped "
    "instance.", registry=REGISTRY)
ADMISSION_WAIT = Histogram(
    "motor_coordinator_admission_wait_seconds",
    "Time admitted requests waited in the admission queue, by class.", ["class"],
    buckets=_LAT_BUCKETS, registry=REGISTRY)


CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def render_metrics() -> bytes:
    """Prometheus text (exposition format 0.0.4, :data:`CONTENT_TYPE`) of this process's
    :data:`REGISTRY`; or, when ``PROMETHEUS_MULTIPROC_DIR`` is set (``coordinator.workers
    > 1``: the supervisor sets it for every child), prometheus-client's multiprocess
    aggregation of the samples every process wrote there (dead ones included)."""
    from prometheus_client import generate_latest
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return generate_latest(reg)
    return generate_latest(REGISTRY)

"""Every metric of the coordinator, declared in one place (``motor_coordinator_*``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 120.0, 300.0)

REQUESTS = Counter(
    "motor_coordinator_requests_total",
    "Requests answered, by route and HTTP status sent to the client "
    "(a stream that ended with an SSE error event counts under the error's status).",
    ["route", "status"], registry=REGISTRY)
TTFT = Histogram(
    "motor_coordinator_time_to_first_token_seconds",
    "Request received -> first byte of the answer's body sent to the client (streams).",
    ["route"], buckets=_LAT_BUCKETS, registry=REGISTRY)
E2E = Histogram(
    "motor_coordinator_e2e_request_latency_seconds",
    "Request received -> last byte of the answer sent.",
    ["route"], buckets=_LAT_BUCKETS, registry=REGISTRY)
INFLIGHT = Gauge(
    "motor_coordinator_inflight_requests",
    "Requests in flight per endpoint.", ["instance", "endpoint"], registry=REGISTRY)
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

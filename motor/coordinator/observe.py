"""Per-request observation: OpenTelemetry spans and the access log (docs/observability.md).

Off (``coordinator.tracing.enabled: false`` and ``coordinator.access_log: false``, the
defaults) nothing here runs: the request paths test one attribute (``p.obs`` / ``ctx.obs``,
``None`` on the class) and the routes are not wrapped. On, every inference request gets an
:class:`Obs` record, made by the ingress route (:meth:`Observer.serve`) and reached by
the request path through its :class:`~motor.coordinator.routing.base.Parsed` (and by the
edge and the routes' counters through :data:`CURRENT`):

* spans (:class:`Tracing`, the OpenTelemetry SDK imported only when tracing is on):
  ``motor.request`` (server span, parent = the client's ``traceparent`` / ``tracestate``)
  with children ``motor.tokenize``, ``motor.route`` (one per routing decision) and one
  client span per upstream leg, ``motor.prefill`` / ``motor.decode`` / ``motor.union`` /
  ``motor.continuation``, whose own context is what the engine receives as
  ``traceparent``; retries and failovers are events (``motor.retry``, ``motor.failover``)
  of the request span. Sampling: parent-based, ``sample_ratio`` for requests without a
  sampled parent; an unsampled request makes no child span and its engines get the
  client's headers as sent.
* the access log: one line at INFO on the logger ``motor.access`` when the request ends.
"""
from __future__ import annotations

import logging
import random
import re
import time
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from motor.config.schema import CoordinatorConfig, TracingConfig
from motor.errors import ConfigError
from motor.logs import REQUEST_ID

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState
    from motor.coordinator.policy import RequestInfo
    from motor.http.server import Request, Response

ACCESS = logging.getLogger("motor.access")
logger = logging.getLogger(__name__)

#: the :class:`Obs` of the request the current task serves (set only when observing)
CURRENT: ContextVar[Obs | None] = ContextVar("motor_obs", default=None)

_TRACE_HEADERS = (b"traceparent", b"tracestate")
#: W3C trace context ``traceparent``: version, trace id, parent id, flags
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*([0-9]{1,12})')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*([0-9]{1,12})')


class Tracing:
    """One worker's tracer: provider, sampler, OTLP/HTTP exporter behind a batch span
    processor. :meth:`close` flushes and stops the exporter (at shutdown).

    Raises
    ------
    ConfigError
        when the OpenTelemetry packages are not installed (the ``tracing`` extra).
    """

    def __init__(self, cfg: TracingConfig) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator)
        except ImportError as e:
            raise ConfigError(f"coordinator.tracing.enabled needs the OpenTelemetry SDK and "
                              f"OTLP/HTTP exporter (pip install 'motor[tracing]'): {e}") from None
        self._trace = trace
        self.kind_server = trace.SpanKind.SERVER
        self.kind_client = trace.SpanKind.CLIENT
        self.kind_internal = trace.SpanKind.INTERNAL
        self.status_error = trace.Status(trace.StatusCode.ERROR)
        # the ratio is drawn by :meth:`request` before any SDK call (an unsampled request
        # costs one random number); what it lets through is sampled, parent-based
        self.ratio = cfg.sample_ratio
        self._random = random.random
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(ALWAYS_ON))
        self.exporter = OTLPSpanExporter(endpoint=cfg.endpoint, headers=dict(cfg.headers) or None)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("motor.coordinator")
        self.propagator = TraceContextTextMapPropagator()
        self._closed = False

    def request(self, route: str, path: str, req: Request) -> Any:
        """The request's server span (parent from the client's trace headers), or ``None``
        when it is not sampled: a valid client ``traceparent`` decides by its sampled flag
        (parent-based), a request without one is sampled with ``sample_ratio``."""
        carrier = {}
        for k, v in req.headers:
            if k in _TRACE_HEADERS:
                carrier[k.decode()] = v.decode("latin-1")
        tp = _TRACEPARENT.fullmatch(carrier.get("traceparent", "").strip().lower())
        if tp is None or tp.group(1) == _ZERO_TRACE or tp.group(2) == _ZERO_SPAN:
            if self._random() >= self.ratio:
                return None
            parent = None       # a root span (an invalid traceparent is not a parent)
        elif not int(tp.group(3), 16) & 1:
            return None         # the client's trace is not sampled
        else:
            parent = self.propagator.extract(carrier)
        span = self.tracer.start_span(
            "motor.request", context=parent, kind=self.kind_server,
            attributes={"motor.route": route, "http.request.method": "POST", "url.path": path})
        if not span.is_recording():
            return None
        return span

    def child(self, parent: Any, name: str, attrs: dict[str, Any] | None = None,
              client: bool = False) -> Any:
        return self.tracer.start_span(name, context=self._trace.set_span_in_context(parent),
                                      kind=self.kind_client if client else self.kind_internal,
                                      attributes=attrs)

    def headers(self, span: Any, fwd: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """``fwd`` with the trace headers of ``span``'s context instead of the client's."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        out = [h for h in fwd if h[0] not in _TRACE_HEADERS]
        out.extend((k.encode(), v.encode()) for k, v in carrier.items())
        return out

    def close(self) -> None:
        """Flush the spans still queued and stop the exporter (once)."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()


class Obs:
    """One request under observation: its spans, and what the access log says of it."""

    __slots__ = ("tracing", "span", "route", "rid", "key", "model", "endpoint", "instance",
                 "prefill", "status", "ttft_s", "t0", "prompt_tokens", "completion_tokens",
                 "e2e_s", "_open", "_rid_tokens", "decode_span")

    def __init__(self, tracing: Tracing | None, route: str) -> None:
        self.tracing = tracing
        self.span: Any = None
        self.route = route
        self.rid: str | None = None
        self.key: str | None = None
        self.model: str | None = None
        self.endpoint: str | None = None
        self.instance: str | None = None
        self.prefill: str | None = None
        self.status: int | None = None
        self.ttft_s: float | None = None
        self.t0 = time.perf_counter()
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.e2e_s = 0.0
        self._open: list[Any] = []
        self._rid_tokens: list[Token[str | None]] = []
        #: the decode leg's span while its answer is relayed (PD modes)
        self.decode_span: Any = None

    # -- what the request path tells ----------------------------------------------------
    def set_rid(self, rid: bytes) -> None:
        """The request's id: in every log line of this task from now on."""
        s = rid.decode("latin-1")
        if s != self.rid:
            self.rid = s
            self._rid_tokens.append(REQUEST_ID.set(s))

    def parsed(self, rid: bytes, model: str | None) -> None:
        """The request is parsed: its id (made up when the client sent none) and model."""
        self.set_rid(rid)
        self.model = model
        if self.span is not None:
            self.span.set_attribute("motor.request_id", self.rid)
            if model is not None:
                self.span.set_attribute("motor.model", model)

    def tap(self, data: bytes) -> None:
        """``Response.tap``: the answer's usage (the last one seen wins)."""
        if b'"usage"' in data:
            m = _PROMPT.search(data)
            if m:
                self.prompt_tokens = int(m.group(1))
            m = _COMPLETION.search(data)
            if m:
                self.completion_tokens = int(m.group(1))

    def first_token(self, elapsed_s: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = elapsed_s
            if self.span is not None:
                self.span.add_event("motor.first_token")

    def start(self, name: str, attrs: dict[str, Any] | None = None, client: bool = False) -> Any:
        """A child span of the request span (``None`` when not traced); ended by :meth:`end`
        or, if still open, when the request ends."""
        if self.span is None:
            return None
        assert self.tracing is not None
        s = self.tracing.child(self.span, name, attrs, client)
        self._open.append(s)
        return s

    def end(self, span: Any, attrs: dict[str, Any] | None = None,
            error: str | None = None) -> None:
        if span is None or span not in self._open:
            return
        self._open.remove(span)
        if attrs:
            span.set_attributes(attrs)
        if error is not None:
            assert self.tracing is not None
            span.set_attribute("error.type", error)
            span.set_status(self.tracing.status_error)
        span.end()

    def event(self, name: str, attrs: dict[str, Any]) -> None:
        """An event of the request span (a retry, a failover)."""
        if self.span is not None:
            self.span.add_event(name, attrs)

    def decision(self, span: Any, policy: str, role: str, n: int, ep: EndpointState | None,
                 info: RequestInfo) -> None:
        """End a ``motor.route`` span with the decision's attributes."""
        if span is None:
            return
        attrs: dict[str, Any] = {"motor.policy": policy, "motor.role": role,
                                 "motor.candidates": n,
                                 "motor.prompt_tokens": info.prompt_tokens,
                                 "motor.matched_tokens": info.cached_tokens}
        if ep is not None:
            attrs["motor.endpoint"] = ep.url
            attrs["motor.instance"] = ep.instance_id
        cost = getattr(info, "cost", None)
        if cost is not None:
            attrs["motor.predicted_cost"] = float(cost)
        self.end(span, attrs, None if ep is not None else "no_candidate")

    def leg(self, kind: str, ep: EndpointState, fwd: list[tuple[bytes, bytes]],
            attempt: int = 0) -> tuple[Any, list[tuple[bytes, bytes]]]:
        """An upstream leg starts on ``ep``: (its span, the headers to send: ``fwd`` with
        the leg's ``traceparent`` when traced)."""
        if kind == "prefill":
            self.prefill = ep.url
        else:
            self.endpoint = ep.url
            self.instance = ep.instance_id
        if self.span is None:
            return None, fwd
        assert self.tracing is not None
        s = self.start(f"motor.{kind}", {"motor.leg": kind, "motor.endpoint": ep.url,
                                         "motor.instance": ep.instance_id,
                                         "server.address": ep.host, "server.port": ep.port,
                                         "motor.attempt": attempt}, client=True)
        return s, self.tracing.headers(s, fwd)

    # -- the end ------------------------------------------------------------------------
    def finish(self, resp: Response, error: BaseException | None) -> None:
        """The request ended: its spans end, the access log line is written."""
        status = self.status
        if status is None:
            status = resp.status if resp.started else 499
        if error is not None and not resp.finished:
            # an exception of motor's: the server answers 500 (or cuts the started answer);
            # a cancellation: the client left (or the task was cancelled) before the end
            status = 500 if isinstance(error, Exception) else 499
        self.status = status
        e2e_s = time.perf_counter() - self.t0
        span = self.span
        if span is not None:
            for s in list(self._open):
                self.end(s, error="unfinished")
            span.set_attribute("http.response.status_code", status)
            if self.key is not None:
                span.set_attribute("motor.key_name", self.key)
            if self.prompt_tokens is not None:
                span.set_attribute("motor.prompt_tokens", self.prompt_tokens)
            if self.completion_tokens is not None:
                span.set_attribute("motor.completion_tokens", self.completion_tokens)
            if status >= 500 or status == 499:
                assert self.tracing is not None
                span.set_attribute("error.type", str(status))
                span.set_status(self.tracing.status_error)
            span.end()
        while self._rid_tokens:
            REQUEST_ID.reset(self._rid_tokens.pop())
        self.e2e_s = e2e_s

    def access_fields(self, e2e_s: float) -> dict[str, Any]:
        """The access log line's fields (docs/observability.md)."""
        return {"request_id": self.rid, "key": self.key, "route": self.route,
                "model": self.model, "prefill": self.prefill, "endpoint": self.endpoint,
                "instance": self.instance, "status": self.status,
                "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 3),
                "e2e_ms": round(e2e_s * 1000, 3), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens}


def access_line(f: dict[str, Any]) -> str:
    """The text of an access log line: ``key=value`` pairs, unknown fields left out."""
    return " ".join(f"{k}={v}" for k, v in f.items() if v is not None)


class Observer:
    """What an ingress worker observes (``None`` when nothing is on: see :func:`observer`)."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.tracing: Tracing | None = Tracing(cfg.tracing) if cfg.tracing.enabled else None
        self.access_log = cfg.access_log

    async def serve(self, route: Any, inner: Any, req: Request, resp: Response) -> None:
        """Run ``inner(req, resp)`` (the edge and the request path) as one observed request."""
        span = None
        if self.tracing is not None:
            span = self.tracing.request(route.name, route.path.decode("latin-1"), req)
            if span is None and not self.access_log:
                await inner(req, resp)      # not sampled: nothing to observe
                return
        obs = Obs(self.tracing, route.name)
        obs.span = span
        token = CURRENT.set(obs)
        rid = req.header(b"x-request-id")
        if rid:     # the client's id, before the edge and the parse (a 401, a 400 carry it)
            obs.set_rid(rid)
        if self.access_log:
            resp.tap = obs.tap
        error: BaseException | None = None
        try:
            await inner(req, resp)
        except BaseException as e:
            error = e
            raise
        finally:
            obs.finish(resp, error)
            CURRENT.reset(token)
            if self.access_log and ACCESS.isEnabledFor(logging.INFO):
                f = obs.access_fields(obs.e2e_s)
                ACCESS.info("%s", access_line(f), extra={"access": f, "request_id": obs.rid})

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()


def observer(cfg: CoordinatorConfig) -> Observer | None:
    """The worker's :class:`Observer`, or ``None`` when tracing and the access log are off."""
    if not (cfg.tracing.enabled or cfg.access_log):
        return None
    return Observer(cfg)


__all__ = ["ACCESS", "CURRENT", "Obs", "Observer", "Tracing", "access_line", "observer"]

"""The coordinator's view of the cluster: routable endpoints and where they come from.

Two sources fill an :class:`EndpointTable`:

* :class:`ControllerWatcher`: long-polls the controller's ``GET /v1/instances``; an
  endpoint is routable while its instance is ``ready``.
* :class:`StaticBackends`: standalone mode (``--backend URL``), no controller; the
  coordinator probes each backend's ``/health`` itself.

In both, the coordinator re-reads each ready endpoint's ``/v1/models``
(:func:`read_models`) every ``health_check_interval_s``: an endpoint serves the models its
engine lists (LoRA adapters loaded or unloaded at run time included; in controller mode
always the model its instance registered too), and its ``max_model_len`` bounds a failover
continuation. A multi-worker coordinator's feed reads them for its workers
(:class:`ModelReader`, ``motor.coordinator.feed``).

Both combine with each endpoint's circuit breaker (:mod:`motor.coordinator.breaker`):
an endpoint routes while its instance is ready *and* its breaker lets it, so a dead
engine stops receiving requests before the control plane has noticed. Requests that
wait for the first byte of an answer from an endpoint that leaves the routable set
(removed, not ready) are evicted and re-dispatched elsewhere (:meth:`EndpointState.evict_waiting`).

HTTPS endpoints (``Endpoint.scheme`` ``https``: an engine group with ``tls``, or a standalone
``https://`` backend) are reached with the client's TLS context (``coordinator.upstream_tls``;
:meth:`motor.http.client.Client.use_tls` before the pool is first used), never over plain
HTTP. In controller mode such an endpoint routes only once a TLS handshake to it verified
(:meth:`EndpointTable._verify_tls`: ``GET /health``, any status): until then, and while the
engine's certificate does not verify, it is not ready (a request gets 503, not a retry loop
of failed handshakes) and the log says why. It is verified again each time its instance
comes back to ``ready``. A scheme this coordinator does not know is not routed.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import orjson

from motor._fast.shmsync import full_fence
from motor.config.schema import BreakerConfig, ControlPlaneTlsConfig, EngineKind, Role
from motor.coordinator import metrics
from motor.coordinator.admission import SlotQueue
from motor.coordinator.breaker import CLOSED, HALF_OPEN, Breaker
from motor.coordinator.controller_poll import controller_client, follow_controller
from motor.coordinator.loadtable import LoadCell
from motor.http.client import Client, Pool, UpstreamEvicted
from motor.protocol.instances import (KNOWN_SCHEMES, Endpoint, Instance, InstanceState,
                                      InstanceTable)

logger = logging.getLogger(__name__)

#: changes of what makes an endpoint a candidate (its ``ready``, the models it serves, its
#: breaker's state, a table's endpoints), counted in the process: a candidate list cached
#: at one count stays right until the next (:meth:`EndpointTable.candidates`)
_CANDIDACY = [0]


def candidacy_changed() -> None:
    """Count a change of an endpoint's candidacy (cached candidate lists are dropped)."""
    _CANDIDACY[0] += 1


#: candidate lists cached per table at most (a client names any model it likes)
CANDIDATES_CACHED = 256

#: an HTTPS endpoint not verified yet (its certificate failed, or it did not answer) is
#: checked again after this many seconds
TLS_CHECK_RETRY_S = 2.0
#: the TLS check's ``GET /health`` must answer within this many seconds
TLS_CHECK_TIMEOUT_S = 5.0


class EndpointState:
    """One routable HTTP endpoint (an instance's DP rank) with its live load."""

    __slots__ = ("key", "instance_id", "model", "models", "role", "engine", "host", "port",
                 "dp_rank", "url", "_ready", "breaker", "inflight",
                 "inflight_tokens", "inflight_prefill_tokens", "inflight_decode_tokens", "pool",
                 "kv_events", "bootstrap_port", "_gauge", "shared", "max_model_len",
                 "learned", "timing", "scheme", "https", "tls_ok", "tls_error",
                 "instance_ready", "tls_check", "own_max_inflight", "max_inflight", "on_free")

    def __init__(self, instance_id: str, model: str | None, role: Role, host: str, port: int,
                 dp_rank: int, pool: Pool, engine: EngineKind | None = None,
                 kv_events: str | None = None, bootstrap_port: int | None = None,
                 breaker: BreakerConfig | None = None, scheme: str = "http",
                 max_inflight: int | None = None) -> None:
        self.instance_id = instance_id
        #: the instance's own cap (``InstanceSpec.max_inflight``), None: none of its own
        self.own_max_inflight = max_inflight
        #: requests in flight here at most, the whole coordinator (own cap, else
        #: ``admission.max_inflight_per_instance``); 0 = no cap (:meth:`EndpointTable.caps`)
        self.max_inflight = max_inflight or 0
        #: called when a request here ends while the endpoint has a cap (wakes the waiters
        #: for a slot, :class:`motor.coordinator.admission.SlotQueue`); None without a cap
        self.on_free: Callable[[], None] | None = None
        self.key = f"{instance_id}#{dp_rank}"
        self.model = model
        self.models: set[str] = {model} if model else set()
        self.role = role
        #: the instance's latency histograms (per-instance TTFT / TPOT), resolved once
        self.timing = metrics.instance_timing(instance_id, role)
        self.engine = engine
        self.host = host
        self.port = port
        self.dp_rank = dp_rank
        #: ``http`` or ``https`` (the pool's connections are TLS then)
        self.scheme = scheme
        self.https = scheme == "https"
        self.url = f"{scheme}://{host}:{port}"
        self.ready = False
        #: controller mode: whether the instance is ``ready`` in the table; the endpoint is
        #: ``ready`` when it is and (HTTPS) a handshake verified (``tls_ok``)
        self.instance_ready = False
        self.tls_ok = not self.https
        #: why an HTTPS endpoint is not verified (its last check's failure), None otherwise
        self.tls_error: str | None = None
        self.tls_check: asyncio.Task[None] | None = None
        self.inflight = 0
        self.inflight_tokens = 0
        # uncached prompt tokens (as the policy estimated) of the requests still in their
        # prefill: a streamed answer's leave at its first token (prefill_done)
        self.inflight_prefill_tokens = 0
        self.inflight_decode_tokens = 0   # max_tokens of the requests in flight
        # workers > 1: this worker's cell of the shared load table (policies read the
        # column sums over all workers, motor.coordinator.loadtable); None with one worker
        self.shared: LoadCell | None = None
        self.pool = pool
        self.kv_events = kv_events
        self.bootstrap_port = bootstrap_port
        #: the engine's context length (its /v1/models ``max_model_len``), when learned
        self.max_model_len: int | None = None
        #: the model ids the engine's /v1/models listed last (None: not read yet)
        self.learned: frozenset[str] | None = None
        gauge = metrics.INFLIGHT.labels(instance_id, self.url)
        # one process: the gauge reads the count at scrape time (no lock taken per request);
        # multiprocess mode exports only what is set, so it is counted as it changes there
        self._gauge: Any = metrics.gauge_counter(gauge) if metrics.MULTIPROCESS else None
        if not metrics.MULTIPROCESS:
            gauge.set_function(lambda: self.inflight)
        b = breaker or BreakerConfig()
        gauge_set = metrics.BREAKER_STATE.labels(instance_id, self.url).set

        def breaker_changed(state: int) -> None:
            candidacy_changed()
            gauge_set(state)
        self.breaker = Breaker(b.failure_threshold, b.open_s, b.open_max_s, breaker_changed,
                               self.url)

    @property
    def ready(self) -> bool:
        """Routable as far as the control plane (or the probes) know; the breaker decides
        the rest (:meth:`routable`)."""
        return self._ready

    @ready.setter
    def ready(self, v: bool) -> None:
        self._ready = v
        candidacy_changed()

    @property
    def failures(self) -> int:
        """Consecutive failures counted by the breaker."""
        return self.breaker.failures

    def routable(self, now: float) -> bool:
        return self._ready and (self.breaker.state == CLOSED or self.breaker.allows(now))

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    def set_learned(self, ids: Iterable[str] | None) -> None:
        """The engine listed ``ids`` (its /v1/models): the endpoint serves them, and always
        the model its instance registered (controller mode; standalone endpoints have none)."""
        self.learned = None if ids is None else frozenset(ids)
        models = set(self.learned or ())
        if self.model:
            models.add(self.model)
        if models != self.models:
            self.models = models
            candidacy_changed()

    def acquire(self, tokens: int = 0, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        self.inflight += 1
        self.inflight_tokens += tokens
        self.inflight_prefill_tokens += prefill_tokens
        self.inflight_decode_tokens += decode_tokens
        if self.shared is not None:
            self.shared.acquire(tokens, prefill_tokens, decode_tokens)
        if self._gauge is not None:
            self._gauge.inc()
        if self.breaker.state != CLOSED:
            self.breaker.on_pick(time.monotonic())

    def release(self, tokens: int = 0, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        self.inflight -= 1
        self.inflight_tokens -= tokens
        self.inflight_prefill_tokens -= prefill_tokens
        self.inflight_decode_tokens -= decode_tokens
        if self.shared is not None:
            self.shared.release(tokens, prefill_tokens, decode_tokens)
        if self._gauge is not None:
            self._gauge.dec()
        if self.breaker.state == HALF_OPEN:
            self.breaker.probe_done()
        if self.on_free is not None:
            self.on_free()

    def inflight_total(self) -> int:
        """Requests in flight here, the whole coordinator's (summed over the workers' rows
        of the shared load table when ``coordinator.workers`` > 1)."""
        sh = self.shared
        return self.inflight if sh is None else sh.totals()[0]

    def over_cap(self) -> bool:
        """After this worker counted a request here (:meth:`acquire`): whether the whole
        coordinator is now above :attr:`max_inflight` because another worker took the last
        slot at the same instant. A full memory fence (:func:`motor._fast.shmsync.
        full_fence`) between this worker's count and its read of the others' rows makes two
        workers racing for one slot see each other, so at least one backs off (both, at
        worst: the slot stays free for the next one). False without a cap or with one
        worker (its event loop cannot race itself)."""
        sh = self.shared
        if not self.max_inflight or sh is None:
            return False
        full_fence()
        return sh.totals()[0] > self.max_inflight

    def engine_waiting(self, now: float, max_age_s: float) -> float:
        """Requests the engine last reported waiting (the multi-worker scrape of its
        /metrics into the shared load table); 0 when not scraped, or scraped more than
        ``max_age_s`` seconds before ``now`` (unix seconds)."""
        sh = self.shared
        if sh is None:
            return 0.0
        waiting, _, _, scraped_at = sh.table.read_engine(sh.slot)
        return waiting if now - scraped_at <= max_age_s else 0.0

    def lease(self, tokens: int = 0, prefill_tokens: int = 0, decode_tokens: int = 0
              ) -> Lease:
        """Count one request on this endpoint (:meth:`acquire`) until the returned lease is
        released, exactly once (``with ep.lease(...)`` or :meth:`Lease.release`).

        ``tokens``: prompt + max_tokens; ``prefill_tokens``: the uncached prompt tokens
        still to compute; ``decode_tokens``: max_tokens. The lease is
        :class:`motor._fast.lease.Lease` when built (the same effects, compiled), else
        :class:`Lease`."""
        return LEASE(self, tokens, prefill_tokens, decode_tokens)

    def prefill_done(self, prefill_tokens: int) -> None:
        """The engine sent a request's first token: its prefill is over, so its
        ``prefill_tokens`` stop counting as in-flight prefill here. The request stays in
        flight; its :meth:`release` passes the prefill tokens still counted (0 after this)."""
        self.inflight_prefill_tokens -= prefill_tokens
        if self.shared is not None:
            self.shared.prefill_done(prefill_tokens)

    def failed(self, certain: bool = False) -> None:
        """A transport failure or a 5xx (not 503) from this endpoint; ``certain``: connection
        refused."""
        self.breaker.failure(certain)

    def succeeded(self) -> None:
        b = self.breaker
        if b.failures or b.state != CLOSED or b.probe_inflight:   # else nothing to reset
            b.success()

    def evict_waiting(self, why: str) -> None:
        """End the attempts on this endpoint still waiting for their answer's head (those
        made with ``owner=`` this endpoint: the union path's and the PD legs'); each gets
        :class:`~motor.http.client.UpstreamEvicted` ``(why)`` and retries elsewhere."""
        if self.pool is not None:
            self.pool.evict(self, UpstreamEvicted(why))

    def __repr__(self) -> str:
        return f"<Endpoint {self.key} {self.role.value} {self.url} ready={self.ready}>"


class Lease:
    """One request's load on one endpoint (:meth:`EndpointState.lease`): made, it counts the
    request (:meth:`EndpointState.acquire`); :meth:`release` gives it back. The pure-Python
    reference of :class:`motor._fast.lease.Lease`, which the endpoints use when built.

    :meth:`prefill_done` moves its prefill tokens out of the endpoint's in-flight prefill
    at the first token; :meth:`release` gives back what is still counted. Both are
    idempotent, so a request path can release in a ``finally`` whatever happened.
    :meth:`watch` installs a callback that gets the attempt's TTFT (seconds from
    :meth:`watch` to :meth:`prefill_done` or :meth:`answered`, once; a released lease
    reports nothing): the routing policy's learning (``kv_affinity``)."""

    __slots__ = ("ep", "tokens", "prefill_tokens", "decode_tokens", "_held", "watcher", "_t0")

    def __init__(self, ep: EndpointState, tokens: int = 0, prefill_tokens: int = 0,
                 decode_tokens: int = 0) -> None:
        self.ep = ep
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens
        ep.acquire(tokens, prefill_tokens, decode_tokens)
        self._held = True
        #: the TTFT callback (:meth:`watch`), None when nothing learns from this attempt
        self.watcher: Callable[[float], object] | None = None

    def watch(self, cb: Callable[[float], object] | None) -> None:
        """Call ``cb(ttft_s)`` at the first token (:meth:`prefill_done`) or whole answer
        (:meth:`answered`), timed from now; None: nothing to call."""
        if cb is not None:
            self.watcher = cb
            self._t0 = time.perf_counter()

    def answered(self) -> None:
        """A whole (non-streamed) answer came: its time is the attempt's TTFT."""
        cb = self.watcher
        if cb is not None:
            self.watcher = None
            cb(time.perf_counter() - self._t0)

    def prefill_done(self) -> None:
        """The engine sent this request's first token (its prefill is over)."""
        if self.watcher is not None:
            self.answered()
        if self._held and self.prefill_tokens:
            self.ep.prefill_done(self.prefill_tokens)
            self.prefill_tokens = 0

    def release(self) -> None:
        """Give the load back (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self.watcher = None
            self.ep.release(self.tokens, self.prefill_tokens, self.decode_tokens)

    @property
    def held(self) -> bool:
        return self._held

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


try:
    from motor._fast.lease import Lease as _CompiledLease
except ImportError:  # pragma: no cover - the extensions not built: the reference
    _CompiledLease = None  # type: ignore[assignment, misc]

#: what :meth:`EndpointState.lease` makes: the compiled lease when built
LEASE: type[Lease] = _CompiledLease if _CompiledLease is not None else Lease  # type: ignore[assignment]


class EndpointTable:
    """All endpoints, indexed by role; candidate lists are rebuilt only on change."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.endpoints: dict[str, EndpointState] = {}
        self.version = 0
        self._by_role: dict[Role, list[EndpointState]] = {r: [] for r in Role}
        self.changed = asyncio.Event()
        self.breaker_cfg = BreakerConfig()
        #: model names known to be LoRA adapters (shared with the KV router's request key)
        self.adapters: set[str] = set()
        #: endpoint keys whose scheme is unknown (logged once each)
        self._unknown_schemes: set[str] = set()
        #: per-instance caps and shedding (:meth:`configure_caps`, :meth:`with_room`)
        self.default_max_inflight = 0
        self.shed_waiting = 0
        self.engine_max_age_s = 5.0
        self.slots = SlotQueue(30.0)
        #: whether :meth:`with_room` has anything to do (an endpoint with a cap, or
        #: shedding on): the request path skips it otherwise
        self.gated = False
        #: :meth:`candidates`' lists that do not depend on the time, by (role, model), as
        #: of the candidacy count ``_cands_at``
        self._cands: dict[tuple[Role, str | None], list[EndpointState]] = {}
        self._cands_at = -1

    def configure_caps(self, default_max_inflight: int, shed_waiting: int, wait_s: float,
                       engine_max_age_s: float = 5.0) -> None:
        """Per-instance caps: ``default_max_inflight`` for endpoints without one of their own
        (0 = none), ``shed_waiting`` engine-reported waiting requests that make an endpoint
        skipped while another has fewer (0 = off), ``wait_s`` the longest wait for a slot,
        ``engine_max_age_s`` the oldest engine figures believed."""
        self.default_max_inflight = default_max_inflight
        self.shed_waiting = shed_waiting
        self.slots.timeout_s = wait_s
        self.engine_max_age_s = engine_max_age_s
        for ep in self.endpoints.values():
            self._cap(ep)
        self._gate()

    def _cap(self, ep: EndpointState) -> None:
        ep.max_inflight = ep.own_max_inflight or self.default_max_inflight
        ep.on_free = self.slots.pump if ep.max_inflight else None

    def _gate(self) -> None:
        self.gated = self.shed_waiting > 0 or any(e.max_inflight for e in self.endpoints.values())

    def with_room(self, cands: list[EndpointState]) -> list[EndpointState] | None:
        """The candidates below their cap (:attr:`EndpointState.max_inflight`, counted over
        the whole coordinator), None when there is none; with ``shed_waiting``, those whose
        engine reports fewer waiting requests than that, when any does."""
        out = [e for e in cands if not e.max_inflight or e.inflight_total() < e.max_inflight]
        if not out:
            return None
        shed = self.shed_waiting
        if shed and len(out) > 1:
            now = time.time()
            age = self.engine_max_age_s
            calm = [e for e in out if e.engine_waiting(now, age) < shed]
            if calm:
                out = calm
        return out

    def configure_breakers(self, cfg: BreakerConfig) -> None:
        """Breaker settings for every endpoint, present and future."""
        self.breaker_cfg = cfg
        for ep in self.endpoints.values():
            ep.breaker.configure(cfg.failure_threshold, cfg.open_s, cfg.open_max_s)

    def _rebuild(self) -> None:
        self._gate()
        by_role: dict[Role, list[EndpointState]] = {r: [] for r in Role}
        for ep in sorted(self.endpoints.values(), key=lambda e: e.key):
            by_role[ep.role].append(ep)
        self._by_role = by_role
        candidacy_changed()
        for role in Role:
            eps = by_role[role]
            n_ok = sum(1 for e in eps if e.ready)
            metrics.ENDPOINTS.labels(role.value, "1").set(n_ok)
            metrics.ENDPOINTS.labels(role.value, "0").set(len(eps) - n_ok)
        self.changed.set()
        self.changed = asyncio.Event()

    def all(self, role: Role) -> list[EndpointState]:
        return self._by_role[role]

    def candidates(self, role: Role, model: str | None) -> list[EndpointState]:
        """Routable endpoints of ``role`` serving ``model``.

        When every endpoint of the role has its breaker open, they are all returned anyway
        (better a retry than a 503 while the control plane catches up).

        A list that does not depend on the time (every ready endpoint of the role has its
        breaker closed) is kept until an endpoint's candidacy changes (``ready``, models,
        breaker state, the table: :func:`candidacy_changed`): the caller gets a copy.
        """
        at = _CANDIDACY[0]
        key = (role, model)
        if self._cands_at == at:
            hit = self._cands.get(key)
            if hit is not None:
                return hit[:]
        else:
            self._cands.clear()
            self._cands_at = at
        now = time.monotonic()
        eps = self._by_role[role]
        out = [e for e in eps if e.routable(now) and e.serves(model)]
        if not out:
            return [e for e in eps if e._ready and e.serves(model)]
        if len(self._cands) < CANDIDATES_CACHED and \
                all(e.breaker.state == CLOSED for e in eps if e._ready):
            self._cands[key] = out[:]
        return out

    def context_length(self, model: str | None) -> int | None:
        """The smallest ``max_model_len`` known among the endpoints serving ``model`` (a
        continuation may land on any of them), ``None`` when none is known."""
        lens = [e.max_model_len for e in self.endpoints.values()
                if e.max_model_len is not None and e.serves(model)]
        return min(lens) if lens else None

    def models(self) -> list[str]:
        names: set[str] = set()
        for e in self.endpoints.values():
            if e.ready:
                names |= e.models
        return sorted(names)

    def has_model(self, model: str) -> bool:
        """Whether some endpoint serves ``model`` (404 otherwise). An endpoint whose models
        are not known yet serves any name while it is ready, or when no endpoint's models
        are known at all (then the answer is 503, not 404)."""
        any_known = False
        unknown_ready = False
        for e in self.endpoints.values():
            if e.models:
                any_known = True
                if model in e.models:
                    return True
            elif e.ready:
                unknown_ready = True
        return unknown_ready or not any_known

    # -- updates ------------------------------------------------------------
    def set_static(self, specs: Iterable[tuple[Role, str, int]],
                   kv_events: dict[str, str] | None = None) -> None:
        """Standalone mode: fixed (role, host, port) backends, routable until probes say otherwise.

        ``kv_events`` maps a backend URL ``http://HOST:PORT`` to its KV-event address
        (``--kv-events URL=ADDRESS``).
        """
        kv_events = kv_events or {}
        for i, (role, host, port) in enumerate(specs):
            scheme = "https" if self.client.speaks_tls(host, port) else "http"
            ep = EndpointState(f"backend-{i}", None, role, host, port, 0,
                               self.client.pool(host, port),
                               kv_events=kv_events.get(f"http://{host}:{port}")
                               or kv_events.get(f"{scheme}://{host}:{port}"),
                               breaker=self.breaker_cfg, scheme=scheme)
            self._cap(ep)
            ep.ready = True
            self.endpoints[ep.key] = ep
        self._rebuild()

    def set_ready(self, ep: EndpointState, ready: bool, why: str) -> None:
        if ep.ready != ready:
            logger.info("endpoint %s (%s) %s: %s", ep.key, ep.url,
                        "back in rotation" if ready else "out of rotation", why)
            ep.ready = ready
            if ready:
                ep.breaker.reset()
            else:
                ep.evict_waiting(why)
            self._rebuild()

    def _retire(self, ep: EndpointState, why: str) -> None:
        """An endpoint left the table: re-dispatch what waits on it, close its pool if no other
        endpoint shares it, and drop its per-endpoint metric series (no gauge of a dead
        instance stays on /metrics), and the instance's latency histograms with its last
        endpoint."""
        ep.evict_waiting(why)
        if ep.tls_check is not None:
            ep.tls_check.cancel()
            ep.tls_check = None
        if not any(e.host == ep.host and e.port == ep.port for e in self.endpoints.values()):
            self.client.discard(ep.host, ep.port)
        if not metrics.MULTIPROCESS:
            # (several workers: the series stays in the files anyway, and a child made
            # again for an instance that comes back would share the file's value with the
            # old one's still in use, each writing its own count: the child is kept)
            for metric in (metrics.INFLIGHT, metrics.BREAKER_STATE):
                try:
                    metric.remove(ep.instance_id, ep.url)
                except KeyError:
                    pass
        if not any(e.instance_id == ep.instance_id for e in self.endpoints.values()):
            metrics.forget_instance(ep.instance_id)

    def apply(self, table: InstanceTable) -> None:
        """Replace the endpoints with the controller's table (instances in state ``ready``
        route; ``stopped`` and ``removed`` ones leave the table with their KV holdings)."""
        seen: set[str] = set()
        for inst in table.instances:
            if inst.state in _GONE:   # a stopped engine restarts empty: its cache goes too
                continue
            for ep_spec in inst.endpoints:
                key = f"{inst.id}#{ep_spec.dp_rank}"
                if ep_spec.scheme not in KNOWN_SCHEMES:
                    if key not in self._unknown_schemes:
                        self._unknown_schemes.add(key)
                        logger.error("endpoint %s (%s) not routed: scheme %r is not one of "
                                     "%s", key, ep_spec.url, ep_spec.scheme,
                                     sorted(KNOWN_SCHEMES))
                    continue
                seen.add(key)
                ep = self.endpoints.get(key)
                if ep is None or ep.host != ep_spec.host or ep.port != ep_spec.port \
                        or ep.role != inst.role or ep.scheme != ep_spec.scheme:
                    if ep is not None:  # moved or changed role: the old one goes first
                        del self.endpoints[key]
                        self._retire(ep, "instance moved")
                    ep = self._new_endpoint(inst, ep_spec)
                    self.endpoints[key] = ep
                    logger.info("endpoint %s added: %s %s model=%s", key, inst.role.value,
                                ep.url, inst.model)
                elif ep.model != inst.model:   # re-registered with another model
                    logger.info("endpoint %s now serves model %s (was %s)", key, inst.model,
                                ep.model)
                    ep.model = inst.model
                    ep.set_learned(ep.learned)
                if ep.own_max_inflight != inst.max_inflight:
                    ep.own_max_inflight = inst.max_inflight
                    self._cap(ep)
                ep.instance_ready = inst.state == InstanceState.READY
                if ep.https and not ep.instance_ready:
                    ep.tls_ok = False     # verified again when the instance comes back
                elif ep.instance_ready and not ep.tls_ok:
                    self._start_tls_check(ep)
                ready = ep.instance_ready and ep.tls_ok
                if ready != ep.ready:
                    logger.info("endpoint %s %s (instance %s%s)", key,
                                "ready" if ready else "not routable", inst.state.value,
                                "" if ready or not ep.instance_ready else
                                ", TLS not verified yet")
                    ep.ready = ready
                    if ready:
                        ep.breaker.reset()
                    else:
                        ep.evict_waiting(f"instance {inst.state.value}")
        for key in [k for k in self.endpoints if k not in seen]:
            ep = self.endpoints.pop(key)
            logger.info("endpoint %s removed", key)
            self._retire(ep, "instance removed")
        self._unknown_schemes &= {f"{i.id}#{e.dp_rank}" for i in table.instances
                                  for e in i.endpoints}
        self.version = table.version
        metrics.TABLE_VERSION.set(table.version)
        self._rebuild()


    def _new_endpoint(self, inst: Instance, spec: Endpoint) -> EndpointState:
        """The state of endpoint ``spec`` of instance ``inst``; its pool speaks the spec's
        scheme (HTTPS with the client's context: ``coordinator.upstream_tls``)."""
        tls_error = None
        try:
            self.client.use_tls(spec.host, spec.port, spec.https)
        except ValueError as e:       # no TLS context: never routed, never plain HTTP
            tls_error = f"{e} (coordinator.upstream_tls)"
            logger.error("endpoint %s#%d (%s) not routable: %s", inst.id, spec.dp_rank,
                         spec.url, tls_error)
        ep = EndpointState(inst.id, inst.model, inst.role, spec.host, spec.port, spec.dp_rank,
                           self.client.pool(spec.host, spec.port), inst.engine,
                           inst.kv_events, inst.bootstrap_port, self.breaker_cfg,
                           scheme=spec.scheme, max_inflight=inst.max_inflight)
        self._cap(ep)
        ep.tls_error = tls_error
        return ep

    def _start_tls_check(self, ep: EndpointState) -> None:
        if ep.tls_check is None or ep.tls_check.done():
            if ep.tls_error is not None and not self.client.speaks_tls(ep.host, ep.port):
                return     # no TLS context at all: nothing to check, never routed
            ep.tls_check = asyncio.ensure_future(self._verify_tls(ep))

    async def _verify_tls(self, ep: EndpointState) -> None:
        """Until a TLS handshake to ``ep`` verifies (``GET /health`` answered, whatever its
        status), every :data:`TLS_CHECK_RETRY_S`; then ``ep`` is ready while its instance
        is. A failure is logged once per distinct reason (an error for a certificate that
        does not verify)."""
        logged: str | None = None
        while self.endpoints.get(ep.key) is ep and ep.instance_ready and not ep.tls_ok:
            try:
                await self.client.get_json_bytes(ep.host, ep.port, "/health",
                                                 TLS_CHECK_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except ssl.SSLError as e:
                why = f"its TLS handshake failed: {tls_reason(e)}"
                bad = True
            except Exception as e:  # noqa: BLE001 - refused, reset, timeout: not up yet
                why = f"no answer to the TLS check: {type(e).__name__}: {e}"
                bad = False
            else:
                ep.tls_ok, ep.tls_error = True, None
                logger.info("endpoint %s (%s): TLS verified", ep.key, ep.url)
                if ep.instance_ready and self.endpoints.get(ep.key) is ep:
                    self.set_ready(ep, True, "TLS verified")
                return
            ep.tls_error = why
            if why != logged:
                logged = why
                (logger.error if bad else logger.warning)(
                    "endpoint %s (%s) not routable: %s (checked against "
                    "coordinator.upstream_tls; again in %g s)", ep.key, ep.url, why,
                    TLS_CHECK_RETRY_S)
            await asyncio.sleep(TLS_CHECK_RETRY_S)

    def close(self) -> None:
        """Stop the TLS checks still running."""
        for ep in self.endpoints.values():
            if ep.tls_check is not None:
                ep.tls_check.cancel()
                ep.tls_check = None


def tls_reason(e: ssl.SSLError) -> str:
    """What an :class:`ssl.SSLError` says, shortest form first: the verification message of a
    certificate that did not verify, else OpenSSL's reason."""
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        return f"certificate verify failed: {e.verify_message}"
    return str(e.reason or e)


#: instance states whose endpoints the coordinator drops (pools, slots, KV holdings)
_GONE = (InstanceState.REMOVED, InstanceState.STOPPED)


def model_entries(body: bytes) -> list[dict[str, Any]]:
    """The model objects of a ``GET /v1/models`` answer (OpenAI's list: ``data`` of objects
    with a string ``id``; vLLM adds ``max_model_len``, and ``parent`` for a LoRA adapter)."""
    data = orjson.loads(body).get("data") or []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def context_length(entries: list[dict[str, Any]]) -> int | None:
    """The smallest ``max_model_len`` of the entries (``None`` when none says)."""
    lens = [m["max_model_len"] for m in entries if isinstance(m.get("max_model_len"), int)]
    return min(lens) if lens else None


class Models(NamedTuple):
    """What an engine's ``GET /v1/models`` says (:func:`read_models`)."""

    #: every model id it lists (base models and LoRA adapters)
    ids: frozenset[str]
    #: its context length (the smallest ``max_model_len`` listed), None when none is
    max_model_len: int | None
    #: the ids that are LoRA adapters (vLLM lists one with its base model as ``parent``)
    adapters: frozenset[str]


async def read_models(client: Client, host: str, port: int, timeout_s: float
                      ) -> Models | None:
    """``GET /v1/models`` of ``host:port``; ``None`` when it fails, answers another status
    or lists nothing (an engine without the route serves any model name)."""
    try:
        status, body = await client.get_json_bytes(host, port, "/v1/models", timeout_s)
        if status != 200:
            return None
        entries = model_entries(body)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - unreachable, not JSON, not a model list
        return None
    if not entries:
        return None
    return Models(frozenset(m["id"] for m in entries), context_length(entries),
                  frozenset(m["id"] for m in entries if m.get("parent") not in (None, m["id"])))


def learn(table: EndpointTable, ep: EndpointState, m: Models) -> None:
    """``ep``'s engine listed ``m``: its models, context length and adapters."""
    ep.set_learned(m.ids)
    ep.max_model_len = m.max_model_len
    table.adapters.update(m.adapters)


class ModelReader:
    """Reads the ``/v1/models`` of endpoints (anything with ``key``, ``host``, ``port`` and
    ``ready``): a ready endpoint not read yet at once (:meth:`added`), then every ready one
    every ``interval_s`` (:meth:`run`); each answer goes to ``on_models(ep, models)``.

    The one-process coordinator in controller mode (:class:`ControllerWatcher`) and the feed
    of a multi-worker one (which sends the answers to its workers in its ``TABLE`` record)
    use it; standalone backends are read after each health probe (:class:`StaticBackends`).
    """

    def __init__(self, client: Client, endpoints: Callable[[], Iterable[Any]],
                 on_models: Callable[[Any, Models], None], interval_s: float = 1.0,
                 timeout_s: float = 2.0) -> None:
        self.client = client
        self.endpoints = endpoints
        self.on_models = on_models
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._read: dict[str, tuple[str, int]] = {}     # key -> (host, port) read so far
        self._first: dict[str, asyncio.Task[None]] = {}  # key -> its first read

    def added(self) -> None:
        """The endpoints changed: read the ready ones never read at their address now."""
        eps = list(self.endpoints())
        keys = {e.key for e in eps}
        self._read = {k: v for k, v in self._read.items() if k in keys}
        for e in eps:
            if e.ready and self._read.get(e.key) != (e.host, e.port) \
                    and e.key not in self._first:
                self._first[e.key] = asyncio.ensure_future(self._first_read(e))

    async def _first_read(self, ep: Any) -> None:
        try:
            await self.read(ep)
        finally:
            self._first.pop(ep.key, None)

    async def read(self, ep: Any) -> None:
        """Read ``ep``'s models once (nothing happens when that fails: the last ones stay);
        HTTPS when ``ep.https``."""
        try:
            self.client.use_tls(ep.host, ep.port, bool(getattr(ep, "https", False)))
        except ValueError:
            return      # HTTPS without a TLS context: never read over plain HTTP
        m = await read_models(self.client, ep.host, ep.port, self.timeout_s)
        if m is not None:
            self._read[ep.key] = (ep.host, ep.port)
            self.on_models(ep, m)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self.read(e) for e in list(self.endpoints()) if e.ready))

    def close(self) -> None:
        for t in list(self._first.values()):
            t.cancel()


class ControllerWatcher:
    """Follows the controller's live instance table with a long poll
    (:func:`motor.coordinator.controller_poll.follow_controller`) into ``table``;
    ``synced`` is set once the first table is applied. Each ready endpoint's ``/v1/models``
    is read as it appears and every ``models_interval_s`` (:class:`ModelReader`): adapters
    loaded at run time, the context length.

    ``tls``: ``controller.tls``, the controller is reached over mTLS (``https://`` URL).

    Raises
    ------
    ValueError
        for a ``controller_url`` that is not ``http(s)://HOST:PORT`` or whose scheme does not
        fit ``tls`` (:class:`motor.errors.ConfigError`, also for a TLS file that does not load).
    """

    def __init__(self, table: EndpointTable, controller_url: str, poll_timeout_s: float = 10.0,
                 models_interval_s: float = 1.0, models_timeout_s: float = 2.0,
                 tls: ControlPlaneTlsConfig | None = None) -> None:
        self.link = controller_client(controller_url, tls, 4, 2.0)
        self.client = self.link.client
        self.table = table
        self.poll_timeout_s = poll_timeout_s
        self.synced = asyncio.Event()
        # the engines' /v1/models: the engines' TLS context (coordinator.upstream_tls), not
        # the control plane's
        self.engine_client = Client(max_connections_per_endpoint=2,
                                    connect_timeout_s=models_timeout_s, tls=table.client.tls)
        self.models = ModelReader(self.engine_client, lambda: self.table.endpoints.values(),
                                  self._learned, models_interval_s, models_timeout_s)

    async def run(self) -> None:
        reread = asyncio.ensure_future(self.models.run())
        try:
            await follow_controller(self.link, self._apply, self.synced, self.poll_timeout_s)
        finally:
            reread.cancel()

    def _apply(self, table: InstanceTable) -> None:
        self.table.apply(table)
        self.models.added()

    def _learned(self, ep: EndpointState, m: Models) -> None:
        if self.table.endpoints.get(ep.key) is ep:     # still in the table
            learn(self.table, ep, m)

    def close(self) -> None:
        self.models.close()
        self.table.close()
        self.engine_client.close()
        self.client.close()


class StaticBackends:
    """Standalone mode: active ``/health`` probes of fixed backends, and their model names."""

    def __init__(self, table: EndpointTable, interval_s: float, timeout_s: float,
                 failures: int) -> None:
        self.table = table
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        # a separate pool: health probes never queue behind proxied requests (case B26);
        # HTTPS backends are probed over HTTPS (the table's client context)
        self.client = Client(max_connections_per_endpoint=2, connect_timeout_s=timeout_s,
                             tls=table.client.tls)
        for ep in table.endpoints.values():
            if ep.https:
                self.client.use_tls(ep.host, ep.port)
        self._fails: dict[str, int] = {}
        self.synced = asyncio.Event()  # set after the first probe round

    async def probe(self, ep: EndpointState) -> None:
        try:
            status, _ = await self.client.get_json_bytes(ep.host, ep.port, "/health", self.timeout_s)
            ok = status == 200
            why = f"/health answered {status}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            self._fails[ep.key] = 0
            # every probe: an engine's models change at run time (a LoRA adapter loaded or
            # unloaded, the engine restarted with another model: case N12)
            await self._learn_models(ep)
            self.table.set_ready(ep, True, why)
        else:
            n = self._fails.get(ep.key, 0) + 1
            self._fails[ep.key] = n
            if n >= self.failures:
                self.table.set_ready(ep, False, f"{n} failed probes, last: {why}")

    async def _learn_models(self, ep: EndpointState) -> None:
        # a backend without /v1/models (None) serves any model name
        m = await read_models(self.client, ep.host, ep.port, self.timeout_s)
        if m is not None:
            learn(self.table, ep, m)

    async def run(self) -> None:
        while True:
            eps = list(self.table.endpoints.values())
            await asyncio.gather(*(self.probe(e) for e in eps))
            # synced once every backend has answered a probe or been given up on
            if all(self._fails.get(e.key) == 0 or self._fails.get(e.key, 0) >= self.failures
                   for e in eps):
                self.synced.set()
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        self.client.close()

"""What every request path shares: one copy each, used by ``union`` and the PD modes.

* :class:`Settings`: the request path's numbers and keys, built once from
  :class:`~motor.config.schema.CoordinatorConfig` (and ``MOTOR_API_KEYS`` /
  ``MOTOR_WORKER_API_KEY``);
* :class:`Route`: one inference route (``/v1/chat/completions`` ...) with its metric
  children resolved once;
* :class:`RequestPath`: the interface of a mode's request path, ``handle(route, req, resp)``;
* :func:`parse_request` -> :class:`Parsed`: the body checked once (scanned in place,
  :mod:`motor._fast.reqscan`, and parsed on first use; or parsed), ``X-Request-Id``, the
  headers forwarded upstream (:data:`FORWARD_HEADERS`, the client's credential or the
  worker key), the size estimate policies and load accounting use;
* engine answers: :func:`note_status` / :func:`transport_failed` (breaker and metrics),
  :func:`engine_error_body` (an engine's error as an OpenAI error body), :func:`read_whole`
  (a whole body under the idle timeout), :func:`relay_sse` (a stream to the client, cut at
  event boundaries).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

import orjson

from motor._fast.reqid import RequestIds
from motor._fast.reqscan import scan_request
from motor.config.schema import CoordinatorConfig, EngineKind, Role
from motor.coordinator import metrics
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.observe import CURRENT, Obs
from motor.coordinator.policy import RequestInfo
from motor.http.client import UpstreamClosed, UpstreamResponse, UpstreamTimeout
from motor.http.server import ANSWERED, Request, Response
from motor.protocol.openai import MAX_REQUEST_ID_BYTES, error_body, max_tokens_of

#: the roles and the engine kind the request paths compare with, as module constants: on
#: Python 3.11 an enum class's attribute read goes through its metaclass's ``__getattr__``
#: hook (~850 counted instructions, ten times a plain read), on every request here
PREFILL, DECODE, UNION = Role.PREFILL, Role.DECODE, Role.UNION
_SGLANG = EngineKind.SGLANG

JSON = b"application/json"
#: client headers passed to engines (hop-by-hop and others dropped; Authorization only as
#: :attr:`Settings.forward_client_auth` says)
FORWARD_HEADERS = frozenset((b"authorization", b"content-type", b"accept", b"openai-organization",
                             b"openai-project", b"traceparent", b"tracestate"))

Headers = tuple[tuple[bytes, bytes], ...]

#: a made-up ``X-Request-Id`` (``new_request_id() -> bytes``): 32 lower-case hex digits
#: (as ``uuid4().hex``, without ``uuid4``'s object and ``getrandom`` system call per
#: request); unique, not secret (:mod:`motor._fast.reqid`). Seeded from ``os.urandom`` when
#: the process starts: its own state in each worker (they are spawned, not forked)
new_request_id = RequestIds()


class Settings:
    """The request path's configuration, read once per worker.

    Times in seconds. ``stream_idle_step_s``: streams wait for upstream chunks in steps of
    the keep-alive interval (an SSE comment to the client each), the idle timeout counting
    the silence across steps; ``keepalive_s`` is 0 when keep-alives are off.
    """

    __slots__ = ("first_byte_timeout_s", "idle_timeout_s", "keepalive_s", "stream_idle_step_s",
                 "max_attempts", "backoff_s", "backoff_max_s", "retry_statuses",
                 "token_ids_mode", "failover_on", "max_continuations", "prefill_timeout_s",
                 "fallback_to_union", "checks_keys", "env_keys", "worker_auth",
                 "forward_client_auth", "observe", "max_inflight_per_instance", "shed_waiting",
                 "slot_wait_s", "engine_max_age_s", "session_header")

    def __init__(self, cfg: CoordinatorConfig, env: dict[str, str] | os._Environ[str] | None
                 = None) -> None:
        env = os.environ if env is None else env
        t = cfg.timeouts
        self.first_byte_timeout_s: float = t.first_token_s
        self.idle_timeout_s: float = t.idle_s
        ka = t.keepalive_s
        self.keepalive_s: float = ka if 0 < ka < t.idle_s else 0.0
        self.stream_idle_step_s: float = self.keepalive_s or t.idle_s
        r = cfg.retries
        self.max_attempts: int = r.max_attempts
        self.backoff_s: float = r.backoff_s
        self.backoff_max_s: float = r.backoff_max_s
        self.retry_statuses = frozenset(r.retry_statuses)
        f = cfg.failover
        self.token_ids_mode: str = f.request_token_ids
        self.failover_on: bool = f.enabled and f.request_token_ids != "never"
        self.max_continuations: int = f.max_continuations
        self.prefill_timeout_s: float = cfg.pd.prefill_timeout_s or t.first_token_s
        self.fallback_to_union: bool = cfg.pd.fallback_to_union
        # gateway API keys (case B14; checked by the edge, motor/coordinator/edge.py): whether
        # clients must present one, and what engines get
        self.env_keys: str = env.get("MOTOR_API_KEYS", "")
        self.checks_keys: bool = bool(cfg.api_keys or cfg.api_keys_file or self.env_keys.strip(", "))
        wk = cfg.worker_api_key or env.get("MOTOR_WORKER_API_KEY") or None
        self.worker_auth: bytes | None = b"Bearer " + wk.encode() if wk else None
        # the client's Authorization goes upstream only when motor neither checks nor replaces it
        self.forward_client_auth: bool = not self.checks_keys and self.worker_auth is None
        #: tracing or the access log is on: requests carry an Obs (motor.coordinator.observe)
        self.observe: bool = cfg.tracing.enabled or cfg.access_log
        # per-instance caps and shedding on the engines' queue (EndpointTable.configure_caps)
        a = cfg.admission
        self.max_inflight_per_instance: int = a.max_inflight_per_instance
        self.shed_waiting: int = a.shed_waiting
        self.slot_wait_s: float = a.queue_timeout_s
        self.engine_max_age_s: float = cfg.kv.ttft.engine_figures_max_age_s
        # kv_affinity's session affinity reads this header (RequestInfo.session)
        ks = cfg.kv.session
        self.session_header: bytes | None = ks.header.lower().encode() if ks.enabled else None

    def backoff_delay_s(self, attempt: int) -> float:
        """Wait before attempt ``attempt`` (0-based): 0, then ``backoff_s`` doubling, capped
        at ``backoff_max_s``."""
        if attempt <= 0:
            return 0.0
        return min(self.backoff_s * (1 << (attempt - 1)), self.backoff_max_s)

    async def pause(self, attempt: int) -> None:
        """Sleep :meth:`backoff_delay_s` before a retry (no wait before the first attempt)."""
        if attempt > 0:
            await asyncio.sleep(self.backoff_delay_s(attempt))

    def ids_for(self, ep: EndpointState) -> bool:
        """Whether ``ep`` is sent ``return_token_ids`` for mid-stream failover (SGLang only
        with ``failover.request_token_ids: always``)."""
        return self.token_ids_mode == "always" or ep.engine is not _SGLANG


class Route:
    """One inference route with its metric children resolved once."""

    __slots__ = ("name", "path", "chat", "ttft", "e2e", "_status")

    def __init__(self, name: str, path: bytes) -> None:
        self.name = name
        self.path = path
        self.chat = path == b"/v1/chat/completions"
        self.ttft: Any = metrics.TTFT.labels(name)
        self.e2e = metrics.E2E.labels(name)
        self._status: dict[int, Any] = {}

    def count(self, status: int) -> None:
        """Count one answer with ``status`` (``motor_coordinator_requests_total``)."""
        inc = self._status.get(status)
        if inc is None:
            inc = self._status[status] = metrics.counter_inc(
                metrics.REQUESTS.labels(self.name, str(status)))
        inc(1.0)

    def fail(self, resp: Response, status: int, message: str, headers: Headers = (),
             param: str | None = None) -> None:
        """Answer ``status`` with an OpenAI error body (``param``: the field at fault) and
        count it."""
        self.count(status)
        resp.send(status, error_body(status, message, param), headers=headers)


class _FirstToken:
    """A route's TTFT histogram child that also tells the observed request its TTFT."""

    __slots__ = ("child",)

    def __init__(self, child: Any) -> None:
        self.child = child

    def observe(self, v: float) -> None:
        self.child.observe(v)
        obs = CURRENT.get()
        if obs is not None:
            obs.first_token(v)


class ObservedRoute(Route):
    """A :class:`Route` of a worker that observes its requests (tracing or the access
    log): the status counted and the first token also go to the request's :class:`Obs`."""

    __slots__ = ()

    def __init__(self, name: str, path: bytes) -> None:
        super().__init__(name, path)
        self.ttft = _FirstToken(self.ttft)

    def count(self, status: int) -> None:
        super().count(status)
        obs = CURRENT.get()
        if obs is not None:
            obs.status = status




class RequestPath:
    """A deployment mode's request path: ``await path.handle(route, req, resp)`` answers one
    inference request, exactly once. ``routes`` lists extra (method, path, handler) the mode
    serves."""

    name: ClassVar[str] = ""

    def handle(self, route: Route, req: Request, resp: Response) -> Awaitable[object]:
        raise NotImplementedError

    def routes(self) -> list[tuple[str, str, Callable[[Request, Response], Any]]]:
        return []


class Parsed:
    """One inference request as parsed once (:func:`parse_request`).

    ``body``: the JSON body as a dict, parsed on first use when :func:`parse_request` read
    what it needs from the bytes (:func:`motor._fast.reqscan.scan_request`; a round-robin
    request answered whole never parses it). ``fwd``: headers for the engines (with
    ``x-request-id``); ``rid_header``: the ``X-Request-Id`` header of motor's answer;
    ``stream``: the body's ``stream`` is ``true``; ``max_tokens``: :func:`max_tokens_of` (0
    when absent); ``plain``: the scan found none of the members a stream's failover set-up
    reads but the length bound, whose value
    (:func:`~motor.protocol.openai.max_tokens_field`: an integer or
    ``None``) is ``bound`` (:func:`~motor._fast.reqscan.scan_request`; ``False`` when the
    body was parsed here); ``t0``: ``time.perf_counter()`` at arrival; ``session``: the
    session header's value (``coordinator.kv.session.header``) or None.
    """

    __slots__ = ("raw", "_body", "model", "fwd", "rid", "rid_header", "stream", "max_tokens",
                 "plain", "bound", "t0", "session")

    #: the request's observation record (:class:`ObservedParsed`); ``None``: not observed
    obs: Obs | None = None

    def __init__(self, raw: bytes, body: dict[str, Any] | None, model: str | None,
                 fwd: list[tuple[bytes, bytes]], rid: bytes, chat: bool, t0: float,
                 stream: bool = False, max_tokens: int = 0, plain: bool = False,
                 bound: int | None = None) -> None:
        """``body`` ``None``: not parsed yet (``raw`` is valid JSON; ``stream``,
        ``max_tokens``, ``plain`` and ``bound`` as the scan read them); else ``stream`` and
        ``max_tokens`` are read from ``body`` and ``plain`` is ``False``."""
        self.raw = raw
        self._body = body
        self.model = model
        self.fwd = fwd
        self.rid = rid
        self.rid_header: Headers = ((b"x-request-id", rid),)
        if body is not None:
            stream = body.get("stream") is True
            max_tokens = max_tokens_of(body, chat)
            plain = False
        self.stream = stream
        self.max_tokens = max_tokens
        self.plain = plain
        self.bound = bound
        self.t0 = t0
        self.session: bytes | None = None

    @property
    def body(self) -> dict[str, Any]:
        """The JSON body (``orjson.loads`` of :attr:`raw` on first use, then kept)."""
        b = self._body
        if b is None:
            b = self._body = orjson.loads(self.raw)
        return b

    def info(self, raw_len: int | None = None) -> RequestInfo:
        """What policies see of the request (prompt size from ``raw_len`` bytes, default
        the client's body)."""
        n = len(self.raw) if raw_len is None else raw_len
        b = self._body      # not parsed: the scan found no token-id prompt
        info = RequestInfo(self.model, estimate_prompt_tokens(b, n) if b is not None
                           else max(1, n // 4), self.max_tokens)
        info.session = self.session
        return info


class ObservedParsed(Parsed):
    """A :class:`Parsed` request of a worker that observes its requests."""

    __slots__ = ("obs",)


def estimate_prompt_tokens(body: dict[str, Any], raw_len: int) -> int:
    """A cheap prompt-size estimate for load accounting: the length of a token-id prompt,
    else about 4 bytes a token of the body (at least 1)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], int):
        return len(p)
    return max(1, raw_len // 4)


def json_type(v: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def parse_request(s: Settings, route: Route, req: Request, resp: Response,
                  fields: dict[str, Any] | None = None) -> Parsed | None:
    """The checks every inference route shares: the body is a JSON object, ``model`` a
    string, a chat's ``messages`` a non-empty array (OpenAI and vLLM answer 400 otherwise),
    ``X-Request-Id`` honoured (made up when absent or empty, 400 above
    :data:`MAX_REQUEST_ID_BYTES`, case B15); headers to forward, with the worker key when one
    is set. ``fields``: what a body that is not JSON (a multipart form) said of ``model`` and
    ``stream``, read by the caller. A JSON body is read in place
    (:func:`~motor._fast.reqscan.scan_request`) when the scan decides it, else parsed and
    checked here (the errors' words come from these checks). Returns ``None`` after
    answering 400."""
    t0 = time.perf_counter()
    body: Any = None
    stream = plain = False
    max_tokens = 0
    bound = None
    scanned = scan_request(req.body, route.chat) if fields is None else None
    if scanned is not None:     # valid, checked: parsed when something needs the dict
        model, stream, max_tokens, plain, bound = scanned
    else:
        if fields is not None:
            body = fields
        else:
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError as e:
                route.fail(resp, 400, f"request body is not valid JSON: {e}")
                return None
        if not isinstance(body, dict):
            route.fail(resp, 400, f"request body is expected to be a JSON object, "
                                  f"got {json_type(body)}")
            return None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            route.fail(resp, 400,
                       f"model is expected to be a string, got {type(model).__name__}")
            return None
        if route.chat:
            # OpenAI and vLLM refuse a chat without messages (400); no engine needs to see it
            msgs = body.get("messages")
            if type(msgs) is not list or not msgs:
                got = "an empty array" if msgs == [] else \
                    json_type(msgs) if "messages" in body else "no messages field"
                route.fail(resp, 400, f"messages is expected to be a non-empty array of "
                                      f"messages, got {got}", param="messages")
                return None
    fwd: list[tuple[bytes, bytes]] = []
    rid = None
    session = None
    session_header = s.session_header
    forward_auth = s.forward_client_auth
    for k, v in req.headers:
        if k in FORWARD_HEADERS:
            if k != b"authorization" or forward_auth:
                fwd.append((k, v))
        elif k == b"x-request-id" and v:  # an empty id is made up like a missing one
            rid = v
            if len(v) > MAX_REQUEST_ID_BYTES:
                route.fail(resp, 400, f"x-request-id is expected to be at most "
                                      f"{MAX_REQUEST_ID_BYTES} bytes, got {len(v)}")
                return None
        elif k == session_header and v:
            session = v
    if rid is None:
        rid = new_request_id()
    fwd.append((b"x-request-id", rid))
    if s.worker_auth is not None:
        fwd.append((b"authorization", s.worker_auth))
    if s.observe:
        obs = CURRENT.get()
        if obs is not None:
            op = ObservedParsed(req.body, body, model, fwd, rid, route.chat, t0, stream,
                                max_tokens, plain, bound)
            op.obs = obs
            op.session = session
            obs.parsed(rid, model)
            return op
    p = Parsed(req.body, body, model, fwd, rid, route.chat, t0, stream, max_tokens, plain,
               bound)
    p.session = session
    return p


# -- engine answers ---------------------------------------------------------------------
def note_status(ep: EndpointState, status: int) -> None:
    """An engine answered ``status``: a 5xx other than 503 counts against its breaker (and
    ``upstream_errors{kind="status"}``), anything else for it."""
    if status >= 500 and status != 503:
        ep.failed()
        metrics.UPSTREAM_ERRORS.labels(ep.url, "status").inc()
    else:
        ep.succeeded()


def transport_failed(ep: EndpointState, e: BaseException) -> str | None:
    """Count a transport failure on ``ep`` (``upstream_errors``, breaker) before any answer
    reached the client. Returns the retry reason (``connect_timeout``, ``connect`` for a
    refused connection, ``closed``) when the request may go to another endpoint; ``None``
    for a timeout once connected (the engine may be working on it: not retried). A wait for a
    free pooled connection that timed out (``pool_wait``) is retried, not held against the
    endpoint's breaker."""
    if isinstance(e, UpstreamTimeout):
        if e.phase == "pool":   # every connection busy: a full endpoint, not a failing one
            metrics.UPSTREAM_ERRORS.labels(ep.url, "pool_wait").inc()
            return "pool_wait"
        metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
        ep.failed()
        return "connect_timeout" if e.phase == "connect" else None
    refused = isinstance(e, ConnectionRefusedError)
    kind = "connect" if refused else "closed"
    metrics.UPSTREAM_ERRORS.labels(ep.url, kind).inc()
    ep.failed(certain=refused)
    return kind


def settle_leg(ep: EndpointState, err: BaseException | None, engine_ok: bool) -> None:
    """A stream's leg on ``ep`` ended: count it for or against the breaker (``err``, the
    transport error that ended it, also in ``upstream_errors{kind="closed"}``)."""
    if engine_ok:
        ep.succeeded()
        return
    if err is not None:
        metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
    ep.failed()


def failure_text(ep: EndpointState, e: BaseException) -> str:
    """``e`` on ``ep`` for an error message."""
    if isinstance(e, UpstreamTimeout):
        return f"{ep.url}: {e}"
    return f"{ep.url}: {type(e).__name__}: {e}"


def is_openai_error(body: bytes) -> bool:
    """Whether ``body`` is a JSON object with an ``error`` object (OpenAI's error shape)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


def engine_error_body(status: int, data: bytes) -> bytes:
    """An engine's error answer for the client: as sent when it is an OpenAI error body,
    else wrapped into one (status kept, the first 512 bytes quoted)."""
    if is_openai_error(data):
        return data
    return error_body(status, f"engine answered {status}: "
                              f"{data[:512].decode('utf-8', 'replace')}")


class Silence:
    """Upstream silence counted across idle steps: an upstream opened with an idle step
    shorter than the idle timeout (a stream's keep-alive step) raises
    :class:`UpstreamTimeout` at each step; :meth:`waited` adds the step and raises
    ``UpstreamTimeout("idle", idle_timeout_s)`` once the total reaches the idle timeout.
    Any other timeout (connect, first byte, a step as long as the idle timeout) is
    re-raised as it is. Made at the first step, dropped when a chunk arrives."""

    __slots__ = ("idle_timeout_s", "total")

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.total = 0.0

    def waited(self, e: UpstreamTimeout) -> None:
        if e.phase != "idle" or e.timeout_s >= self.idle_timeout_s:
            raise e
        self.total += e.timeout_s
        if self.total >= self.idle_timeout_s:
            raise UpstreamTimeout("idle", self.idle_timeout_s) from None


async def read_whole(up: UpstreamResponse, idle_timeout_s: float) -> bytes:
    """The rest of ``up``'s body.

    ``up`` may have been opened with an idle step shorter than ``idle_timeout_s`` (a stream's
    keep-alive step): silence is counted across steps and reset by every chunk, and
    :class:`UpstreamTimeout` ``("idle", idle_timeout_s)`` is raised once it reaches
    ``idle_timeout_s``. Other timeouts (first byte, a step as long as the idle timeout) and
    :class:`UpstreamClosed` / ``OSError`` propagate as raised. Does not close ``up``.
    """
    parts: list[bytes] = []
    silence: Silence | None = None
    while True:
        try:
            chunk = await up.next_chunk()
        except UpstreamTimeout as e:
            if silence is None:
                silence = Silence(idle_timeout_s)
            silence.waited(e)
            continue
        if chunk is None:
            return b"".join(parts)
        silence = None
        parts.append(chunk)


# -- streams ----------------------------------------------------------------------------
class SseFeed(Protocol):
    """Rewrites whole SSE events on their way to the client (``b""`` = drop them)."""

    def feed(self, block: bytes) -> bytes: ...


_ROLE_PREAMBLE = b'"role":"assistant","content":""'
KEEPALIVE = b": keep-alive\n\n"


def past_prefill(block: bytes) -> bool:
    """Whether a block of whole SSE events holds one that follows the prefill: anything
    but keep-alive comments and the chat role preamble (``delta`` = role + empty content,
    which vLLM and SGLang send with the first token but ``motor sim`` sends on arrival)."""
    i = 0
    n = len(block)
    while i < n:       # event by event, not split whole: the answer is almost always the first
        j = block.find(b"\n\n", i)
        if j < 0:
            j = n
        ev = block[i:j].strip()
        if ev and not ev.startswith(b":") and _ROLE_PREAMBLE not in ev:
            return True
        i = j + 2
    return False


#: an engine's SSE event (the bytes up to its blank line) above this ends the leg as an
#: upstream failure: a stream without event boundaries is not held in memory without end
MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024


def relay_sse(up: UpstreamResponse, resp: Response, rec: SseFeed | None, route: Route,
              t0: float, first: bool, idle_timeout_s: float,
              on_first: Callable[[], object] | None = None,
              on_prefill_done: Callable[[], object] | None = None,
              timing: metrics.InstanceTiming | None = None
              ) -> Awaitable[tuple[BaseException | None, bool]]:
    """:func:`relay_sse_py` (what to await): the compiled relay (:mod:`motor._fast.relay`,
    the same behaviour) when ``up`` is the compiled client's answer."""
    if type(up) is _COMPILED_UP:
        return _relay.relay_sse(up, resp, rec, route, t0, first,  # type: ignore[arg-type]
                                idle_timeout_s, on_first, on_prefill_done, timing)
    return relay_sse_py(up, resp, rec, route, t0, first, idle_timeout_s, on_first,
                        on_prefill_done, timing)


async def relay_sse_py(up: UpstreamResponse, resp: Response, rec: SseFeed | None,
                       route: Route, t0: float, first: bool, idle_timeout_s: float,
                       on_first: Callable[[], object] | None = None,
                       on_prefill_done: Callable[[], object] | None = None,
                       timing: metrics.InstanceTiming | None = None
                       ) -> tuple[BaseException | None, bool]:
    """Relay one leg's SSE events to the client (already started), cut at event
    boundaries, each block passed through ``rec.feed``. Upstream silence longer than
    ``up``'s idle step sends a keep-alive comment; silence reaching ``idle_timeout_s`` in
    total ends the leg with :class:`UpstreamTimeout`. ``first``: whether no event reached
    the client yet (``route.ttft`` is observed, ``on_first`` called, at the first one);
    ``on_prefill_done``: called once, at this leg's first event past its prefill
    (:func:`past_prefill`), after that event was written to the client (its work, e.g. a
    policy's learning, does not delay the first token). ``timing``: the leg's instance's latency histograms
    (:func:`motor.coordinator.metrics.instance_timing`): its TTFT is observed with the
    route's, and, when the leg ends without error, its TPOT: seconds from the first event
    past the prefill to the end, divided by the ``data:`` events relayed after it
    (``[DONE]`` not counted; not observed without such events).

    Returns (the error that ended the leg or ``None``, whether anything was written). A
    tail without a closing blank line is passed on as sent (case B04 b); an event longer
    than :data:`MAX_SSE_EVENT_BYTES` ends the leg with :class:`UpstreamClosed`.

    A corked answer (``Response.cork``) is flushed before every wait and when the leg ends
    with an error; after a leg that ended without one, what it wrote last may still be held
    back for the caller's ``end`` (one write with the end of the answer), or its ``flush``.
    """
    tail = b""
    wrote = False
    silence: Silence | None = None
    t_tok = 0.0      # the first event past the prefill (timing only)
    n_tok = 0        # data events relayed after it
    flush = getattr(resp, "flush", None)
    try:
        while True:
            if flush is not None:
                flush()
            try:
                chunk = await up.next_chunk()
            except UpstreamTimeout as e:
                if silence is None:
                    silence = Silence(idle_timeout_s)
                silence.waited(e)
                resp.write(KEEPALIVE)
                continue
            if chunk is None:
                break
            silence = None
            if tail:
                chunk = tail + chunk
                tail = b""
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                tail = chunk
                if len(tail) > MAX_SSE_EVENT_BYTES:
                    up.close()
                    raise UpstreamClosed(f"SSE event larger than {MAX_SSE_EVENT_BYTES} bytes "
                                         f"from the engine", before_response=False)
                continue
            if cut + 2 < len(chunk):
                tail = chunk[cut + 2:]
                chunk = chunk[:cut + 2]
            done_now = None     # on_prefill_done, called once this block is written
            if t_tok:
                n_tok += chunk.count(b"data:") - chunk.count(b"[DONE]")
            elif (on_prefill_done is not None or timing is not None) and past_prefill(chunk):
                done_now, on_prefill_done = on_prefill_done, None
                if timing is not None:
                    t_tok = time.perf_counter()
            if rec is not None:
                chunk = rec.feed(chunk)
                if not chunk:
                    if done_now is not None:
                        done_now()
                    continue
            resp.write(chunk)
            wrote = True
            if first:
                first = False
                ttft = time.perf_counter() - t0
                route.ttft.observe(ttft)
                if timing is not None:
                    timing.ttft.observe(ttft)
                if on_first is not None:
                    on_first()
            if done_now is not None:    # the load's release and the policy's learning
                done_now()              # (kv_affinity: a fit) after the token went out
            if flush is not None:
                flush()
            await resp.drain()
    except (UpstreamTimeout, UpstreamClosed, OSError) as e:
        if flush is not None:
            flush()
        return e, wrote
    if n_tok > 0:
        assert timing is not None
        timing.tpot.observe((time.perf_counter() - t_tok) / n_tok)
    if tail:
        if rec is not None:
            tail = rec.feed(tail + b"\n\n")
        resp.write(tail)
        wrote = True
    return None, wrote


try:
    from motor._fast import relay as _relay
    from motor._fast.http1 import READY as _READY
    from motor._fast.upstream import UpstreamResponse as _CompiledUp
    _relay.bind(UpstreamTimeout, UpstreamClosed, Silence, KEEPALIVE,
                MAX_SSE_EVENT_BYTES, _READY)
    _COMPILED_UP: type | None = _CompiledUp
except ImportError:     # pragma: no cover - the extensions not built: the reference only
    _COMPILED_UP = None


__all__ = ["ANSWERED", "FORWARD_HEADERS", "JSON", "KEEPALIVE", "ObservedParsed", "ObservedRoute",
           "Parsed", "RequestPath", "Route", "Settings",
           "Silence", "SseFeed", "engine_error_body", "estimate_prompt_tokens", "failure_text",
           "is_openai_error", "json_type", "note_status", "parse_request", "past_prefill",
           "read_whole", "relay_sse", "relay_sse_py", "settle_leg", "transport_failed"]

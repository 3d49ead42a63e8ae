"""The gateway's edge: what an inference request passes before its mode's request path.

In order (docs/security.md):

1. **API key** (:mod:`motor.coordinator.keys`): ``Authorization: Bearer <key>``; a missing or
   unknown key gets 401 and reaches nothing else. The key's *name* follows the request.
   Without keys every request is ``anonymous``.
2. **Rate limit** (:mod:`motor.coordinator.ratelimit`): the key's requests and tokens per
   minute. Refused: 429 with an OpenAI error body (``code: rate_limit_exceeded``, ``type``
   ``requests`` or ``tokens``), ``Retry-After`` and the ``x-ratelimit-*`` headers.
3. **Admission** (:mod:`motor.coordinator.admission`): a cap on requests in flight, a bounded
   queue by priority class (the request's ``x-motor-priority`` header, else its key's
   ``priority``), fair turns between keys inside a class. Refused: 503 with
   ``Retry-After``.

Then the request path runs; when it ends, the slot is given back and the token estimate
replaced by the answer's ``usage.total_tokens`` (read from the bytes sent to the client,
``Response.tap``, only for keys with a token limit).

The token estimate at admission: prompt bytes / 4 (about 4 bytes per token in English
text for BPE tokenizers) + ``max_tokens`` / ``max_completion_tokens`` when given, found by a
byte scan of the body (no JSON parse here; the request path parses it once).
"""
from __future__ import annotations

import logging
import math
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from motor.config.schema import CoordinatorConfig
from motor.coordinator import metrics
from motor.coordinator.admission import Admission, Refused
from motor.coordinator.keys import KeyStore
from motor.coordinator.observe import CURRENT
from motor.coordinator.ratelimit import Limit, RateLimiter
from motor.coordinator.ratetable import RateTable, SharedRateLimiter
from motor.http.server import Request, Response
from motor.http.tls import CertReloader, client_context, server_context
from motor.protocol.openai import error_body

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
_MAX_TOKENS = re.compile(rb'"max(?:_completion)?_tokens"\s*:\s*([0-9]{1,9})')
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*([0-9]{1,12})')

Handle = Callable[[Any, Request, Response], Awaitable[object]]


def key_entries(cfg: CoordinatorConfig, env_keys: str) -> list[tuple[str | None, str, str]]:
    """(name, entry, where) of ``coordinator.api_keys`` and of ``MOTOR_API_KEYS``
    (comma-separated)."""
    out: list[tuple[str | None, str, str]] = []
    for i, k in enumerate(cfg.api_keys):
        where = f"coordinator.api_keys[{i}]"
        out.append((None, k, where) if isinstance(k, str) else (k.name, k.key, where))
    out += [(None, k.strip(), "MOTOR_API_KEYS") for k in env_keys.split(",") if k.strip()]
    return out


def tls_contexts(c: CoordinatorConfig, https_backends: bool = False) -> tuple[
        ssl.SSLContext | None, CertReloader | None, ssl.SSLContext | None]:
    """(API port's server context, its reloader, the engines' client context) of ``c``:
    the server ones with ``coordinator.tls`` set, the client one when some backend is HTTPS
    or ``upstream_tls`` names files.

    Raises
    ------
    ConfigError
        naming the field and the file that is missing or does not load.
    """
    srv = reloader = None
    t = c.tls
    if t is not None:
        srv = server_context(t.cert_file, t.key_file, t.key_password_file, t.client_ca_file,
                             host=c.host)
        reloader = CertReloader(srv, t.cert_file, t.key_file, t.key_password_file,
                                t.client_ca_file)
    u = c.upstream_tls
    cli = None
    if https_backends or u.ca_file or u.cert_file:
        cli = client_context(u.ca_file, u.verify, u.cert_file, u.key_file, u.key_password_file)
    return srv, reloader, cli


def check_edge(c: CoordinatorConfig, env_keys: str = "", https_backends: bool = False) -> None:
    """Read the key sources and the TLS files of ``c`` now, so that a bad one is an error
    before any process starts (``motor up``, ``motor coordinator``).

    Raises
    ------
    ConfigError
        naming the field (and the file) at fault.
    """
    Edge(c, env_keys)
    tls_contexts(c, https_backends)


def estimate_tokens(body: bytes) -> int:
    """Tokens a request may cost at most, before the engine says: prompt bytes / 4 plus the
    ``max_tokens`` it asks for."""
    m = _MAX_TOKENS.search(body)
    return len(body) // 4 + (int(m.group(1)) if m else 0)


_WWW_AUTH = ((b"www-authenticate", b'Bearer realm="motor"'),)


def _unauthorized_body(had_header: bool) -> bytes:
    """OpenAI's 401 body (``code: invalid_api_key``)."""
    msg = "Incorrect API key provided." if had_header else \
        "Missing API key: send it as `Authorization: Bearer <key>`."
    return orjson.dumps({"error": {"message": msg, "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}})


def _rate_limited_body(name: str, kind: str, wait_s: float) -> bytes:
    """OpenAI's 429 body (``code: rate_limit_exceeded``, ``type`` the limit that refused)."""
    return orjson.dumps({"error": {"message": f"Rate limit reached for {name} on {kind} per "
                                              f"minute; please try again in {wait_s:.2f}s.",
                                   "type": kind, "param": None,
                                   "code": "rate_limit_exceeded"}})


class _UsageTap:
    """Remembers the last ``usage.total_tokens`` seen in the bytes sent to the client
    (``then``: a tap set before, the access log's, still called)."""

    __slots__ = ("total", "then")

    def __init__(self, then: Callable[[bytes], None] | None = None) -> None:
        self.total: int | None = None
        self.then = then

    def __call__(self, data: bytes) -> None:
        if self.then is not None:
            self.then(data)
        if b'"total_tokens"' in data:
            for m in _TOTAL_TOKENS.finditer(data):
                self.total = int(m.group(1))


class Edge:
    """API keys, rate limits and admission of one coordinator worker.

    Parameters
    ----------
    cfg : CoordinatorConfig
    env_keys : str
        the ``MOTOR_API_KEYS`` value.
    share : float
        fraction of every rate limit this worker enforces (``1 / workers``) when the limits
        are not shared.
    rate_table : RateTable, optional
        the shared rate-limit table of a multi-worker coordinator
        (:mod:`motor.coordinator.ratetable`): every limit then holds for all the workers
        together, counted in row ``worker``.
    worker : int
        this worker's index.

    Raises
    ------
    ConfigError
        from the key sources (:class:`motor.coordinator.keys.KeyStore`).
    """

    def __init__(self, cfg: CoordinatorConfig, env_keys: str = "", share: float = 1.0,
                 rate_table: RateTable | None = None, worker: int = 0) -> None:
        entries = key_entries(cfg, env_keys)
        self.keys: KeyStore | None = KeyStore(entries, cfg.api_keys_file) \
            if entries or cfg.api_keys_file else None
        lim = cfg.limits

        def limit(k: Any) -> Limit:
            return Limit(rpm=k.rpm, tpm=k.tpm)
        limits = {n: limit(k) for n, k in lim.keys.items()}
        limiter = RateLimiter(limits, limit(lim.default), burst_s=lim.burst_s, share=share) \
            if rate_table is None else \
            SharedRateLimiter(limits, limit(lim.default), lim.burst_s, rate_table, worker)
        self.limiter: RateLimiter | None = limiter if limiter.enabled else None
        self._tpm_keys = {n for n, k in lim.keys.items() if k.tpm} | (
            {"*"} if lim.default.tpm else set())
        a = cfg.admission
        self.admission: Admission | None = None
        if a.max_in_flight > 0:
            self.admission = Admission(a.max_in_flight, a.max_queue, a.queue_timeout_s,
                                       a.classes, {n: k.weight for n, k in lim.keys.items()},
                                       max_wait_s=a.max_wait_s, predict=a.predict)
            self.admission.on_queued = metrics.ADMISSION_QUEUED.set
        self.priority_header = a.priority_header.lower().encode()
        if self.keys is not None and not cfg.api_keys_file and not env_keys.strip(", "):
            # every key is in the config: a limit naming no key is most likely a typo
            for n in lim.keys:
                if n not in self.keys.names:
                    logger.warning("coordinator.limits.keys.%s: no API key is named %r (names: "
                                   "%s); the limit applies to no one", n, n,
                                   ", ".join(sorted(self.keys.names)))
        self._classes = list(a.classes)
        self._key_class = {n: k.priority for n, k in lim.keys.items() if k.priority}
        self._default_class = lim.default.priority
        #: whether requests are observed (motor.coordinator.observe): set by the worker
        self.observed = False

    @property
    def active(self) -> bool:
        """Whether any edge step is on (else the request path is called directly)."""
        return self.keys is not None or self.limiter is not None or self.admission is not None

    # -- 1. API key -------------------------------------------------------------------------
    async def authenticate(self, req: Request, resp: Response,
                           route: Any = None) -> str | None:
        """The key name of ``req`` (``anonymous`` without keys); ``None`` = answered 401."""
        ks = self.keys
        if ks is None or not ks.enabled:
            return ANONYMOUS
        h = req.header(b"authorization") or b""
        scheme, _, key = h.strip().partition(b" ")
        name = None
        if scheme.lower() == b"bearer" and key.strip():
            key = key.strip()
            name = ks.lookup(key)
            if name is None and ks.has_hashed:
                name = await ks.verify(key)
        if name is None:
            if route is not None:
                route.count(401)
            metrics.EDGE_REQUESTS.labels(ANONYMOUS, "unauthorized").inc()
            resp.send(401, _unauthorized_body(bool(h)), headers=_WWW_AUTH)
        return name

    def early_refusal(self, headers: list[tuple[bytes, bytes]]
                      ) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]] | None:
        """The answer the headers alone decide, for ``Expect: 100-continue`` (sent instead of
        the 100, so a refused client does not upload its body): 401 for a missing or unknown
        key (a key never checked against the hashed entries passes: that takes a derivation
        off the loop, after the body), 429 for a key
        whose request bucket is empty. ``None``: let the body come."""
        ks = self.keys
        name = ANONYMOUS
        if ks is not None and ks.enabled:
            auth = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, key = auth.strip().partition(b" ")
            key = key.strip()
            found = ks.lookup(key) if scheme.lower() == b"bearer" and key else None
            if found is None:
                if key and ks.has_hashed and not ks.known_bad(key):
                    return None   # may match a hashed entry: verified off the loop later
                metrics.EDGE_REQUESTS.labels(ANONYMOUS, "unauthorized").inc()
                return 401, _unauthorized_body(bool(auth)), _WWW_AUTH
            name = found
        if self.limiter is not None:
            refused = self.limiter.peek(name)
            if refused is not None:
                wait_s, kind, hdrs = refused
                metrics.EDGE_REQUESTS.labels(name, f"rate_limited_{kind}").inc()
                return 429, _rate_limited_body(name, kind, wait_s), \
                    ((b"retry-after", b"%d" % max(1, math.ceil(wait_s))),) + hdrs
        return None

    # -- 2 and 3, then the request path --------------------------------------------------------
    async def run(self, route: Any, req: Request, resp: Response, handle: Handle) -> None:
        """Authenticate, rate-limit and admit ``req``, then ``await handle(route, req, resp)``;
        every refusal is answered here (the request reaches no engine)."""
        name = await self.authenticate(req, resp, route)
        if name is None:
            return
        if self.observed:       # tracing or the access log: the key's name (never the key)
            obs = CURRENT.get()
            if obs is not None:
                obs.key = name
        tokens = 0
        limiter = self.limiter
        if limiter is not None:
            tokens = estimate_tokens(req.body)
            refused = limiter.admit(name, tokens)
            if refused is not None:
                self._rate_limited(route, resp, name, *refused)
                return
            resp.extra_headers = limiter.headers(name)   # as OpenAI: on every answer
        adm = self.admission
        if adm is not None:
            # the key's class; the header may pick one at or below it (a key without a
            # configured class: any class); an unknown header value is ignored
            own = self._key_class.get(name) or self._default_class
            cls = adm.class_of(own)
            hdr = req.header(self.priority_header)
            if hdr:
                asked = adm.rank_of(hdr.decode("latin-1").strip())
                if asked is not None:
                    cls = asked if own is None else max(asked, cls)
            try:
                waited = await adm.enter(name, cls)
            except Refused as e:
                if limiter is not None:
                    limiter.settle(name, tokens, 0)   # nothing was served
                self._overloaded(route, resp, name, e)
                return
            if waited:
                metrics.ADMISSION_WAIT.labels(adm.classes[cls]).observe(waited)
            started = adm.clock()
        tap = None
        if limiter is not None and (name in self._tpm_keys or (
                "*" in self._tpm_keys and name not in limiter.limits)):
            tap = resp.tap = _UsageTap(resp.tap)
        try:
            metrics.EDGE_REQUESTS.labels(name, "admitted").inc()
            await handle(route, req, resp)
        finally:
            if adm is not None:
                adm.leave(cls, started)
            if tap is not None and limiter is not None:
                used = tap.total
                limiter.settle(name, tokens, used)
                metrics.EDGE_TOKENS.labels(name).inc(tokens if used is None else used)

    def _rate_limited(self, route: Any, resp: Response, name: str, wait_s: float, kind: str,
                      headers: tuple[tuple[bytes, bytes], ...]) -> None:
        metrics.EDGE_REQUESTS.labels(name, f"rate_limited_{kind}").inc()
        if route is not None:
            route.count(429)
        retry = max(1, math.ceil(wait_s))
        resp.send(429, _rate_limited_body(name, kind, wait_s),
                  headers=((b"retry-after", b"%d" % retry),) + headers)

    def _overloaded(self, route: Any, resp: Response, name: str, e: Refused) -> None:
        metrics.EDGE_REQUESTS.labels(name, e.reason.replace(" ", "_")).inc()
        if route is not None:
            route.count(503)
        why = "displaced from the queue by a request of a higher priority class" \
            if e.reason == "displaced" else \
            "the queue is predicted not to serve this request in time" \
            if e.reason == "predicted wait" else e.reason
        resp.send(503, error_body(503, f"The gateway is overloaded ({why}); please retry "
                                       f"after {e.retry_after_s} s."),
                  headers=((b"retry-after", b"%d" % e.retry_after_s),))

    def housekeeping(self) -> None:
        """Periodic: re-read the key source if it changed."""
        if self.keys is not None:
            self.keys.reload_if_changed()

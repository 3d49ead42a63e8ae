"""The engine routes motor passes through: the union path for the rest of the engines' API.

Routes (:data:`ROUTES`; vLLM serves all of them, SGLang several): ``/v1/responses``,
``/v1/messages`` (Anthropic's API, as vLLM serves it), ``/tokenize``, ``/detokenize``,
``/v1/rerank`` and ``/rerank``, ``/v1/score`` and ``/score``, ``/pooling``, ``/classify``,
``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart forms). The body goes
upstream byte for byte with the forwarded headers; the answer comes back as the engine sent
it (SSE records with their ``event:`` lines relayed event by event), with the union path's
retries before the first byte, limits and metrics. Routing is by ``model`` (a JSON field, or
the ``model`` field of an audio route's multipart form), over the union instances, or when there are none
(a PD deployment), the decode instances, else the prefill ones. Streams are not continued
mid-way (no token ids to continue from); one that broke before its first event is restarted.

Stateful responses (case N03): ``/v1/responses`` answers are stored by the engine that made
them (``store`` defaults to true), and a request naming ``previous_response_id`` must reach
that engine. This worker remembers which endpoint answered each response id (the answer's
``id``, or the ``response.created`` event of a stream; the last :data:`MAX_RESPONSE_IDS`);
a request for an id it does not know, or whose endpoint answers 404, is tried on other
endpoints (404 is retried for it). With ``coordinator.workers > 1`` another worker may hold
the id: the 404 retries then find the engine within ``retries.max_attempts`` attempts.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import orjson

from motor.config.schema import Role
from motor.coordinator.endpoints import EndpointState, EndpointTable
from motor.coordinator.routing.base import Parsed, RequestPath, Route, Settings, parse_request
from motor.coordinator.routing.union import UnionPath, Whole
from motor.http.server import Request, Response

logger = logging.getLogger(__name__)

#: (metric label, path) of every passed-through route
ROUTES: tuple[tuple[str, str], ...] = (
    ("responses", "/v1/responses"), ("messages", "/v1/messages"),
    ("tokenize", "/tokenize"), ("detokenize", "/detokenize"),
    ("rerank", "/v1/rerank"), ("rerank", "/rerank"), ("score", "/v1/score"),
    ("score", "/score"), ("pooling", "/pooling"), ("classify", "/classify"),
    ("transcriptions", "/v1/audio/transcriptions"), ("translations", "/v1/audio/translations"),
)
MAX_RESPONSE_IDS = 65536
_RETRY_NOT_FOUND = frozenset((404,))


#: routes whose body may be a multipart form (the model is one of its fields)
FORM_ROUTES = frozenset(("transcriptions", "translations"))
_FORM_MAX_PARTS = 64
_FORM_MAX_HEADER = 8192
_FORM_MAX_VALUE = 1024


def form_fields(ctype: bytes, body: bytes) -> dict[str, Any] | None:
    """``model`` and ``stream`` of a ``multipart/form-data`` body (RFC 7578), or ``None``
    when the body is not such a form.

    A bounded scan, not a MIME parse: the boundary from ``ctype``, then part by part with
    ``bytes.find``, reading each part's header block (at most 8 KiB) and only the small
    values of ``model`` and ``stream``; it stops when both are found or after 64 parts, so
    a large audio upload costs a few ``find`` calls, whatever its size or shape."""
    if not ctype.lower().startswith(b"multipart/form-data"):
        return None
    boundary = b""
    for param in ctype.split(b";")[1:]:
        k, _, v = param.strip().partition(b"=")
        if k.lower() == b"boundary":
            boundary = v.strip().strip(b'"')
    if not boundary:
        return None
    delim = b"--" + boundary
    out: dict[str, Any] = {}
    pos = body.find(delim)
    for _ in range(_FORM_MAX_PARTS):
        if pos < 0 or body.startswith(b"--", pos + len(delim)):
            break                                  # no more parts / the closing delimiter
        head_start = pos + len(delim)
        head_end = body.find(b"\r\n\r\n", head_start, head_start + _FORM_MAX_HEADER)
        if head_end < 0:
            break
        head = body[head_start:head_end].lower()
        nxt = body.find(b"\r\n" + delim, head_end + 4)
        name = None
        for field in (b"model", b"stream"):
            if b'name="' + field + b'"' in head:
                name = field.decode()
        if name is not None and nxt >= 0 and nxt - (head_end + 4) <= _FORM_MAX_VALUE:
            value = body[head_end + 4:nxt].decode("utf-8", "replace").strip()
            out[name] = value if name == "model" else value.lower() == "true"
            if len(out) == 2:
                break
        pos = nxt + 2 if nxt >= 0 else -1
    return out


class _ResponseTap:
    """Reads the response id of a ``/v1/responses`` stream (its ``response.created``
    event) on the way to the client; the events pass unchanged."""

    __slots__ = ("path", "ep", "seen")

    def __init__(self, path: PassthroughPath, ep: EndpointState) -> None:
        self.path = path
        self.ep = ep
        self.seen = False

    def feed(self, block: bytes) -> bytes:
        if not self.seen and b"response.created" in block:
            self.seen = True
            for line in block.split(b"\n"):
                if line.startswith(b"data:") and b"response.created" in line:
                    try:
                        obj = orjson.loads(line[5:])
                        rid = obj["response"]["id"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        continue
                    if isinstance(rid, str):
                        self.path.remember(rid, self.ep)
                    break
        return block


class PassthroughPath(RequestPath):
    """The passed-through routes over the union path (see the module docstring)."""

    name = "passthrough"

    def __init__(self, settings: Settings, table: EndpointTable, union: UnionPath) -> None:
        self.s = settings
        self.table = table
        self.union = union
        self.responses: OrderedDict[str, str] = OrderedDict()   # response id -> endpoint key

    def remember(self, response_id: str, ep: EndpointState) -> None:
        r = self.responses
        r[response_id] = ep.key
        r.move_to_end(response_id)
        if len(r) > MAX_RESPONSE_IDS:
            r.popitem(last=False)

    def candidates(self, model: str | None) -> list[EndpointState]:
        """Union instances serving ``model``; without any, decode ones, else prefill ones."""
        for role in (Role.UNION, Role.DECODE, Role.PREFILL):
            c = self.table.candidates(role, model)
            if c:
                return c
        return []

    async def handle(self, route: Route, req: Request, resp: Response) -> None:
        fields = form_fields(req.header(b"content-type") or b"", req.body) \
            if route.name in FORM_ROUTES else None
        p = parse_request(self.s, route, req, resp, fields)
        if p is None:
            return
        candidates = self.candidates(p.model)
        if not candidates:
            self.union.no_candidates(route, resp, p)
            return
        retry_also: frozenset[int] = frozenset()
        tap = None
        if route.name == "responses":
            candidates, retry_also = self._stateful(p, candidates)
            if p.body.get("store") is not False:
                def tap(ep: EndpointState) -> _ResponseTap:
                    return _ResponseTap(self, ep)
        res = await self.union.serve(route, p, resp, candidates, retry_also, tap)
        if tap is not None and isinstance(res, Whole) and res.status == 200:
            try:
                rid = orjson.loads(res.data).get("id")
            except (orjson.JSONDecodeError, AttributeError):
                rid = None
            if isinstance(rid, str):
                self.remember(rid, res.ep)

    def _stateful(self, p: Parsed, candidates: list[EndpointState]
                  ) -> tuple[list[EndpointState], frozenset[int]]:
        """A ``previous_response_id``: its endpoint first when this worker knows it, and 404
        retried on the others (the engine that stores the response is the one to find)."""
        prev = p.body.get("previous_response_id")
        if not isinstance(prev, str):
            return candidates, frozenset()
        key = self.responses.get(prev)
        if key is not None:
            held = [e for e in candidates if e.key == key]
            if held:
                return held, _RETRY_NOT_FOUND
        return candidates, _RETRY_NOT_FOUND


__all__ = ["FORM_ROUTES", "MAX_RESPONSE_IDS", "ROUTES", "PassthroughPath", "form_fields"]

"""One ingress worker's HTTP routes: inference routes, gateway auth, management.

The request path of each mode lives in :mod:`motor.coordinator.routing` (``union.py``,
``pd_*.py``); this module maps the OpenAI routes onto it:

* ``POST /v1/chat/completions``, ``/v1/completions``: the mode's request path;
* ``POST /v1/embeddings`` and the rest of the engines' API (``/v1/responses``,
  ``/tokenize``, rerank, score, audio...: :data:`motor.coordinator.routing.passthrough.ROUTES`):
  by model, passed through; ``/generate`` (SGLang's native API): the bootstrap handshake in
  ``pd_bootstrap``, passed through in the other modes;
* ``GET /v1/models``: the models of every routable endpoint, aggregated;
  ``GET /v1/models/{model}``: one of them (404 for another id);
* ``GET /health``, ``/liveness``, ``/readiness`` (:mod:`motor.coordinator.probes`),
  ``/metrics`` (Prometheus text), ``/instances`` (this worker's endpoint table);
* whatever the mode adds (``POST /v1/metaserver`` in ``pd_decode_first``).

With ``api_keys`` set (or ``MOTOR_API_KEYS``), a request to an inference route or
``/v1/models`` without one of them as ``Authorization: Bearer`` gets 401 before anything
else (case B14); management routes stay open.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson

from motor.config.schema import CoordinatorConfig, DeploymentMode
from motor.coordinator import probes
from motor.coordinator.edge import Edge
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.loadtable import GONE, LISTENING, LoadTable
from motor.coordinator.metrics import render_metrics
from motor.coordinator.observe import Observer, observer
from motor.coordinator.policy import Policy
from motor.coordinator.ratetable import RateTable
from motor.coordinator.routing import UnionPath, make_path
from motor.coordinator.routing.base import ObservedRoute, RequestPath, Route, Settings
from motor.coordinator.routing.passthrough import ROUTES, PassthroughPath
from motor.http.server import Request, Response, Router, origin_form
from motor.protocol.openai import error_body

Handler = Callable[[Request, Response], Any]


class Coordinator:
    """One ingress worker: its routes (``router``) over the mode's request path (``path``).

    ``ready_source``: set by whoever fills the endpoint table (controller watcher, static
    backends, the feed link); ``/readiness`` says ready once it is set and some endpoint
    is routable (and the worker is not ``draining``). ``workers``: with several workers,
    the shared table where each publishes its readiness (:meth:`publish_ready`);
    ``/readiness`` then says ready only when every worker a connection may land on is
    (every one not gone: :mod:`motor.coordinator.loadtable`), and ``routable_endpoints`` is
    the fewest any of them routes to.
    """

    def __init__(self, cfg: CoordinatorConfig, table: EndpointTable, policy: Policy,
                 rate_table: RateTable | None = None, worker_index: int = 0) -> None:
        self.cfg = cfg
        self.table = table
        self.policy = policy
        self.settings = Settings(cfg)
        #: API keys, rate limits, admission; with several workers the limits are shared
        #: through ``rate_table`` (``share``: a worker's part of a limit it counts alone)
        self.edge = Edge(cfg, self.settings.env_keys, share=1.0 / cfg.workers,
                         rate_table=rate_table, worker=worker_index)
        #: the inference routes by path (:meth:`expect_check`, :meth:`handler_failed`)
        self._routes: dict[str, Route] = {}
        #: tracing and the access log (motor.coordinator.observe); None: both off
        self.observer: Observer | None = observer(cfg)
        self.edge.observed = self.observer is not None
        R = ObservedRoute if self.observer is not None else Route
        table.configure_breakers(cfg.breaker)
        self.ready_source: asyncio.Event | None = None
        self.worker_index = worker_index
        self.workers: LoadTable | None = None
        #: set once the worker listens (its readiness row counts from then on)
        self.listening = False
        #: set when the worker stops: it drains, and reads as not synced
        self.draining = False
        #: the union path (also the PD modes' fallback and the passed-through routes' path)
        self.union = UnionPath(self.settings, table, policy)
        self.path: RequestPath = make_path(cfg, self.settings, table, policy, self.union)
        chat = R("chat", b"/v1/chat/completions")
        cmpl = R("completions", b"/v1/completions")
        embed = R("embeddings", b"/v1/embeddings")
        generate = R("generate", b"/generate")
        r = self.router = Router()
        r.post("/v1/chat/completions")(self._inference(chat, self.path))
        r.post("/v1/completions")(self._inference(cmpl, self.path))
        #: the rest of the engines' API, passed through (routing/passthrough.py)
        self.passthrough = PassthroughPath(self.settings, table, self.union)
        r.post("/v1/embeddings")(self._inference(embed, self.passthrough))
        # SGLang's native API: disaggregated in pd_bootstrap, passed through elsewhere
        r.post("/generate")(self._inference(
            generate, self.path if cfg.mode == DeploymentMode.PD_BOOTSTRAP else self.passthrough))
        for name, route_path in ROUTES:
            r.post(route_path)(self._inference(R(name, route_path.encode()),
                                               self.passthrough))
        r.get("/v1/models")(self._on_models)
        r.add_prefix("GET", "/v1/models/", self._on_model)
        r.get("/health")(probes.health)
        r.get("/liveness")(probes.health)
        r.get("/readiness")(self._on_readiness)
        r.get("/metrics")(self._on_metrics)
        r.get("/instances")(self._on_instances)
        r.get("/cluster")(self._on_page)
        for method, route_path, handler in self.path.routes():
            r.add(method, route_path, handler)

    def expect_check(self, target: bytes, headers: list[tuple[bytes, bytes]]
                     ) -> tuple[int, bytes, tuple[tuple[bytes, bytes], ...]] | None:
        """``HttpServer.expect_check``: for an inference route, the edge's refusal the
        headers alone decide (401, 429), sent instead of ``100 Continue``."""
        if not self.edge.active:
            return None
        if not target.startswith(b"/"):
            target = origin_form(b"POST", target) or b""
        path = target.partition(b"?")[0]
        if path.decode("latin-1") not in self._routes:
            return None
        return self.edge.early_refusal(headers)

    def _inference(self, route: Route, path: RequestPath) -> Handler:
        """The handler of an inference route: ``path.handle`` for ``route``, behind the edge
        (API key, rate limit, admission: :mod:`motor.coordinator.edge`) when any of it is on;
        otherwise no wrapper coroutine is added."""
        self._routes[route.path.decode()] = route
        if not self.edge.active:
            inner: Handler = functools.partial(path.handle, route)
        else:
            inner = functools.partial(self.edge.run, route, handle=path.handle)
        if self.observer is None:
            return inner
        return functools.partial(self.observer.serve, route, inner)

    def handler_failed(self, req: Request) -> None:
        """``HttpServer.on_handler_error``: an inference request's handler raised (the
        server answered 500, or cut a stream already started): counted as a 500 in
        ``motor_coordinator_requests_total``, as every other answer is."""
        route = self._routes.get(req.path)
        if route is not None:
            route.count(500)

    def close(self) -> None:
        """The worker stops: spans still queued are exported (tracing)."""
        if self.observer is not None:
            self.observer.close()

    # -- management ---------------------------------------------------------------------
    def routable_count(self) -> int:
        now = time.monotonic()
        return sum(1 for e in self.table.endpoints.values() if e.routable(now))

    def publish_ready(self) -> tuple[bool, int]:
        """This worker's (synced, routable endpoints), written to ``workers`` when set, once
        it listens (with its state: listening, or gone once draining)."""
        synced = not self.draining and (self.ready_source is None
                                        or self.ready_source.is_set())
        routable = self.routable_count()
        # before it listens the row is the supervisor's (STARTING at a first start, GONE for
        # a successor): a successor does not count until it takes connections
        if self.workers is not None and (self.listening or self.draining):
            state = GONE if self.draining else LISTENING
            self.workers.publish_ready(self.worker_index, state, synced, routable)
        return synced, routable

    async def _on_readiness(self, req: Request, resp: Response) -> None:
        synced, routable = self.publish_ready()
        if self.workers is None:
            probes.readiness(resp, routable, synced)
            return
        rows = self.workers.readiness()
        # the workers a connection may land on: every one but those gone (dead, being
        # replaced, draining); this one answered, so it counts unless it drains
        live = [(s, r) for st, s, r in rows if st != GONE]
        probes.readiness(resp, min((r for _, r in live), default=0),
                         synced and bool(live) and all(s for s, _ in live),
                         workers_synced=[s if st != GONE else None for st, s, _ in rows],
                         workers_routable=[r if st != GONE else None for st, _, r in rows])

    async def _on_metrics(self, req: Request, resp: Response) -> None:
        resp.send(200, render_metrics(),
                  content_type=b"text/plain; version=0.0.4; charset=utf-8")

    async def _on_page(self, req: Request, resp: Response) -> None:
        """``GET /cluster``: this coordinator's view (:mod:`motor.coordinator.page`)."""
        from motor.coordinator import page
        resp.send(200, page.PAGE_BYTES, content_type=page.CONTENT_TYPE)

    async def _on_instances(self, req: Request, resp: Response) -> None:
        """The endpoints with their load; ``kv_blocks``: (tier, block) holdings of the
        endpoint in the KV index, exact + approximate (how hot its cache is, for ``motor ctl
        restart --rolling``), null without ``kv_affinity``."""
        now = time.monotonic()
        kv = getattr(self.policy, "router", None)   # the KvRouter of kv_affinity
        slots = kv.slots() if kv is not None else {}

        def kv_blocks(key: str) -> int | None:
            s = slots.get(key)
            if kv is None:
                return None
            if s is None:
                return 0
            return int(kv.exact.instance_blocks(s)) + sum(
                int(a.index.instance_blocks(s)) for a in kv.approx.values())

        out = [{"key": e.key, "instance": e.instance_id, "role": e.role.value, "url": e.url,
                "models": sorted(e.models), "ready": e.ready, "routable": e.routable(now),
                "inflight": e.inflight, "inflight_tokens": e.inflight_tokens,
                "kv_blocks": kv_blocks(e.key), "tls_error": e.tls_error}
               for e in self.table.endpoints.values()]
        resp.send(200, orjson.dumps({"version": self.table.version, "worker_pid": os.getpid(),
                                     "endpoints": out}))

    @staticmethod
    def _model_entry(model: str, created: int) -> dict[str, Any]:
        """One model object of ``GET /v1/models`` (and of ``GET /v1/models/{model}``)."""
        return {"id": model, "object": "model", "created": created, "owned_by": "motor",
                "root": model, "parent": None}

    async def _on_models(self, req: Request, resp: Response) -> None:
        """Models of every routable endpoint, aggregated (not one worker's answer)."""
        if await self.edge.authenticate(req, resp) is None:
            return
        created = int(time.time())
        data = [self._model_entry(m, created) for m in self.table.models()]
        resp.send(200, orjson.dumps({"object": "list", "data": data}))

    async def _on_model(self, req: Request, resp: Response) -> None:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the entry ``/v1/models``
        lists for that id, else 404 worded as vLLM words it (``vllm/entrypoints/openai/models/
        api_router.py`` ``retrieve_model``: ``The model `x` does not exist.``, type
        ``NotFoundError``, param ``model``). The id is the rest of the path, percent-decoded
        (the SDK sends ``Qwen%2FQwen2.5-0.5B``; a raw ``/`` works too, as vLLM's
        ``{model_id:path}``)."""
        if await self.edge.authenticate(req, resp) is None:
            return
        model = unquote_to_bytes(req.path[len("/v1/models/"):].encode("latin-1")).decode(
            "utf-8", "replace")
        if model in self.table.models():
            resp.send(200, orjson.dumps(self._model_entry(model, int(time.time()))))
        else:
            resp.send(404, error_body(404, f"The model `{model}` does not exist.", "model"))

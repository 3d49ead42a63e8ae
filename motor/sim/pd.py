"""Prefill/decode disaggregation in the simulator: the three handshakes of the real engines.

A simulator started with ``--role prefill`` or ``--role decode`` takes part in the
handshakes that motor's PD modes drive (field names as the real engines use them; see
``docs/pd.md`` for the sources):

``pd_prefill_first`` (vLLM NixlConnector, pull)
    P gets ``kv_transfer_params: {do_remote_decode: true, ...}`` and answers with a
    top-level ``kv_transfer_params`` (``do_remote_prefill: true``, ``remote_block_ids``,
    ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
    ``tp_size``); it holds the blocks until read or ``kv_lease_s`` expires. D gets those
    params, "reads" the blocks from P (``POST /sim/pd/pull`` on ``remote_host:remote_port``,
    the sim's side channel) and waits ``kv_transfer_ms_per_block`` per block. Params that
    cannot be read (expired, unknown, P gone) make D recompute the prompt, like vLLM's
    ``kv_load_failure_policy: recompute``.
``pd_decode_first`` (vLLM-Ascend metaserver)
    D gets ``kv_transfer_params: {do_remote_prefill: true, metaserver: URL}``; it POSTs
    the callback body (``request_id`` = ``chatcmpl-<X-Request-Id>`` or
    ``cmpl-<X-Request-Id>-<prompt index>``, ``remote_host``/``remote_port`` = this D, ...)
    to the URL, then waits until P pushes the KV (``POST /sim/pd/push``) or
    ``bootstrap_timeout_s`` passes (then 500). P gets the callback body as its
    ``kv_transfer_params`` and pushes to ``remote_host:remote_port`` after its prefill.
``pd_bootstrap`` (SGLang)
    P and D get ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` (scalars, or
    lists for batches / ``n`` > 1). P listens on its bootstrap port
    (``GET /server_info`` reports it as ``disaggregation_bootstrap_port``). D asks P's
    bootstrap server for each room (``POST /sim/pd/room``), which answers only once P
    has received and prefilled a request of that room: a D whose P never gets the room
    waits (until ``bootstrap_timeout_s``, then 500), like a real engine. P answers its
    own request only after D has taken the room (or 500 after ``bootstrap_timeout_s``).

The per-request faults of :mod:`motor.sim.faults` apply to either leg unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson

from motor.http import HttpServer, Request, Response, Router
from motor.http.client import Client
from motor.protocol.openai import error_body
from motor.sim.options import PdOptions, SimOptions

logger = logging.getLogger(__name__)


class PdError(Exception):
    """A handshake failed: the request is answered ``status`` with an OpenAI error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PdHost(Protocol):
    """What :class:`PdSim` reads of the simulator it belongs to (a
    :class:`motor.sim.server.SimServer`).

    Attributes
    ----------
    opts : SimOptions
        The simulator's options (``role``, ``host``, ``engine.block_size``,
        ``engine.time_scale``).
    port : int
        The bound HTTP port (the side channel's address given to the other instance).
    model_name : str
        The first served model name (``/server_info``).
    """
    opts: SimOptions
    port: int
    model_name: str

    def local_cached_blocks(self, prompts: list[list[int]], model: Any) -> int:
        """Whole prompt blocks already in this simulator's prefix cache (not transferred)."""
        ...


@dataclass
class _Room:
    blocks: int = 0
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)
    taken: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Plan:
    """What one generation request must do around its engine run."""
    mode: str = ""                       # "", "pull_source", "push_to", "bootstrap_source"
    kv_out: dict[str, Any] | None = None  # prefill-first: the params P returns
    push_to: tuple[str, int, list[str]] | None = None
    rooms: list[int] = field(default_factory=list)
    force_max_tokens_1: bool = False
    #: decode role: the prompts' KV arrived from the prefill instance (not recomputed here)
    kv_loaded: bool = False


def _blocks(prompts: list[list[int]], block_size: int) -> int:
    return sum((len(p) + block_size - 1) // block_size for p in prompts)


class PdSim:
    """The PD state of one simulator (held blocks, rooms, awaited pushes)."""

    def __init__(self, server: PdHost, opts: PdOptions) -> None:
        self.server = server
        self.opts = opts
        self.role = server.opts.role
        self.engine_id = f"sim-{secrets.token_hex(4)}"
        self.client = Client(max_connections_per_endpoint=64, connect_timeout_s=2.0)
        self.held: dict[str, tuple[int, float]] = {}   # remote_request_id -> (blocks, expiry)
        self.rooms: dict[int, _Room] = {}
        self.pushes: dict[str, asyncio.Future[int]] = {}
        self.bootstrap: HttpServer | None = None
        self.bootstrap_port: int | None = None
        self.stats = {"pulled": 0, "pulled_blocks": 0, "pull_failed": 0, "pushed": 0,
                      "callbacks": 0,
                      "rooms_taken": 0, "rooms_timed_out": 0, "kv_params_in": 0}

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self.role == "prefill":
            r = Router()
            r.add("POST", "/sim/pd/room", self._on_room)
            self.bootstrap = HttpServer(r)
            self.bootstrap_port = await self.bootstrap.listen(self.server.opts.host,
                                                              self.opts.bootstrap_port)

    async def stop(self) -> None:
        if self.bootstrap is not None:
            await self.bootstrap.shutdown(0.5)
        for f in self.pushes.values():
            f.cancel()
        self.client.close()

    def routes(self, r: Router) -> None:
        r.add("POST", "/sim/pd/pull", self._on_pull)
        r.add("POST", "/sim/pd/push", self._on_push)
        r.add("GET", "/server_info", self._on_server_info)
        r.add("GET", "/get_server_info", self._on_server_info)

    def _scaled(self, blocks: int) -> float:
        return blocks * self.opts.kv_transfer_ms_per_block / 1000.0 * \
            self.server.opts.engine.time_scale

    # -- request hooks ----------------------------------------------------------------
    async def prepare(self, body: dict[str, Any], prompts: list[list[int]], n: int,
                      base_id: str, resp_id: str, chat: bool) -> Plan:
        """Before the engine run: D acquires the KV (pull / callback + push / rendezvous);
        P notes what it must hand over afterwards. Raises :class:`PdError`."""
        plan = Plan()
        if self.role == "union":
            return plan
        bs = self.server.opts.engine.block_size
        blocks = _blocks(prompts, bs)
        ktp = body.get("kv_transfer_params")
        if ktp is not None and not isinstance(ktp, dict):
            raise PdError(400, "kv_transfer_params: Input should be a valid dictionary")
        room = body.get("bootstrap_room")
        if ktp:
            self.stats["kv_params_in"] += 1
        if self.role == "prefill":
            if ktp and ktp.get("do_remote_decode"):
                rh, rp, rid = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("request_id")
                if isinstance(rh, str) and isinstance(rp, int) and isinstance(rid, str):
                    # decode-first: the callback body came back verbatim; push to D afterwards
                    plan.mode = "push_to"
                    plan.push_to = (rh, rp, [rid])
                else:
                    plan.mode = "pull_source"
                    remote_id = f"{resp_id}-{secrets.token_hex(4)}"
                    ids = list(range(1000, 1000 + blocks))
                    plan.kv_out = {
                        "do_remote_prefill": True, "do_remote_decode": False,
                        "remote_block_ids": [ids], "remote_engine_id": self.engine_id,
                        "remote_request_id": remote_id, "remote_host": self.server.opts.host,
                        "remote_port": self.server.port, "tp_size": 1,
                        "remote_num_tokens": sum(len(p) for p in prompts)}
                    self._expire()
                    self.held[remote_id] = (blocks, time.monotonic() + self.opts.kv_lease_s)
            elif room is not None:
                plan.mode = "bootstrap_source"
                plan.force_max_tokens_1 = True
                rooms = room if isinstance(room, list) else [room]
                per = max(1, blocks // max(1, len(rooms)))
                for r in rooms:
                    if not isinstance(r, int):
                        raise PdError(400, "bootstrap_room: Input should be a valid integer")
                    self.rooms.setdefault(r, _Room()).blocks = per
                plan.rooms = rooms
            return plan
        # decode role: only the blocks past the local prefix hit cross over
        if ktp and ktp.get("do_remote_prefill"):
            local = self.server.local_cached_blocks(prompts, body.get("model"))
            if ktp.get("metaserver"):
                await self._callback_and_wait(ktp["metaserver"], prompts, base_id, chat,
                                              max(0, blocks - local))
                plan.kv_loaded = True
            elif ktp.get("remote_host") and ktp.get("remote_port"):
                plan.kv_loaded = await self._pull(ktp, local)
        elif room is not None:
            await self._rendezvous(body)
            plan.kv_loaded = True
        return plan

    async def before_answer(self, plan: Plan) -> dict[str, Any] | None:
        """After P's engine run, before its answer: hand the KV over. Returns the
        ``kv_transfer_params`` to put in the answer (prefill-first). Raises PdError."""
        if plan.mode == "pull_source":
            return plan.kv_out
        if plan.mode == "push_to" and plan.push_to is not None:
            host, port, ids = plan.push_to
            for rid in ids:
                try:
                    st, _ = await self.client.post_json_bytes(
                        host, port, "/sim/pd/push", orjson.dumps({"request_id": rid}), 5.0)
                except (TimeoutError, OSError) as e:
                    raise PdError(500, f"KV push to {host}:{port} failed: {e}") from None
                if st != 200:
                    raise PdError(500, f"KV push to {host}:{port} answered {st}")
                self.stats["pushed"] += 1
            return None
        if plan.mode == "bootstrap_source":
            try:
                for r in plan.rooms:
                    room = self.rooms.get(r)
                    if room is None:
                        continue
                    room.prefilled.set()
                for r in plan.rooms:
                    room = self.rooms.get(r)
                    if room is None:
                        continue
                    try:
                        await asyncio.wait_for(room.taken.wait(), self.opts.bootstrap_timeout_s)
                    except TimeoutError:
                        self.stats["rooms_timed_out"] += 1
                        raise PdError(500, f"bootstrap room {r}: no decode instance took the KV "
                                           f"within {self.opts.bootstrap_timeout_s:g} s") from None
            finally:
                for r in plan.rooms:
                    self.rooms.pop(r, None)
        return None

    def done(self, plan: Plan) -> None:
        """The request ended (whatever happened): forget its rooms."""
        for r in plan.rooms:
            self.rooms.pop(r, None)

    # -- decode side ------------------------------------------------------------------
    async def _pull(self, ktp: dict[str, Any], local: int = 0) -> bool:
        """Read the blocks from P but the ``local`` ones already cached here; whether they
        came (else the prompt is recomputed here, as vLLM's ``kv_load_failure_policy:
        recompute``)."""
        host, port, rid = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("remote_request_id")
        blocks = 0
        try:
            st, data = await self.client.post_json_bytes(
                str(host), int(port), "/sim/pd/pull",  # type: ignore[arg-type]
                orjson.dumps({"remote_request_id": rid}), 5.0)
            if st == 200:
                blocks = int(orjson.loads(data)["blocks"])
        except (TimeoutError, OSError, ValueError, KeyError, TypeError) as e:
            st = 0
            logger.warning("KV pull from %s:%s failed: %s", host, port, e)
        if st != 200:
            self.stats["pull_failed"] += 1   # kv_load_failure_policy recompute: go on locally
            return False
        self.stats["pulled"] += 1
        moved = max(0, blocks - local)
        self.stats["pulled_blocks"] += moved
        await asyncio.sleep(self._scaled(moved))
        return True

    async def _callback_and_wait(self, url: Any, prompts: list[list[int]], base_id: str,
                                 chat: bool, blocks: int) -> None:
        u = urlsplit(str(url))
        if u.scheme != "http" or not u.hostname:
            raise PdError(400, f"kv_transfer_params.metaserver is expected as http://HOST:PORT/PATH, "
                               f"got {url!r}")
        ids = [f"chatcmpl-{base_id}"] if chat else [f"cmpl-{base_id}-{i}" for i in range(len(prompts))]
        futs: list[asyncio.Future[int]] = []
        loop = asyncio.get_running_loop()
        bs = self.server.opts.engine.block_size
        for i, rid in enumerate(ids):
            f: asyncio.Future[int] = loop.create_future()
            self.pushes[rid] = f
            futs.append(f)
            p = prompts[min(i, len(prompts) - 1)]
            nb = (len(p) + bs - 1) // bs
            cb = {"token_ids": [], "request_id": rid, "do_remote_prefill": False,
                  "do_remote_decode": True, "remote_block_ids": list(range(2000, 2000 + nb)),
                  "remote_block_size": bs, "remote_engine_id": self.engine_id,
                  "remote_host": self.server.opts.host, "remote_port": self.server.port,
                  "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
                  "remote_cached_tokens": 0}
            asyncio.ensure_future(self._post_callback(u.hostname, u.port or 80,
                                                      u.path or "/", cb))
        try:
            await asyncio.wait_for(asyncio.gather(*futs), self.opts.bootstrap_timeout_s)
        except TimeoutError:
            raise PdError(500, f"no KV pushed by a prefill instance within "
                               f"{self.opts.bootstrap_timeout_s:g} s") from None
        finally:
            for rid in ids:
                self.pushes.pop(rid, None)
        await asyncio.sleep(self._scaled(blocks))

    async def _post_callback(self, host: str, port: int, path: str, cb: dict[str, Any]) -> None:
        """Like the connector: 3 attempts on connection errors only; the answer is ignored."""
        self.stats["callbacks"] += 1
        body = orjson.dumps(cb)
        for attempt in range(3):
            try:
                await self.client.post_json_bytes(host, port, path, body, 3600.0)
                return
            except OSError as e:
                logger.warning("metaserver POST %s:%d%s failed (attempt %d): %s", host, port,
                               path, attempt + 1, e)
            except TimeoutError:
                return

    async def _rendezvous(self, body: dict[str, Any]) -> None:
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        rooms = room if isinstance(room, list) else [room]
        hosts = host if isinstance(host, list) else [host] * len(rooms)
        ports = port if isinstance(port, list) else [port] * len(rooms)
        if len(hosts) != len(rooms) or len(ports) != len(rooms):
            raise PdError(400, "bootstrap_host / bootstrap_port / bootstrap_room lists differ "
                               "in length")

        async def one(h: Any, p: Any, r: Any) -> int:
            if not isinstance(h, str) or not isinstance(p, int) or not isinstance(r, int):
                raise PdError(400, f"bootstrap fields are invalid: host={h!r} port={p!r} room={r!r}")
            deadline = time.monotonic() + self.opts.bootstrap_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PdError(500, f"bootstrap room {r} on {h}:{p}: no KV within "
                                       f"{self.opts.bootstrap_timeout_s:g} s")
                try:
                    st, data = await self.client.post_json_bytes(
                        h, p, "/sim/pd/room", orjson.dumps({"room": r}), left)
                except (TimeoutError, OSError):
                    await asyncio.sleep(min(0.05, max(0.0, left)))
                    continue
                if st == 200:
                    return int(orjson.loads(data)["blocks"])
                await asyncio.sleep(min(0.05, max(0.0, left)))

        got = await asyncio.gather(*(one(h, p, r) for h, p, r in zip(hosts, ports, rooms)))
        await asyncio.sleep(self._scaled(sum(got)))

    # -- endpoints --------------------------------------------------------------------
    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, (_, exp) in self.held.items() if exp < now]:
            del self.held[k]

    async def _on_pull(self, req: Request, resp: Response) -> None:
        self._expire()
        try:
            rid = orjson.loads(req.body).get("remote_request_id")
        except (orjson.JSONDecodeError, AttributeError):
            rid = None
        entry = self.held.pop(rid, None) if isinstance(rid, str) else None
        if entry is None:
            resp.send(404, error_body(404, f"no KV blocks held for {rid!r}"))
            return
        resp.send(200, orjson.dumps({"blocks": entry[0], "engine_id": self.engine_id}))

    async def _on_push(self, req: Request, resp: Response) -> None:
        try:
            rid = orjson.loads(req.body).get("request_id")
        except (orjson.JSONDecodeError, AttributeError):
            rid = None
        f = self.pushes.get(rid) if isinstance(rid, str) else None
        if f is None:
            resp.send(404, error_body(404, f"no request waits for KV as {rid!r}"))
            return
        if not f.done():
            f.set_result(1)
        resp.send(200, b'{"status":"ok"}')

    async def _on_room(self, req: Request, resp: Response) -> None:
        """P's bootstrap server: wait (a short poll step) until the room was prefilled."""
        try:
            r = orjson.loads(req.body).get("room")
        except (orjson.JSONDecodeError, AttributeError):
            r = None
        room = self.rooms.get(r) if isinstance(r, int) else None
        if room is not None:
            try:
                await asyncio.wait_for(room.prefilled.wait(), 1.0)
            except TimeoutError:
                room = None
        if room is None:
            resp.send(404, error_body(404, f"room {r!r} not ready"))
            return
        room.taken.set()
        self.stats["rooms_taken"] += 1
        resp.send(200, orjson.dumps({"blocks": room.blocks}))

    async def _on_server_info(self, req: Request, resp: Response) -> None:
        s = self.server
        mode = {"prefill": "prefill", "decode": "decode"}.get(self.role, "null")
        resp.send(200, orjson.dumps({
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "served_model_name": s.model_name, "dp_size": 1, "tp_size": 1,
            "page_size": s.opts.engine.block_size, "version": "motor-sim"}))

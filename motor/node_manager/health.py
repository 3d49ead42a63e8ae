"""Engine health: ``GET <health_path>`` polling with a timeout.

An engine is healthy from its first 200 answer; once healthy it turns unhealthy after
``failures_to_unhealthy`` failed probes in a row (a transport error, a timeout or a non-200
status), so one slow answer under load does not flap the instance. A restarted engine gets
a fresh probe (the supervisor makes one per process start).

Virtual inference (:class:`VirtualInference`, DP rank 0 of engines with
``virtual_inference_on``: vLLM by default, ``sim`` when configured) catches an engine whose
``/health`` still answers but which no longer generates. It starts after the first healthy
``/health``, waits ``warmup_s``, then every ``interval_s`` sends ``POST /v1/completions``
``{"model", "prompt": "1", "max_tokens": 1, "temperature": 0}`` (a decode instance adds
``kv_transfer_params: {"do_virtual": true}``) with ``timeout_s``. While the request runs, the
AI-core use of the engine's NPUs is sampled every ``npu_sample_interval_s`` (for at least
``npu_min_window_s`` when the request fails); a round **fails only if the request failed and
every sample stayed below** ``npu_busy_pct`` (an engine that is busy is not dead; without
NPU data a failed request counts). A failed request's round waits for the sampler's first
look when it has none yet (``npu-smi`` starts slowly on a loaded node; its calls are bounded
by ``npu.timeout_s``, the wait by :data:`FIRST_LOOK_MAX_S`). ``failures`` failed rounds in
a row -> ``unhealthy`` (the instance is reported unhealthy; nothing is killed, the controller
decides); one good round clears it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

import orjson

from motor.aio import cancel_and_wait
from motor.config.schema import Role, VirtualInferenceConfig
from motor.http import Client

logger = logging.getLogger(__name__)

#: the longest a failed virtual-inference round waits for the AI-core sampler's first look
#: (its ``npu-smi`` calls have their own timeout, ``npu.timeout_s``: 5 s by default, two calls
#: when the chip table is not known yet)
FIRST_LOOK_MAX_S = 12.0


class HealthProbe:
    """Polls one endpoint until cancelled.

    Parameters
    ----------
    client : motor.http.Client
    host, port, path : where to probe
    interval_s, timeout_s : poll period and per-probe timeout
    failures_to_unhealthy : consecutive failures that turn a healthy engine unhealthy
    on_change : called with the new value whenever ``healthy`` flips
    alive : callable returning whether the engine process behind the endpoint is alive; a
        probe made while it is not is ignored (neither a success nor a failure): a 200 from
        whatever else listens on the port must not make a dead engine healthy
    """

    def __init__(self, client: Client, host: str, port: int, path: str = "/health",
                 interval_s: float = 0.5, timeout_s: float = 2.0, failures_to_unhealthy: int = 3,
                 on_change: Callable[[bool], None] | None = None, name: str = "",
                 alive: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_unhealthy = max(1, failures_to_unhealthy)
        self.on_change = on_change
        self.alive = alive
        self.name = name or f"{host}:{port}"
        self.healthy = False
        self.ever_healthy = False
        self.failures = 0
        self.last_error: str | None = None

    async def probe_once(self) -> bool:
        """One probe; True on a 200 answer."""
        try:
            status, _ = await self.client.get_json_bytes(self.host, self.port, self.path,
                                                         self.timeout_s)
        except TimeoutError:
            self.last_error = f"no answer within {self.timeout_s:g} s"
            return False
        except Exception as e:  # connection refused / reset / malformed answer
            self.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return False
        if status != 200:
            self.last_error = f"status {status}"
            return False
        self.last_error = None
        return True

    def _set(self, value: bool) -> None:
        if value == self.healthy:
            return
        self.healthy = value
        if value:
            self.ever_healthy = True
            logger.info("engine %s is healthy", self.name)
        else:
            logger.warning("engine %s is unhealthy: %s", self.name, self.last_error)
        if self.on_change is not None:
            self.on_change(value)

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled."""
        while True:
            ok = await self.probe_once()
            if self.alive is not None and not self.alive():
                # whatever answered, it was not our engine: ignore the result
                await asyncio.sleep(self.interval_s)
                continue
            if ok:
                self.failures = 0
                self._set(True)
            else:
                self.failures += 1
                if self.healthy and self.failures >= self.failures_to_unhealthy:
                    self._set(False)
            await asyncio.sleep(self.interval_s)


AicoreFn = Callable[[], Awaitable["float | None"]]
_ids = itertools.count(1)


class VirtualInference:
    """The virtual-inference probe of one engine endpoint (see the module doc).

    Parameters
    ----------
    client : motor.http.Client
    host, port : the engine endpoint (DP rank 0)
    model : str
        served model name (the request's ``model``)
    cfg : VirtualInferenceConfig
    role : Role
        ``decode`` adds ``kv_transfer_params: {"do_virtual": true}``.
    aicore : async callable or None
        current highest AI-core use (%) of the engine's NPUs, None when unknown (no npu-smi).
    on_change : called with ``unhealthy`` whenever it flips
    """

    def __init__(self, client: Client, host: str, port: int, model: str,
                 cfg: VirtualInferenceConfig, role: Role = Role.UNION,
                 aicore: AicoreFn | None = None,
                 on_change: Callable[[bool], None] | None = None, name: str = "") -> None:
        self.client = client
        self.host = host
        self.port = port
        self.cfg = cfg
        self.aicore = aicore
        self.on_change = on_change
        self.name = name or f"{host}:{port}"
        body: dict[str, object] = {"model": model, "prompt": cfg.prompt, "max_tokens": 1,
                                   "temperature": 0, "stream": False}
        if role is Role.DECODE:
            body["kv_transfer_params"] = {"do_virtual": True}
        self.body = orjson.dumps(body)
        self.state = "waiting"
        self.unhealthy = False
        self.failures = 0
        self.rounds = 0
        self.busy_rounds = 0
        self.ok_rounds = 0
        self.failed_rounds = 0
        self.last_error: str | None = None
        self.last_aicore_pct: float | None = None

    def status(self) -> dict[str, object]:
        return {"state": self.state, "failures": self.failures, "rounds": self.rounds,
                "busy_rounds": self.busy_rounds, "last_error": self.last_error,
                "last_aicore_pct": self.last_aicore_pct}

    async def request_once(self) -> str | None:
        """One completion; None on success, else why it failed."""
        rid = f"motor-virtual-{next(_ids)}".encode()
        try:
            async def go() -> tuple[int, bytes]:
                resp = await self.client.pool(self.host, self.port).request(
                    b"POST", b"/v1/completions", self.body,
                    ((b"content-type", b"application/json"), (b"x-request-id", rid)),
                    first_byte_timeout_s=self.cfg.timeout_s, idle_timeout_s=self.cfg.timeout_s)
                async with resp:
                    return resp.status, await resp.read()
            status, raw = await asyncio.wait_for(go(), self.cfg.timeout_s)
        except TimeoutError:
            return f"no answer within {self.cfg.timeout_s:g} s"
        except Exception as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if status != 200:
            return f"status {status}: {raw[:200].decode('utf-8', 'replace')}"
        try:
            doc = orjson.loads(raw)
            if not doc.get("choices"):
                return "answer without choices"
        except (orjson.JSONDecodeError, AttributeError):
            return "answer is not a JSON object"
        return None

    async def _sample(self, samples: list[float], looked: asyncio.Event) -> None:
        assert self.aicore is not None
        while True:
            try:
                v = await self.aicore()
            except asyncio.CancelledError:
                raise
            except Exception:  # the sampler logs its own failures
                v = None
            if v is not None:
                samples.append(v)
            looked.set()
            await asyncio.sleep(self.cfg.npu_sample_interval_s)

    async def round(self) -> bool:
        """One round; returns True when it counts as failed (and updates the state)."""
        self.rounds += 1
        samples: list[float] = []
        looked = asyncio.Event()     # the sampler's first look is over (a sample or none)
        sampler = asyncio.create_task(self._sample(samples, looked)) \
            if self.aicore is not None else None
        t0 = time.monotonic()
        try:
            err = await self.request_once()
            if err is not None and sampler is not None:
                rest = self.cfg.npu_min_window_s - (time.monotonic() - t0)
                if rest > 0:
                    await asyncio.sleep(rest)
                if not looked.is_set():  # always look at least once
                    try:
                        await asyncio.wait_for(looked.wait(), FIRST_LOOK_MAX_S)
                    except TimeoutError:
                        pass
        finally:
            if sampler is not None:
                await cancel_and_wait(sampler)
        self.last_aicore_pct = max(samples) if samples else None
        if err is None:
            self.ok_rounds += 1
            if self.failures or self.unhealthy:
                logger.info("engine %s: virtual inference answers again", self.name)
            self.failures = 0
            self.last_error = None
            self._set_unhealthy(False)
            self.state = "ok"
            return False
        busy = self.last_aicore_pct is not None and self.last_aicore_pct >= self.cfg.npu_busy_pct
        if busy:
            self.busy_rounds += 1
            self.last_error = (f"{err} (not counted: AI-core use {self.last_aicore_pct:g} % >= "
                               f"{self.cfg.npu_busy_pct:g} %)")
            logger.info("engine %s: virtual inference failed but the NPU is busy: %s",
                        self.name, self.last_error)
            return False
        self.failed_rounds += 1
        self.failures += 1
        self.last_error = err
        logger.warning("engine %s: virtual inference failed (%d/%d in a row): %s", self.name,
                       self.failures, self.cfg.failures, err)
        if self.failures >= self.cfg.failures:
            self._set_unhealthy(True)
        self.state = "unhealthy" if self.unhealthy else "failing"
        return True

    def _set_unhealthy(self, value: bool) -> None:
        if value == self.unhealthy:
            return
        self.unhealthy = value
        if value:
            logger.error("engine %s: %d virtual-inference rounds failed in a row: reporting the "
                         "instance unhealthy (last: %s)", self.name, self.failures, self.last_error)
        if self.on_change is not None:
            self.on_change(value)

    async def run(self) -> None:
        """Warm-up, then a round every ``interval_s``, until cancelled. Start it after the
        engine's first healthy ``/health``."""
        self.state = "warmup"
        if self.cfg.warmup_s > 0:
            logger.info("engine %s: virtual inference starts in %g s (warm-up)", self.name,
                        self.cfg.warmup_s)
            await asyncio.sleep(self.cfg.warmup_s)
        while True:
            t0 = time.monotonic()
            await self.round()
            await asyncio.sleep(max(0.0, self.cfg.interval_s - (time.monotonic() - t0)))

"""Engine health: ``GET <health_path>`` polling with a timeout.

An engine is healthy from its first 200 answer; once healthy it turns unhealthy after
``failures_to_unhealthy`` failed probes in a row (a transport error, a timeout or a non-200
status), so one slow answer under load does not flap the instance. A restarted engine gets
a fresh probe (the supervisor makes one per process start).

Issue 8 grows this module: the virtual-inference probe for vLLM (DP rank 0 only) will run
next to this one and feed the same ``healthy`` flag.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from motor.http import Client

logger = logging.getLogger(__name__)


class HealthProbe:
    """Polls one endpoint until cancelled.

    Parameters
    ----------
    client : motor.http.Client
    host, port, path : where to probe
    interval_s, timeout_s : poll period and per-probe timeout
    failures_to_unhealthy : consecutive failures that turn a healthy engine unhealthy
    on_change : called with the new value whenever ``healthy`` flips
    """

    def __init__(self, client: Client, host: str, port: int, path: str = "/health",
                 interval_s: float = 0.5, timeout_s: float = 2.0, failures_to_unhealthy: int = 3,
                 on_change: Callable[[bool], None] | None = None, name: str = "") -> None:
        self.client = client
        self.host = host
        self.port = port
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_unhealthy = max(1, failures_to_unhealthy)
        self.on_change = on_change
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
        except (asyncio.TimeoutError, TimeoutError):
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
            if ok:
                self.failures = 0
                self._set(True)
            else:
                self.failures += 1
                if self.healthy and self.failures >= self.failures_to_unhealthy:
                    self._set(False)
            await asyncio.sleep(self.interval_s)

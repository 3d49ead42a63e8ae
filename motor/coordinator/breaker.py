"""Per-endpoint circuit breaker.

States (also the gauge ``motor_coordinator_breaker_state``): 0 = closed, 1 = open,
2 = half-open.

* **closed**: requests flow. ``failure_threshold`` consecutive failures open it; a
  refused connection (nothing listens: certain death, not flakiness) opens it at once.
* **open**: the endpoint gets no request for ``open_s`` (doubling after each failed
  probe, capped at ``open_max_s``).
* **half-open**: after the open period, exactly one request goes through as a probe;
  success closes the breaker, failure opens it again for twice as long.

What counts (decided by the caller, :mod:`motor.coordinator.server`): transport errors
(connect refused / reset / connect timeout, a stream broken mid-way) and 5xx answers
other than 503 are failures; any answer below 500, 429 and 503 (back-pressure: the
engine is loaded, not dead) are successes. A client's 4xx never counts against an
endpoint. The breaker combines with the control plane's view: an endpoint routes only
while its instance is ready (controller or health probes) *and* its breaker lets it.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


class Breaker:
    """The breaker of one endpoint.

    Parameters
    ----------
    failure_threshold : int
        consecutive failures that open the breaker.
    open_s, open_max_s : float
        first and longest open period, seconds.
    on_change : callable(int) or None
        called with the new state on every transition (metrics).
    """

    __slots__ = ("state", "failures", "open_until", "probe_inflight", "threshold", "open_s",
                 "open_max_s", "_next_open_s", "on_change", "name")

    def __init__(self, failure_threshold: int = 3, open_s: float = 1.0, open_max_s: float = 30.0,
                 on_change: object | None = None, name: str = "") -> None:
        self.state = CLOSED
        self.failures = 0
        self.open_until = 0.0
        self.probe_inflight = False
        self.threshold = failure_threshold
        self.open_s = open_s
        self.open_max_s = open_max_s
        self._next_open_s = open_s
        self.on_change = on_change
        self.name = name

    def _set(self, state: int) -> None:
        if state != self.state:
            logger.info("breaker of %s: %s -> %s", self.name, STATE_NAMES[self.state],
                        STATE_NAMES[state])
            self.state = state
            if self.on_change is not None:
                self.on_change(state)  # type: ignore[operator]

    def allows(self, now: float) -> bool:
        """Whether a new request may go to the endpoint now (no state change)."""
        st = self.state
        if st == CLOSED:
            return True
        if st == OPEN:
            return now >= self.open_until
        return not self.probe_inflight

    def on_pick(self, now: float) -> None:
        """A request is about to be sent: an open breaker past its period becomes half-open
        and this request is its probe."""
        if self.state == CLOSED:
            return
        if self.state == OPEN and now >= self.open_until:
            self._set(HALF_OPEN)
        if self.state == HALF_OPEN:
            self.probe_inflight = True

    def success(self) -> None:
        self.failures = 0
        self.probe_inflight = False
        if self.state != CLOSED:
            self._next_open_s = self.open_s
            self._set(CLOSED)

    def failure(self, certain: bool = False) -> None:
        """One failure; ``certain`` (connection refused) opens the breaker at once."""
        self.failures += 1
        self.probe_inflight = False
        if self.state == HALF_OPEN or certain or self.failures >= self.threshold:
            if self.state == HALF_OPEN:
                self._next_open_s = min(self._next_open_s * 2, self.open_max_s)
            self.open_until = time.monotonic() + self._next_open_s
            self._set(OPEN)

    def configure(self, failure_threshold: int, open_s: float, open_max_s: float) -> None:
        """New settings (the next open period starts again at ``open_s``)."""
        self.threshold = failure_threshold
        self.open_s = open_s
        self.open_max_s = open_max_s
        self._next_open_s = open_s

    def probe_done(self) -> None:
        """The probe request ended without a verdict (e.g. the client left): let another probe."""
        self.probe_inflight = False

    def reset(self) -> None:
        """The control plane says the endpoint is (again) ready: start closed."""
        self.failures = 0
        self.probe_inflight = False
        self._next_open_s = self.open_s
        self._set(CLOSED)

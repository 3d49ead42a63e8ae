"""Fault injection state of one simulator (set by ``--fault ...`` flags or ``POST /admin/fault``).

Modes
-----
``none``              no fault.
``crash``             ``os._exit(1)``: at once, or with ``count`` = k when the k-th next
                      generation request arrives (before it is answered). As a start-up
                      flag without a count, the process exits with status 1 right after
                      it starts (an engine that fails to start).
``hang``              the engine loop freezes: requests are accepted and in-flight streams
                      stop, nothing is answered; ``/health`` still answers 200.
``hang_health``       ``hang``, and ``/health`` does not answer either.
``slow``              every engine step takes ``factor`` times longer.
``error``             generation requests are answered with ``status`` and an OpenAI error body.
``drop_after``        the connection is closed abruptly after ``tokens`` tokens of a response
                      (streams get no ``[DONE]``; non-streams get no answer).
``recomputed_after``  after ``tokens`` tokens the choice ends with ``finish_reason: "stop"``,
                      ``stop_reason: "recomputed"`` and no further token (vLLM-Ascend's
                      recompute scheduler).

``count`` applies to the per-request modes (``error``, ``drop_after``,
``recomputed_after``): that many next generation requests are affected, then the
mode falls back to ``none``. Absent (null) means every request.
``hang``, ``hang_health`` and ``slow`` act on the whole engine until the mode is changed.
"""
from __future__ import annotations

from typing import Any

MODES = ("none", "crash", "hang", "hang_health", "slow", "error", "drop_after",
         "recomputed_after")
PER_REQUEST = ("error", "drop_after", "recomputed_after")


class FaultError(ValueError):
    pass


class Faults:
    """The current fault and how many more requests it applies to."""

    def __init__(self) -> None:
        self.mode = "none"
        self.status = 500
        self.tokens = 0
        self.factor = 1.0
        self.count: int | None = None
        self.applied: dict[str, int] = {}

    def set(self, spec: dict[str, Any]) -> None:
        """Validate and install a fault spec (see the module doc); raises FaultError."""
        if not isinstance(spec, dict):
            raise FaultError("the fault spec must be a JSON object")
        mode = spec.get("mode", "none")
        if mode not in MODES:
            raise FaultError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        status = spec.get("status", 500)
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise FaultError(f"status must be an HTTP status (100..599); got {status!r}")
        tokens = spec.get("tokens", 0)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise FaultError(f"tokens must be an integer >= 0; got {tokens!r}")
        factor = spec.get("factor", 1.0)
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise FaultError(f"factor must be a number > 0; got {factor!r}")
        count = spec.get("count")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)
                                  or count < 0):
            raise FaultError(f"count must be an integer >= 0 or null; got {count!r}")
        self.mode, self.status, self.tokens = mode, status, tokens
        self.factor, self.count = float(factor), count

    def take(self) -> str | None:
        """For one arriving generation request: the per-request fault that hits it, if any."""
        mode = self.mode
        if mode == "crash":  # armed crash: the count-th request triggers it
            if self.count is None or self.count <= 1:
                return "crash"
            self.count -= 1
            return None
        if mode not in PER_REQUEST:
            return None
        if self.count is not None:
            if self.count <= 0:
                self.mode = "none"
                return None
            self.count -= 1
            if self.count == 0:
                self.mode = "none"
        self.applied[mode] = self.applied.get(mode, 0) + 1
        return mode

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "status": self.status, "tokens": self.tokens,
                "factor": self.factor, "count": self.count, "applied": dict(self.applied)}

"""Per-key rate limits: requests and tokens per minute, as token buckets.

Each key name (``anonymous`` when the gateway checks no key) has up to two buckets: requests
per minute (``rpm``) and tokens per minute (``tpm``). A bucket refills continuously at
``limit / 60`` per second up to ``limit / 60 * burst_s`` (at least one request, and at least
one token), so over any window of ``W`` seconds a key gets at most ``limit * W / 60`` plus one
burst: with the default 1 s burst, a 60 s window holds within 1/60 (1.7 %) of the limit.

A request is admitted when its key has a whole request left and a non-negative token level;
its token estimate (prompt estimate + ``max_tokens``) is taken at admission and may drive the
token level below zero (a prompt larger than a burst is admitted once the level is back at
zero, instead of never). At the end :meth:`RateLimiter.settle` replaces the estimate by the
engine's ``usage.total_tokens`` when it is known.

Refusals carry what OpenAI's API sends and its clients read (``Retry-After`` in seconds, the
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers; OpenAI "Rate limits" guide),
the durations in its ``1m30s`` / ``250ms`` form.

One :class:`RateLimiter` per process (``coordinator.workers`` = 1). With several workers
each limit holds for all of them together: the subclass
:class:`motor.coordinator.ratetable.SharedRateLimiter` (same interface) decides from a
table in shared memory where every worker counts what it admits; ``share``
(``1 / workers``) is then only the part of a limit a worker enforces on its own, for a name
that found no slot in that table.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Limit:
    """Per-minute limits of one key; ``None`` = unlimited."""
    rpm: float | None = None
    tpm: float | None = None


class Bucket:
    """A token bucket: ``rate`` per second, capacity ``cap``; starts full."""

    __slots__ = ("rate", "cap", "level", "t")

    def __init__(self, per_minute: float, burst_s: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.cap = max(1.0, self.rate * burst_s)
        self.level = self.cap
        self.t = now

    def refill(self, now: float) -> float:
        if now > self.t:
            self.level = min(self.cap, self.level + (now - self.t) * self.rate)
            self.t = now
        return self.level

    def wait_for(self, need: float) -> float:
        """Seconds until the level reaches ``need`` (0 if it has)."""
        return max(0.0, (need - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.cap - self.level) / self.rate)


def duration(s: float) -> str:
    """``0.25`` -> ``250ms``, ``1.5`` -> ``1.5s``, ``90`` -> ``1m30s`` (OpenAI's header form)."""
    if s < 1.0:
        return f"{max(0, math.ceil(s * 1000))}ms"
    if s < 60.0:
        return f"{s:.3g}s"
    m, rest = divmod(int(math.ceil(s)), 60)
    return f"{m}m{rest}s"


class _KeyState:
    __slots__ = ("req", "tok")

    def __init__(self, limit: Limit, burst_s: float, share: float, now: float) -> None:
        self.req = Bucket(limit.rpm * share, burst_s, now) if limit.rpm else None
        self.tok = Bucket(limit.tpm * share, burst_s, now) if limit.tpm else None


class RateLimiter:
    """Token buckets per key name.

    Parameters
    ----------
    limits : dict
        key name -> :class:`Limit`; names not listed get ``default``.
    default : Limit
        limits of every other key (and of ``anonymous``).
    burst_s : float
        bucket capacity, in seconds of refill.
    share : float
        fraction of every limit this process enforces (1; ``1 / workers`` where a worker of
        several limits a name on its own).
    """

    def __init__(self, limits: dict[str, Limit], default: Limit = Limit(),
                 burst_s: float = 1.0, share: float = 1.0,
                 clock: object = time.monotonic) -> None:
        self.limits = limits
        self.default = default
        self.burst_s = burst_s
        self.share = share
        self._clock = clock
        self._keys: dict[str, _KeyState | None] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.default.rpm or self.default.tpm or any(
            lim.rpm or lim.tpm for lim in self.limits.values()))

    def _state(self, name: str, now: float) -> _KeyState | None:
        try:
            return self._keys[name]
        except KeyError:
            lim = self.limits.get(name, self.default)
            st = _KeyState(lim, self.burst_s, self.share, now) if (lim.rpm or lim.tpm) else None
            self._keys[name] = st
            return st

    def admit(self, name: str, tokens: float) -> tuple[float, str, Headers] | None:
        """Take one request and ``tokens`` from ``name``'s buckets; ``None`` = admitted, else
        (seconds to wait, which limit refused: ``requests`` / ``tokens``, the headers of the
        429). Nothing is taken from a refused request."""
        now = self._clock()  # type: ignore[operator]
        st = self._state(name, now)
        if st is None:
            return None
        wait, kind = 0.0, "requests"
        if st.req is not None:
            st.req.refill(now)
            wait = st.req.wait_for(1.0)
        if st.tok is not None:
            st.tok.refill(now)
            tw = st.tok.wait_for(0.0)
            if tw > wait:
                wait, kind = tw, "tokens"
        if wait > 0.0:
            return wait, kind, self._headers(st)
        if st.req is not None:
            st.req.level -= 1.0
        if st.tok is not None:
            st.tok.level -= tokens
        return None

    def peek(self, name: str) -> tuple[float, str, Headers] | None:
        """What :meth:`admit` would say of a request of no tokens, taking nothing."""
        now = self._clock()  # type: ignore[operator]
        st = self._state(name, now)
        if st is None:
            return None
        for kind, b, need in (("requests", st.req, 1.0), ("tokens", st.tok, 0.0)):
            if b is not None:
                b.refill(now)
                wait = b.wait_for(need)
                if wait > 0.0:
                    return wait, kind, self._headers(st)
        return None

    def settle(self, name: str, estimate: float, actual: float | None) -> None:
        """Replace an admitted request's token ``estimate`` by the engine's count ``actual``
        (``None`` = unknown: the estimate stands)."""
        if actual is None:
            return
        st = self._keys.get(name)
        if st is not None and st.tok is not None:
            st.tok.level = min(st.tok.cap, st.tok.level + estimate - actual)

    def headers(self, name: str) -> Headers:
        """The ``x-ratelimit-*`` headers of ``name`` now (empty when it is unlimited)."""
        st = self._keys.get(name)
        return self._headers(st) if st is not None else ()

    def _headers(self, st: _KeyState) -> Headers:
        out: list[tuple[bytes, bytes]] = []
        for kind, b in (("requests", st.req), ("tokens", st.tok)):
            if b is None:
                continue
            out += [(f"x-ratelimit-limit-{kind}".encode(), b"%d" % round(b.rate * 60)),
                    (f"x-ratelimit-remaining-{kind}".encode(), b"%d" % max(0, int(b.level))),
                    (f"x-ratelimit-reset-{kind}".encode(), duration(b.reset_s()).encode())]
        return tuple(out)

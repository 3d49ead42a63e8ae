"""Admission control: a cap on requests in flight, a bounded queue, priority classes, and fair
sharing between keys inside a class.

A request enters at once while fewer than ``max_in_flight`` are in flight and nobody waits
(one comparison and one increment: the path every request takes when the gateway is not
overloaded). Otherwise it waits in its class's queue:

* classes are served in strict priority order (the first class of ``classes`` first);
* inside a class, each key name has its own FIFO and the keys take turns, a key with weight
  ``w`` getting ``w`` requests per turn (deficit round robin with unit cost, Shreedhar and
  Varghese 1995), so a key that floods the queue delays its own requests, not the others';
* the queue holds at most ``max_queue`` requests in all: one more is refused at once
  (``queue full``), unless a request of a lower class waits: then the newest waiter of the
  longest key queue of the lowest such class is refused (``displaced``) and the newcomer
  takes its place, so a full queue of ``batch`` requests never turns ``interactive`` ones
  away; a request that waited ``queue_timeout_s`` is refused (``queue timeout``).

Refusals are 503 with ``Retry-After`` (the caller writes the answer; this module only decides).
A waiter whose client went away (its task cancelled) leaves the queue and takes no slot.

Per-instance caps (:class:`SlotQueue`): an admitted request whose candidate endpoints are all
at their cap (``InstanceSpec.max_inflight``, ``admission.max_inflight_per_instance``) waits
here, in arrival order, until one has room or ``queue_timeout_s`` passed (``instance cap``).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
#: a waiting request at the head of a :class:`SlotQueue` looks for room this often even
#: without a release in this process (another worker's request ended, an endpoint came back)
SLOT_POLL_S = 0.05


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future[None]
    t: float
    queue: _ClassQueue
    key: str


@dataclass(eq=False)
class _KeyQueue:
    weight: int
    waiters: deque[_Waiter] = field(default_factory=deque)
    credit: int = 0


class _ClassQueue:
    __slots__ = ("keys", "order")

    def __init__(self) -> None:
        self.keys: dict[str, _KeyQueue] = {}
        self.order: deque[str] = deque()  # keys with waiters, in turn order


class Refused(Exception):
    """Not admitted: ``reason`` (``queue full`` / ``displaced`` / ``queue timeout``),
    ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Admission:
    """Requests in flight of one coordinator process.

    Parameters
    ----------
    max_in_flight : int
        requests in flight at most (> 0).
    max_queue : int
        requests waiting at most, all classes together (0 = refuse instead of waiting).
    queue_timeout_s : float
        longest wait in the queue, seconds.
    classes : list of str
        priority classes, highest first; an unknown class name is served as the last one.
    weights : dict
        key name -> weight (requests per turn, default 1).
    """

    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout_s: float,
                 classes: list[str], weights: dict[str, int] | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight is expected >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.classes = list(classes)
        self._rank = {c: i for i, c in enumerate(self.classes)}
        self._queues = [_ClassQueue() for _ in self.classes]
        self.weights = weights or {}
        self.in_flight = 0
        self.queued = 0
        #: counters for metrics: admitted at once, admitted after a wait, refused by reason
        self.admitted_now = 0
        self.admitted_waited = 0
        self.refused: dict[str, int] = {"queue full": 0, "displaced": 0, "queue timeout": 0}
        self.wait_s_total = 0.0
        self._wait_ewma_s = 0.0

    def class_of(self, name: str | None) -> int:
        if name is None:
            return len(self.classes) - 1
        return self._rank.get(name, len(self.classes) - 1)

    async def enter(self, key: str, cls: int) -> None:
        """Wait for a slot; returns once the request is in flight (call :meth:`leave` when it
        ends, exactly once).

        Raises
        ------
        Refused
            queue full, displaced from the queue by a request of a higher class, or waited
            ``queue_timeout_s``.
        asyncio.CancelledError
            the caller was cancelled while waiting (it holds no slot).
        """
        if self.in_flight < self.max_in_flight and not self.queued:
            self.in_flight += 1
            self.admitted_now += 1
            return
        if self.queued >= self.max_queue and not self._displace(cls):
            self.refused["queue full"] += 1
            raise Refused("queue full", self.retry_after_s())
        loop = asyncio.get_running_loop()
        q = self._queues[cls]
        w = _Waiter(loop.create_future(), time.monotonic(), q, key)
        kq = q.keys.get(key)
        if kq is None:
            kq = q.keys[key] = _KeyQueue(max(1, self.weights.get(key, 1)))
        if not kq.waiters:
            q.order.append(key)
        kq.waiters.append(w)
        self.queued += 1
        timer = loop.call_later(self.queue_timeout_s, self._expire, w)
        try:
            await w.fut
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self.leave()  # granted, then the caller went away: give the slot back
            else:
                self._remove(q, key, w)
            raise
        finally:
            timer.cancel()
        waited = time.monotonic() - w.t
        self.admitted_waited += 1
        self.wait_s_total += waited
        self._wait_ewma_s += 0.2 * (waited - self._wait_ewma_s)

    def leave(self) -> None:
        """A request in flight ended: its slot goes to the next waiter, if any."""
        self.in_flight -= 1
        while self.queued and self.in_flight < self.max_in_flight:
            w = self._next()
            if w is None:
                break
            self.in_flight += 1
            w.fut.set_result(None)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the recent queue wait, 1 s at least."""
        return max(1, math.ceil(self._wait_ewma_s))

    # -- queue internals ------------------------------------------------------------------
    def _next(self) -> _Waiter | None:
        for q in self._queues:
            while q.order:
                key = q.order[0]
                kq = q.keys[key]
                if not kq.waiters:       # emptied by timeouts / cancellations
                    q.order.popleft()
                    kq.credit = 0
                    continue
                if kq.credit <= 0:
                    kq.credit = kq.weight
                w = kq.waiters.popleft()
                self.queued -= 1
                kq.credit -= 1
                if not kq.waiters:
                    q.order.popleft()
                    kq.credit = 0
                    del q.keys[key]
                elif kq.credit <= 0:
                    q.order.rotate(-1)   # its turn is over
                return w
        return None

    def _remove(self, q: _ClassQueue, key: str, w: _Waiter) -> None:
        kq = q.keys.get(key)
        if kq is None:
            return
        try:
            kq.waiters.remove(w)
        except ValueError:
            return
        self.queued -= 1
        if not kq.waiters:
            try:
                q.order.remove(key)
            except ValueError:
                pass
            del q.keys[key]

    def _displace(self, cls: int) -> bool:
        """Refuse one waiter of a class below ``cls`` (the lowest class that has one: the
        newest waiter of its longest key queue); whether there was one."""
        for q in reversed(self._queues[cls + 1:]):
            live = [(len(kq.waiters), k) for k, kq in q.keys.items() if kq.waiters]
            if not live:
                continue
            key = max(live)[1]
            w = q.keys[key].waiters[-1]
            self._remove(q, key, w)
            self.refused["displaced"] += 1
            w.fut.set_exception(Refused("displaced", self.retry_after_s()))
            return True
        return False

    def _expire(self, w: _Waiter) -> None:
        if w.fut.done():
            return
        self._remove(w.queue, w.key, w)
        self.refused["queue timeout"] += 1
        w.fut.set_exception(Refused("queue timeout", self.retry_after_s()))


class _SlotWaiter:
    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future[None]) -> None:
        self.fut = fut


class SlotQueue:
    """Requests waiting for room on an endpoint below its cap, served in arrival order.

    ``await q.wait(room)`` returns ``room()``'s first answer that is not None: at once when
    nobody waits, else once the waiters before it were served. A waiter is woken, all in
    arrival order, by :meth:`pump` (an endpoint's request ended: a slot is free) and the
    head of the queue also every :data:`SLOT_POLL_S`; each woken one calls ``room()`` again
    and keeps its place when there is still none. The caller must take the slot it is
    given (``EndpointState.lease``) before it awaits anything.

    Parameters
    ----------
    timeout_s : float
        longest wait, seconds; then :class:`Refused` (``instance cap``).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._waiters: deque[_SlotWaiter] = deque()
        #: counters for metrics and tests: requests that waited, refused after timeout_s
        self.waited = 0
        self.refused = 0
        self._wait_ewma_s = 0.0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def pump(self) -> None:
        """A slot may be free: wake every waiter (they look for room in arrival order)."""
        for w in self._waiters:
            if not w.fut.done():
                w.fut.set_result(None)

    async def wait(self, room: Callable[[], T | None]) -> T:
        """``room()`` once it answers (not None) and every earlier waiter was served.

        Raises
        ------
        Refused
            ``instance cap``: no room within ``timeout_s``.
        asyncio.CancelledError
            the caller was cancelled (it leaves the queue; a wake-up it got goes on).
        """
        if not self._waiters:
            got = room()
            if got is not None:
                return got
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.timeout_s
        w = _SlotWaiter(loop.create_future())
        self._waiters.append(w)
        self.waited += 1
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    self.refused += 1
                    raise Refused("instance cap", self.retry_after_s())
                done, _ = await asyncio.wait((w.fut,), timeout=min(left, SLOT_POLL_S))
                if not done and self._waiters[0] is not w:
                    continue             # not the head: wait for a wake-up
                got = room()
                if got is not None:
                    waited = loop.time() - t0
                    self._wait_ewma_s += 0.2 * (waited - self._wait_ewma_s)
                    return got
                w.fut = loop.create_future()
        finally:
            self._waiters.remove(w)
            if self._waiters:   # the next ones may have room now (a wake-up passes on)
                self.pump()

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the recent wait for a slot, 1 s at least."""
        return max(1, math.ceil(self._wait_ewma_s))

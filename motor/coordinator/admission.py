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
  away; a request that waited its class's longest wait (``max_wait_s``, else
  ``queue_timeout_s``) is refused (``queue timeout``).

**Prediction** (``predict``, on by default in the config). The mean time a request spends in
flight here, ``S`` (an exponentially weighted mean over about :data:`MEAN_OF` requests, from
the time each one entered to its end: it does not fade while the gateway is idle), gives the
capacity ``C = max_in_flight / S`` requests/s; each class's arrivals, refused ones included,
are a rate ``lam`` exponentially weighted over :data:`RATE_TAU_S` (an event adds
``1 / tau``, the sum decays by ``exp(-dt / tau)``). For a request of class ``c``, ``lam_hi``
is the sum of the classes above it.

* **Slots held for higher classes**: the classes above ``c`` are expected to hold
  ``L = lam_hi * S`` slots; ``R = ceil(L + sqrt(L))`` of them (their mean plus about one
  standard deviation of a Poisson count) minus those they hold now stay free for them. A
  request of class ``c`` takes a free slot only when one is left beyond those, and a freed
  slot goes to a waiter of class ``c`` under the same rule. This keeps an interactive class
  that offers less than the capacity from waiting behind batch requests that came first;
  the price is up to ``R`` idle slots while it is quiet.
* **Refusal at arrival**: a request that would have to wait is refused at once
  (``predicted wait``) when its predicted wait ``W`` passes its class's longest wait,
  instead of being held until that wait has passed::

      C     = max_in_flight / S                          the capacity, requests/s
      avail = C                                          for the first class, else
      avail = min(C - min(lam_hi, C), (max_in_flight - R) / S)
      W     = (waiters of class c and above + 1) / avail  (infinite when avail < C / 20)

  ``Retry-After`` is ``W`` (1 s at least, ``queue_timeout_s`` at most). No prediction and
  no held slots before :data:`MIN_ENDS` requests ended.

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
#: time constant of the rates behind the wait prediction, seconds
RATE_TAU_S = 2.0
#: requests that must have ended before the wait is predicted (until then, nobody is refused
#: at arrival: a queue forms and waits are bounded by the class's longest wait)
MIN_ENDS = 8
#: the mean time in flight is an exponentially weighted mean over about this many requests
MEAN_OF = 64
#: a waiter kept off a free slot (held for a higher class) is looked at again this often, s
HELD_RECHECK_S = 0.05
#: a waiting request at the head of a :class:`SlotQueue` looks for room this often even
#: without a release in this process (another worker's request ended, an endpoint came back)
SLOT_POLL_S = 0.05


class _Rate:
    """Events per second, exponentially weighted over :data:`RATE_TAU_S`."""
    __slots__ = ("r", "t")

    def __init__(self) -> None:
        self.r = 0.0
        self.t = 0.0

    def value(self, now: float) -> float:
        return self.r * math.exp((self.t - now) / RATE_TAU_S) if self.r else 0.0

    def add(self, now: float) -> None:
        self.r = self.value(now) + 1.0 / RATE_TAU_S
        self.t = now


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future[None]
    t: float
    queue: _ClassQueue
    key: str
    cls: int


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
    """Not admitted: ``reason`` (``queue full`` / ``displaced`` / ``queue timeout`` /
    ``predicted wait``), ``retry_after_s`` (whole seconds, >= 1)."""

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
        longest wait in the queue, seconds (of the classes ``max_wait_s`` does not name).
    classes : list of str
        priority classes, highest first; an unknown class name is served as the last one.
    weights : dict
        key name -> weight (requests per turn, default 1).
    max_wait_s : dict
        class name -> its longest wait in the queue, seconds (> 0).
    predict : bool
        refuse at arrival what the queue is predicted not to serve in time, hold slots for
        higher classes (module doc).
    clock : callable
        seconds, monotonic (tests give their own).
    """

    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout_s: float,
                 classes: list[str], weights: dict[str, int] | None = None,
                 max_wait_s: dict[str, float] | None = None, predict: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight is expected >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.classes = list(classes)
        self._rank = {c: i for i, c in enumerate(self.classes)}
        self._queues = [_ClassQueue() for _ in self.classes]
        waits = max_wait_s or {}
        #: longest wait in the queue per class index, seconds
        self.budget_s = [float(waits.get(c, queue_timeout_s)) for c in self.classes]
        self.predict = predict
        self._clock = clock
        #: the clock the caller reads for :meth:`leave`'s ``started``
        self.clock = clock
        #: called with the queue length whenever it changes (the queue-length gauge)
        self.on_queued: Callable[[int], None] | None = None
        self.weights = weights or {}
        self.in_flight = 0
        self.queued = 0
        self._queued_by = [0] * len(self.classes)
        #: counters for metrics: admitted at once, admitted after a wait, refused by reason
        self.admitted_now = 0
        self.admitted_waited = 0
        self.refused: dict[str, int] = {"queue full": 0, "displaced": 0, "queue timeout": 0,
                                        "predicted wait": 0}
        self.wait_s_total = 0.0
        self._wait_ewma_s = 0.0
        self._ends_n = 0
        self._s_mean = 0.0      # mean time in flight, seconds (per-request EWMA)
        self._demand = [_Rate() for _ in self.classes]
        self._in_flight_by = [0] * len(self.classes)
        self._recheck: asyncio.TimerHandle | None = None

    def rank_of(self, name: str) -> int | None:
        """Index of the class ``name`` (0 = highest), None when it is not one."""
        return self._rank.get(name)

    def class_of(self, name: str | None) -> int:
        if name is None:
            return len(self.classes) - 1
        return self._rank.get(name, len(self.classes) - 1)

    async def enter(self, key: str, cls: int) -> float:
        """Wait for a slot; returns once the request is in flight, with the seconds it
        waited (0.0: at once). Call :meth:`leave` with the same ``cls`` and, with
        ``predict``, the time it entered (``clock()`` after this returns) when it ends,
        exactly once.

        Raises
        ------
        Refused
            queue full, displaced from the queue by a request of a higher class, waited its
            class's longest wait, or (``predict``) predicted to wait longer than that.
        asyncio.CancelledError
            the caller was cancelled while waiting (it holds no slot).
        """
        if not self.predict:
            if self.in_flight < self.max_in_flight and not self.queued:
                self._admit(cls)
                self.admitted_now += 1
                return 0.0
        else:
            now = self._clock()
            self._demand[cls].add(now)
            if self.in_flight < self.max_in_flight and not self._ahead(cls) and (
                    cls == 0 or self._room(cls, now)):
                self._admit(cls)
                self.admitted_now += 1
                return 0.0
            wait_s = self.predicted_wait_s(cls, now)
            if wait_s > self.budget_s[cls]:
                self.refused["predicted wait"] += 1
                raise Refused("predicted wait", self._retry_after(wait_s))
        if self.queued >= self.max_queue and not self._displace(cls):
            self.refused["queue full"] += 1
            raise Refused("queue full", self.retry_after_s(cls))
        loop = asyncio.get_running_loop()
        q = self._queues[cls]
        w = _Waiter(loop.create_future(), self._clock(), q, key, cls)
        kq = q.keys.get(key)
        if kq is None:
            kq = q.keys[key] = _KeyQueue(max(1, self.weights.get(key, 1)))
        if not kq.waiters:
            q.order.append(key)
        kq.waiters.append(w)
        self.queued += 1
        self._queued_by[cls] += 1
        if self.on_queued is not None:
            self.on_queued(self.queued)
        timer = loop.call_later(self.budget_s[cls], self._expire, w)
        try:
            await w.fut
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self.leave(cls)  # granted, then the caller went away: give the slot back
            else:
                self._remove(q, key, w)
            raise
        finally:
            timer.cancel()
        waited = self._clock() - w.t
        self.admitted_waited += 1
        self.wait_s_total += waited
        self._wait_ewma_s += 0.2 * (waited - self._wait_ewma_s)
        return waited

    def leave(self, cls: int | None = None, started: float | None = None) -> None:
        """A request in flight (of class ``cls``, as it entered; needed with ``predict``,
        as is ``started``, the ``clock()`` time it entered) ended: its slot goes to the next
        waiter that may take it, if any."""
        if not self.predict:
            self.in_flight -= 1
            if cls is not None:
                self._in_flight_by[cls] -= 1
            while self.queued and self.in_flight < self.max_in_flight:
                w = self._next(len(self._queues))
                if w is None:
                    break
                self._admit(w.cls)
                w.fut.set_result(None)
            return
        now = self._clock()
        self.in_flight -= 1
        if cls is not None:
            self._in_flight_by[cls] -= 1
        if started is not None:
            dur = max(0.0, now - started)
            self._ends_n += 1
            # the first requests set the mean, then each moves it by 1/MEAN_OF
            self._s_mean += (dur - self._s_mean) / min(self._ends_n, MEAN_OF)
        self._grant(now)

    def _grant(self, now: float) -> None:
        """Free slots to waiters: the first class with waiters, a lower one only beyond the
        slots held for the classes above it. A waiter held back that way is looked at again
        every :data:`HELD_RECHECK_S` (the higher classes' demand fades without any request
        ending here)."""
        self._recheck = None
        while self.queued and self.in_flight < self.max_in_flight:
            top = next(c for c, n in enumerate(self._queued_by) if n)
            if top and not self._room(top, now):
                if self._recheck is None:
                    self._recheck = asyncio.get_running_loop().call_later(
                        HELD_RECHECK_S, lambda: self._grant(self._clock()))
                return
            w = self._next(len(self._queues))
            if w is None:
                return
            self._admit(w.cls)
            w.fut.set_result(None)

    def _admit(self, cls: int) -> None:
        self.in_flight += 1
        self._in_flight_by[cls] += 1

    # -- prediction (module doc) ---------------------------------------------------------
    def _service(self, now: float) -> tuple[float, float] | None:
        """(capacity requests/s, S seconds): S = the mean time in flight of the requests
        that ended here, the capacity ``max_in_flight / S``; None before MIN_ENDS ended."""
        s_mean = self._s_mean
        if self._ends_n < MIN_ENDS or s_mean <= 0.0:
            return None
        return self.max_in_flight / s_mean, s_mean

    def _held(self, cls: int, s_mean: float, now: float) -> tuple[float, int]:
        """(lam_hi requests/s, R slots) of the classes above ``cls``."""
        lam = 0.0
        for c in range(cls):
            lam += self._demand[c].value(now)
        load = lam * s_mean
        r = math.ceil(load + math.sqrt(load)) if load > 0.0 else 0
        return lam, min(r, self.max_in_flight)

    def _room(self, cls: int, now: float) -> bool:
        """Whether a request of class ``cls`` > 0 may take a free slot: one is left beyond
        those held for the classes above it."""
        svc = self._service(now)
        if svc is None:
            return True
        _, r = self._held(cls, svc[1], now)
        hi = 0
        for c in range(cls):
            hi += self._in_flight_by[c]
        return self.in_flight + 1 + max(0, r - hi) <= self.max_in_flight

    def predicted_wait_s(self, cls: int, now: float | None = None) -> float:
        """Predicted wait of a request of class ``cls`` arriving now, seconds (module doc);
        0.0 before MIN_ENDS requests ended (no prediction), ``inf`` when the classes above
        take (nearly) everything."""
        if now is None:
            now = self._clock()
        svc = self._service(now)
        if svc is None:
            return 0.0
        cap, s_mean = svc
        avail = cap
        if cls:
            lam, r = self._held(cls, s_mean, now)
            avail = min(cap - min(lam, cap), (self.max_in_flight - r) / s_mean)
            if avail < cap / 20:
                return math.inf
        return (self._ahead(cls) + 1) / avail

    def _ahead(self, cls: int) -> int:
        """Waiters of class ``cls`` and the classes above it."""
        n = 0
        for c in range(cls + 1):
            n += self._queued_by[c]
        return n

    def _retry_after(self, wait_s: float) -> int:
        return max(1, math.ceil(min(wait_s, self.queue_timeout_s)))

    def retry_after_s(self, cls: int | None = None) -> int:
        """Seconds a refused client should wait: its class's predicted wait when known
        (``predict``), else the recent queue wait; 1 s at least, ``queue_timeout_s`` at most."""
        if self.predict and cls is not None:
            wait_s = self.predicted_wait_s(cls)
            if wait_s > 0.0:
                return self._retry_after(wait_s)
        return self._retry_after(self._wait_ewma_s)

    # -- queue internals ------------------------------------------------------------------
    def _next(self, n_classes: int) -> _Waiter | None:
        """The next waiter of the first ``n_classes`` classes (deficit round robin inside a
        class), taken off the queue; None when they have none."""
        for q in self._queues[:n_classes]:
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
                self._queued_by[w.cls] -= 1
                if self.on_queued is not None:
                    self.on_queued(self.queued)
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
        self._queued_by[w.cls] -= 1
        if self.on_queued is not None:
            self.on_queued(self.queued)
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
            w.fut.set_exception(Refused("displaced", self.retry_after_s(w.cls)))
            return True
        return False

    def _expire(self, w: _Waiter) -> None:
        if w.fut.done():
            return
        self._remove(w.queue, w.key, w)
        self.refused["queue timeout"] += 1
        w.fut.set_exception(Refused("queue timeout", self.retry_after_s(w.cls)))


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

"""motor._fast.lease: the compiled lease has the effects of its pure-Python reference
(``motor.coordinator.endpoints.Lease``, which counts through ``EndpointState.acquire`` /
``release``) on an endpoint's counters, shared cell, gauge, breaker and ``on_free``, step by
step, on ``EndpointState`` (its attributes read at their slot offsets) and on objects whose
attributes are not slots (read with ``getattr``)."""
from __future__ import annotations

import random
import tracemalloc
from typing import Any

import pytest

from motor._fast.lease import Lease as Compiled
from motor.config.schema import Role
from motor.coordinator.breaker import CLOSED, HALF_OPEN, OPEN
from motor.coordinator.endpoints import LEASE, EndpointState
from motor.coordinator.endpoints import Lease as Reference


class _Log:
    """A shared cell, gauge and on_free in one: every call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def acquire(self, *a: int) -> None:
        self.calls.append(("acquire", *a))

    def release(self, *a: int) -> None:
        self.calls.append(("release", *a))

    def prefill_done(self, n: int) -> None:
        self.calls.append(("prefill_done", n))

    def inc(self) -> None:
        self.calls.append(("inc",))

    def dec(self) -> None:
        self.calls.append(("dec",))

    def __call__(self) -> None:
        self.calls.append(("on_free",))


def _ep(name: str) -> EndpointState:
    return EndpointState(name, "m", Role.UNION, "127.0.0.1", 1, 0, pool=None)  # type: ignore[arg-type]


def _state(ep: Any) -> tuple[Any, ...]:
    b = ep.breaker
    return (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
            ep.inflight_decode_tokens, b.state, b.probe_inflight)


def test_the_endpoints_lease_is_the_compiled_one() -> None:
    assert LEASE is Compiled
    assert type(_ep("a").lease(1, 1, 1)) is Compiled


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_have_the_references_effects(seed: int) -> None:
    rng = random.Random(seed)
    eps = {Reference: _ep("r"), Compiled: _ep("c")}
    logs = {k: _Log() for k in eps}
    leases: dict[type, list[Any]] = {k: [] for k in eps}
    watched: dict[type, list[float]] = {k: [] for k in eps}
    for step in range(400):
        op = rng.choice(["lease", "lease", "release", "release", "prefill", "answer",
                         "hooks", "breaker"])
        n = rng.randrange(len(leases[Reference])) if leases[Reference] else -1
        toks = (rng.randrange(10**6), rng.choice([0, rng.randrange(2**40)]), rng.randrange(99))
        hooks = (rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5)
        brk = rng.choice([CLOSED, OPEN, HALF_OPEN])
        for cls, ep in eps.items():
            log = logs[cls]
            if op == "lease":
                lease = cls(ep, *toks)
                lease.watch(watched[cls].append if step % 2 else None)
                leases[cls].append(lease)
            elif op == "release" and n >= 0:
                leases[cls][n].release()
            elif op == "prefill" and n >= 0:
                leases[cls][n].prefill_done()
            elif op == "answer" and n >= 0:
                leases[cls][n].answered()
            elif op == "hooks":
                ep.shared = log if hooks[0] else None     # type: ignore[assignment]
                ep._gauge = log if hooks[1] else None     # type: ignore[assignment]
                ep.on_free = log if hooks[2] else None
            elif op == "breaker":
                ep.breaker.state = brk
                ep.breaker.open_until = 0.0
        assert _state(eps[Reference]) == _state(eps[Compiled]), (step, op)
        assert logs[Reference].calls == logs[Compiled].calls, (step, op)
        assert [x.held for x in leases[Reference]] == [x.held for x in leases[Compiled]]
        assert [(x.tokens, x.prefill_tokens, x.decode_tokens, x.watcher is None)
                for x in leases[Reference]] == \
            [(x.tokens, x.prefill_tokens, x.decode_tokens, x.watcher is None)
             for x in leases[Compiled]]
        assert len(watched[Reference]) == len(watched[Compiled])
    for cls in eps:
        for x in leases[cls]:
            x.release()
    assert _state(eps[Reference])[:4] == _state(eps[Compiled])[:4] == (0, 0, 0, 0)


class _Plain:
    """An endpoint-like object without slots, a property for one counter: the compiled
    lease reads and writes it with getattr / setattr."""

    def __init__(self) -> None:
        self.inflight = 0
        self.inflight_tokens = 0
        self._prefill = 0
        self.inflight_decode_tokens = 0.5       # a float: added to as the reference does
        self.shared = None
        self._gauge = _Log()
        self.breaker = _ep("x").breaker
        self.on_free = None

    @property
    def inflight_prefill_tokens(self) -> int:
        return self._prefill

    @inflight_prefill_tokens.setter
    def inflight_prefill_tokens(self, v: int) -> None:
        self._prefill = v

    def acquire(self, tokens: int, prefill: int, decode: int) -> None:
        EndpointState.acquire(self, tokens, prefill, decode)      # type: ignore[arg-type]

    def release(self, tokens: int, prefill: int, decode: int) -> None:
        EndpointState.release(self, tokens, prefill, decode)      # type: ignore[arg-type]


def test_an_object_without_slots_is_counted_alike() -> None:
    a, b = _Plain(), _Plain()
    la, lb = Reference(a, 5, 3, 2), Compiled(b, 5, 3, 2)     # type: ignore[arg-type]
    assert vars(a).keys() == vars(b).keys()
    assert (a.inflight, a.inflight_tokens, a._prefill, a.inflight_decode_tokens) == \
        (b.inflight, b.inflight_tokens, b._prefill, b.inflight_decode_tokens) == (1, 5, 3, 2.5)
    la.release()
    lb.release()
    assert (b.inflight, b.inflight_tokens, b._prefill, b.inflight_decode_tokens) == (0, 0, 0, 0.5)
    assert a._gauge.calls == b._gauge.calls == [("inc",), ("dec",)]


def test_a_changed_endpoint_type_is_learned_again() -> None:
    class Sub(EndpointState):
        __slots__ = ()

    ep = Sub("s", "m", Role.UNION, "127.0.0.1", 1, 0, pool=None)  # type: ignore[arg-type]
    Compiled(ep, 1, 1, 1).release()
    Sub.inflight = property(lambda self: 7, lambda self, v: None)  # type: ignore[assignment]
    lease = Compiled(ep, 1, 1, 1)                       # through the property now
    assert ep.inflight == 7 and ep.inflight_tokens == 1
    lease.release()
    del Sub.inflight
    Compiled(_ep("t"), 1, 1, 1).release()


def test_an_object_that_is_not_an_endpoint_is_refused() -> None:
    with pytest.raises(AttributeError):
        Compiled(object(), 1, 1, 1)
    with pytest.raises(TypeError):
        Compiled(None, 1, 1, 1)                          # type: ignore[arg-type]


def test_many_leases_leave_no_memory_behind() -> None:
    ep = _ep("m")
    big = 2**50
    for _ in range(1000):
        Compiled(ep, big, big, big).release()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(50000):
            lease = Compiled(ep, big, big + 1, big + 2)
            lease.prefill_done()
            lease.release()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 64 * 1024, grown
    assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
            ep.inflight_decode_tokens) == (0, 0, 0, 0)

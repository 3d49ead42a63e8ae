"""tests.support.procs.free_ports: two calls in one process never share a port (a CI run's
cluster config got its controller port again as an engine's base port, and was refused)."""
from __future__ import annotations

import itertools

from tests.support import procs


def test_a_later_call_never_returns_a_port_an_earlier_one_did(monkeypatch):
    first = procs.free_ports(3, consecutive=True)
    # the next draws: a base inside the first call's ports (free again: nothing bound them),
    # then bases further on
    draws = itertools.chain([first[1]], range(first[0] + 10, first[0] + 2000))
    monkeypatch.setattr(procs.random, "randint", lambda lo, hi: next(draws))
    second = procs.free_ports(3, consecutive=True)
    assert not set(first) & set(second)
    assert second[0] >= first[0] + 10

"""The controller's check loop steps down on its lease, not on whether it serves.

A leader whose term ends (etcd says the lease expired) campaigns again at once; re-elected
between two turns of ``ControllerServer._check_loop``, its new term does not serve until
its registry is restored (``Leadership.serves``). That gap must not read as "the lease is
no longer valid by this clock" and depose the new term (helper-14's review of 09a9991).
The election itself is replaced by a stand-in with ``Leadership``'s attributes (the real
one against etcd: tests/integration/test_controller_ha.py).
"""
from __future__ import annotations

import asyncio

from motor.config.schema import ControllerConfig
from motor.controller.server import ControllerServer


class Term:
    """``Leadership``'s state as the check loop reads it: ``token`` (the term), the lease's
    validity, ``took_over``; ``step_down`` records why."""

    def __init__(self) -> None:
        self.token: int | None = 1
        self.took_over = True
        self.lease_valid = True
        self.downs: list[tuple[int, str]] = []

    @property
    def is_leader(self) -> bool:
        return self.token is not None and self.lease_valid

    @property
    def serves(self) -> bool:
        return self.took_over and self.is_leader

    def step_down(self, reason: str) -> None:
        if self.token is None:
            return
        self.downs.append((self.token, reason))
        self.token = None
        self.took_over = False


def _server(term: Term) -> ControllerServer:
    s = ControllerServer(ControllerConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0))
    s.ha = term  # type: ignore[assignment]

    async def persisted() -> None:
        return None
    s._persist = persisted  # type: ignore[method-assign]
    return s


def test_a_term_re_elected_between_two_turns_is_not_deposed_during_its_takeover():
    async def main() -> None:
        term = Term()
        s = _server(term)
        loop = asyncio.create_task(s._check_loop())      # a turn every 0.1 s
        try:
            await asyncio.sleep(0.25)
            # between two turns: the lease expired (etcd says so), the key is gone, the
            # controller campaigned again and won: term 2, its registry being restored
            term.step_down("etcd says the lease expired")
            term.token, term.took_over = 2, False
            await asyncio.sleep(0.25)                     # turns land during the takeover
            term.took_over = True                         # on_elected returned
            await asyncio.sleep(0.15)
        finally:
            loop.cancel()
        assert term.downs == [(1, "etcd says the lease expired")]
        assert term.token == 2 and s.leading
    asyncio.run(main())


def test_a_lease_that_runs_out_by_this_clock_still_steps_down():
    async def main() -> None:
        term = Term()
        s = _server(term)
        loop = asyncio.create_task(s._check_loop())
        try:
            await asyncio.sleep(0.25)
            term.lease_valid = False                      # not renewed in time
            await asyncio.sleep(0.25)
        finally:
            loop.cancel()
        assert term.downs == [(1, "lease no longer valid by this controller's clock")]
        assert not s.leading
    asyncio.run(main())

"""``Leadership.stop`` ends the election loop even when its cancellation is lost.

On Python 3.11 ``asyncio.wait_for`` returns (or raises) its inner call's outcome when the
outer cancellation lands in the loop turn where that call ended; an etcd call that failed
just then turns the cancellation into ``EtcdUnavailable``, which the loop retries. A CI run
hung 120 s so in ``test_tls_to_etcd`` (the controller without a client certificate fails a
call every ~0.2 s). No etcd is needed here: the election step is replaced by one that loses
its cancellation that way, deterministically.
"""
from __future__ import annotations

import asyncio
import logging

import pytest

from motor.config.schema import EtcdConfig
from motor.controller import ha
from motor.controller.etcd_store import EtcdUnavailable
from motor.controller.ha import Leadership


async def _elected() -> None:
    raise AssertionError("not elected in these tests")


def _leadership() -> Leadership:
    # a closed port: nothing connects (the replaced step never calls etcd)
    return Leadership(EtcdConfig(endpoints=["127.0.0.1:9"]), "http://127.0.0.1:1", _elected,
                      lambda reason: None)


def test_stop_ends_a_loop_whose_cancellation_became_etcd_unavailable(monkeypatch):
    steps = 0
    lost = 0

    async def step(self: Leadership) -> None:
        nonlocal steps, lost
        steps += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if lost:
                raise
            lost += 1    # what wait_for does when the call failed in the same loop turn
            raise EtcdUnavailable("no etcd member answered (the call failed as it was "
                                  "cancelled)") from None

    monkeypatch.setattr(Leadership, "_follow_or_campaign", step)

    async def main() -> None:
        le = _leadership()
        le.start()
        await asyncio.sleep(0.05)
        task = le._task
        assert task is not None and steps == 1
        stopping = asyncio.ensure_future(le.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5.0)
        assert done, "stop() did not return: the election loop kept retrying"
        assert lost == 1 and task.done()
        assert steps == 1     # no election round after stop()
    asyncio.run(main())


def test_stop_does_not_wait_forever_for_a_task_that_ignores_cancellation(monkeypatch, caplog):
    release = asyncio.Event()

    async def step(self: Leadership) -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue    # a call that cannot be cancelled
        await asyncio.sleep(0.01)     # released: a step that takes a little time, as etcd's

    monkeypatch.setattr(Leadership, "_follow_or_campaign", step)
    monkeypatch.setattr(ha, "STOP_WAIT_S", 0.3, raising=False)

    async def main() -> None:
        le = _leadership()
        le.start()
        await asyncio.sleep(0.05)
        task = le._task
        assert task is not None
        try:
            with caplog.at_level(logging.WARNING, logger="motor.controller.ha"):
                stopping = asyncio.ensure_future(le.stop())
                done, _ = await asyncio.wait({stopping}, timeout=5.0)
            assert done, "stop() waited for a task that ignores its cancellation"
            assert not task.done()
            assert "did not end within 0.3 s of its cancellation" in caplog.text
        finally:
            release.set()      # the call ends: the loop sees _stopping and returns
        await asyncio.wait_for(task, 5.0)
        # the session is closed: a task left behind cannot open a client again
        with pytest.raises(EtcdUnavailable, match="the etcd session is closed"):
            await le.session.call("get", b"k")
    asyncio.run(main())


@pytest.mark.parametrize("exc", [EtcdUnavailable("down"), RuntimeError("a bug")])
def test_the_loop_retries_until_stopped(monkeypatch, exc):
    """Before stop() the loop does retry what failed (etcd unreachable, or a bug)."""
    steps = 0

    async def step(self: Leadership) -> None:
        nonlocal steps
        steps += 1
        raise exc

    monkeypatch.setattr(Leadership, "_follow_or_campaign", step)

    async def main() -> None:
        le = _leadership()
        le.start()
        await asyncio.sleep(1.2)
        await asyncio.wait_for(le.stop(), 5.0)
        seen = steps
        assert seen >= 2
        await asyncio.sleep(0.3)
        assert steps == seen
    asyncio.run(main())

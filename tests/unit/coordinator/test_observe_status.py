"""The status an observed request ends with (access log, trace) when its handler did not
answer: a cancellation is the client's leaving (499), an exception motor's own (500, what
the server then answers)."""
from __future__ import annotations

import asyncio

from motor.coordinator.observe import Obs


class Resp:
    def __init__(self, started: bool, finished: bool, status: int = 0) -> None:
        self.started = started
        self.finished = finished
        self.status = status


def ended(resp: Resp, error: BaseException | None) -> int | None:
    obs = Obs(None, "completions")
    obs.finish(resp, error)     # type: ignore[arg-type]
    return obs.status


def test_a_handler_exception_is_a_500_and_a_cancellation_a_499() -> None:
    assert ended(Resp(False, False), OverflowError("x")) == 500
    assert ended(Resp(True, False, 200), RuntimeError("x")) == 500     # cut after the head
    assert ended(Resp(False, False), asyncio.CancelledError()) == 499
    assert ended(Resp(True, False, 200), asyncio.CancelledError()) == 499
    assert ended(Resp(True, True, 404), None) == 404
    assert ended(Resp(False, False), None) == 499          # returned without answering
    assert ended(Resp(True, True, 200), RuntimeError("after the end")) == 200

"""Shared helpers of the node-manager tests (ports, pids, bounded waits)."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from tests.support import procs

FAKE_ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_engine.py")
FAKE_LAUNCHER = [sys.executable, FAKE_ENGINE]


def free_ports(n: int = 1) -> int:
    """First of ``n`` consecutive free loopback ports (outside the ephemeral range)."""
    return procs.free_ports(n, consecutive=True)[0]


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or pred}")


async def await_until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or pred}")


def read_pid(path: str, timeout_s: float = 10.0) -> int:
    wait_until(lambda: os.path.exists(path) and open(path).read().strip() != "", timeout_s, path)
    return int(open(path).read())


def run_uvloop(coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
    """Run on uvloop, as the node manager does in production; a test body that does not finish
    within ``timeout_s`` fails (TimeoutError) instead of hanging the suite."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout_s)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(bounded())


async def aread_pid(path: str, timeout_s: float = 10.0) -> int:
    """:func:`read_pid` for async tests: polls without blocking the event loop (the supervisor
    under test runs on the same loop)."""
    await await_until(lambda: os.path.exists(path) and open(path).read().strip() != "",
                      timeout_s, path)
    return int(open(path).read())

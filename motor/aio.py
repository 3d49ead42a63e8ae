"""Small asyncio helpers shared by motor's processes."""
from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, step_s: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until every one is done.

    A task is cancelled again while it still runs: Python 3.11's ``asyncio.wait_for`` loses a
    cancellation that races with the completion of its inner awaitable (fixed in 3.12), so a
    loop built on it (heartbeats, long polls) can survive one ``cancel()``. Waiting with
    ``asyncio.wait`` also keeps a cancellation of the caller from being swallowed here.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        done, pending = await asyncio.wait(pending, timeout=step_s)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved: an error at shutdown is not worth a warning

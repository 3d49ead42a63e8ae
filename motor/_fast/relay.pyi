"""Type stubs for motor._fast.relay (the compiled SSE relay of one stream leg)."""
from collections.abc import Callable
from typing import Any

from motor._fast.upstream import UpstreamResponse

def bind(upstream_timeout: type[BaseException], upstream_closed: type[BaseException],
         silence: Callable[[float], Any], past_prefill: Callable[[bytes], bool],
         keepalive: bytes, max_event_bytes: int, ready: object = None) -> None: ...
def bound() -> bool: ...
async def relay_sse(up: UpstreamResponse, resp: Any, rec: Any, route: Any, t0: float,
                    first: bool, idle_timeout_s: float,
                    on_first: Callable[[], object] | None = None,
                    on_prefill_done: Callable[[], object] | None = None,
                    timing: Any = None) -> tuple[BaseException | None, bool]: ...
def last_blank_line(b: bytes) -> int: ...
def count(b: bytes, needle: bytes) -> int: ...

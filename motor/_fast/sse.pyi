"""Type stubs for motor._fast.sse (the first leg of a recoverable SSE stream, on the bytes)."""
from typing import Final

DEBUG: Final[bool]

class EventScanner:
    chat: Final[bool]
    client_ids: Final[bool]
    role_sent: bool
    ids_missing: bool
    blocked: bool
    finished: bool
    have_id: bool
    have_prompt: bool
    usage_sent: bool
    done: bool
    def __init__(self, chat: bool, client_ids: bool, shapes: bool = True) -> None: ...
    def feed(self, block: bytes, gen: list[int]) -> bytes | None:
        """The client's bytes for whole SSE events; None: not understood, nothing recorded."""
    def sync(self, *, role_sent: bool, ids_missing: bool, blocked: bool, finished: bool,
             have_id: bool, have_prompt: bool, usage_sent: bool, done: bool) -> None: ...
    @property
    def resp_id(self) -> object: ...
    @property
    def created(self) -> object: ...
    @property
    def model(self) -> object: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def prompt_ids(self) -> list[int] | None: ...
    @property
    def news(self) -> bool: ...
    @property
    def captured(self) -> bool: ...
    @property
    def events(self) -> int: ...
    @property
    def fallbacks(self) -> int: ...
    @property
    def shaped(self) -> int: ...

"""Type stubs for motor._fast.reqscan (what the request path reads of a body, unparsed)."""

STREAM_KEYS: frozenset[str]

def scan_request(raw: bytes | None, chat: bool
                 ) -> tuple[str | None, bool, int, bool, int | None] | None: ...

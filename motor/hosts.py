"""What counts as a host in motor's config and command line (no dependencies: the CLI's
argument types and the config schema both use it)."""
from __future__ import annotations

import ipaddress
import re

#: one DNS label (RFC 1123): letters, digits, inner hyphens, 1..63 characters
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_host(text: str) -> bool:
    """An IPv4 / IPv6 address (without brackets; ``0.0.0.0`` and ``::`` = every interface)
    or a DNS host name of RFC 1123 labels (a trailing dot allowed), at most 253 characters;
    an all-numeric name (``300.1.1.1``) is a mistyped IPv4 address, not a name."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(x) for x in labels) \
        and not all(x.isdigit() for x in labels)

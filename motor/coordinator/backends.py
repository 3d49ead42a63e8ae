"""Standalone mode's ``--backend`` specs (``motor coordinator --backend [ROLE=]URL``),
read by the worker processes (:func:`motor.coordinator.app.serve`) and by the supervisor
of a multi-worker coordinator (:func:`motor.coordinator.supervisor.static_keys`)."""
from __future__ import annotations

from urllib.parse import urlsplit

from motor.config.schema import Role
from motor.errors import ConfigError


def parse_backend(spec: str) -> tuple[Role, str, int]:
    """``URL`` (union) or ``ROLE=URL`` -> (role, host, port); port 80 when the URL has none.

    Raises
    ------
    ConfigError
        for an unknown role or a URL that is not ``http://HOST:PORT``.
    """
    role = Role.UNION
    url = spec
    if "=" in spec and not spec.startswith("http"):
        r, url = spec.split("=", 1)
        try:
            role = Role(r)
        except ValueError:
            raise ConfigError(f"--backend role is expected to be one of "
                              f"{[x.value for x in Role]}, got {r!r} (in {spec!r})") from None
    u = urlsplit(url)
    try:
        port = u.port or 80
    except ValueError:
        port = -1
    if u.scheme != "http" or not u.hostname or u.path not in ("", "/") or port < 0:
        raise ConfigError(f"--backend is expected as [ROLE=]http://HOST:PORT, got {spec!r}")
    return role, u.hostname, port


__all__ = ["parse_backend"]

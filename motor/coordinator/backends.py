"""Standalone mode's ``--backend`` specs (``motor coordinator --backend [ROLE=]URL``),
read by the worker processes (:func:`motor.coordinator.app.serve`) and by the supervisor
of a multi-worker coordinator (:func:`motor.coordinator.supervisor.static_keys`)."""
from __future__ import annotations

from urllib.parse import urlsplit

from motor.config.schema import Role
from motor.errors import ConfigError


def parse_backend(spec: str) -> tuple[Role, str, int]:
    """``URL`` (union) or ``ROLE=URL`` -> (role, host, port); port 80 (``https``: 443) when
    the URL has none. Whether it is HTTPS: :func:`is_https`.

    Raises
    ------
    ConfigError
        for an unknown role or a URL that is not ``http(s)://HOST:PORT``.
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
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        port = -1
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") \
            or port < 0:
        raise ConfigError(f"--backend is expected as [ROLE=]http(s)://HOST:PORT, got {spec!r}")
    return role, u.hostname, port


def is_https(spec: str) -> bool:
    """Whether a ``--backend`` spec (checked by :func:`parse_backend`) is an HTTPS URL."""
    return spec.partition("=")[2].startswith("https://") if not spec.startswith("http") \
        else spec.startswith("https://")


__all__ = ["is_https", "parse_backend"]

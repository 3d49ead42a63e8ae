"""mTLS on the control plane (``controller.tls``, docs/security.md).

One CA (``ca_file``) signs every control-plane certificate; every component presents the
same ``cert_file`` / ``key_file``:

* the controller and a node manager's management API listen with :func:`server_context`:
  TLS >= 1.2, their certificate, and a client certificate signed by ``ca_file`` required at
  the handshake;
* node managers, coordinators (the one-process watcher and the multi-worker feed) and
  ``motor up`` connect with :func:`client_context`: the server's certificate checked against
  ``ca_file`` and the host name of the URL, the component's certificate presented.

:func:`controller_endpoint` reads a controller URL (``http://`` or ``https://``) and refuses a
scheme that does not match ``controller.tls``. Errors are :class:`motor.errors.ConfigError`
naming the field and the file (exit status 2 in the commands).
"""
from __future__ import annotations

import ssl
from urllib.parse import urlsplit

from motor.config.schema import ControlPlaneTlsConfig
from motor.errors import ConfigError
from motor.http import tls as _tls

FIELD = "controller.tls"


def server_context(t: ControlPlaneTlsConfig) -> ssl.SSLContext:
    """The listening side: ``cert_file`` presented, a client certificate signed by
    ``ca_file`` required.

    Raises
    ------
    ConfigError
        ``controller.tls.<field>: ...`` naming the file that is missing or does not load.
    """
    ctx = _tls.server_context(t.cert_file, t.key_file, t.key_password_file, None, FIELD)
    _tls.load_ca(ctx, t.ca_file, f"{FIELD}.ca_file")
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(t: ControlPlaneTlsConfig) -> ssl.SSLContext:
    """The connecting side: the server's certificate checked against ``ca_file`` (and the
    host name), ``cert_file`` presented.

    Raises
    ------
    ConfigError
        as :func:`server_context`.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # verification and host name check on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _tls.load_ca(ctx, t.ca_file, f"{FIELD}.ca_file")
    _tls.load_chain(ctx, t.cert_file, t.key_file, t.key_password_file, FIELD)
    return ctx


def check(t: ControlPlaneTlsConfig | None) -> None:
    """Load every file of ``controller.tls`` once (both sides), so a bad one is an error
    before anything starts.

    Raises
    ------
    ConfigError
        as :func:`server_context`.
    """
    if t is not None:
        server_context(t)
        client_context(t)


def controller_endpoint(url: str, t: ControlPlaneTlsConfig | None,
                        field: str = "--controller") -> tuple[str, int, bool]:
    """``http(s)://HOST[:PORT]`` -> (host, port, https); the port defaults to 80 / 443.

    Raises
    ------
    ConfigError
        another scheme, no host, a port that is not a number, ``https`` without
        ``controller.tls`` (nothing to present to the controller) or ``http`` with it (the
        controller speaks TLS only).
    """
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        u, port = None, None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"{field}: expected a controller URL http://HOST:PORT or "
                          f"https://HOST:PORT, got {url!r}")
    https = u.scheme == "https"
    if https and t is None:
        raise ConfigError(f"{field}: an https:// controller URL needs controller.tls (the CA and "
                          f"the certificate to present), got {url!r} with controller.tls null")
    if not https and t is not None:
        raise ConfigError(f"{field}: expected an https:// controller URL with controller.tls "
                          f"set (the controller accepts TLS only), got {url!r}")
    return u.hostname, port or (443 if https else 80), https


__all__ = ["FIELD", "check", "client_context", "controller_endpoint", "server_context"]

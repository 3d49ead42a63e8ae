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


#: seconds between two looks at the control-plane certificate files
RELOAD_INTERVAL_S = 5.0


class ControlPlaneTls:
    """The ``controller.tls`` contexts of one component, kept current with their files.

    ``server`` (the controller's port, a node manager's management API) and ``client`` (every
    control-plane connection it makes) are made once; :meth:`check` re-loads the certificate,
    key and CA into the same contexts when a file changed (the component calls it every
    :data:`RELOAD_INTERVAL_S`, and with ``force=True`` on SIGHUP). New handshakes use the new
    certificate; open connections are not dropped; a pair that does not load is logged and
    the previous one stays (:class:`motor.http.tls.CertReloader`). A CA added to ``ca_file``
    is trusted at once; one removed stays trusted until a restart (OpenSSL only adds).

    Raises
    ------
    ConfigError
        as :func:`server_context` (at construction).
    """

    def __init__(self, t: ControlPlaneTlsConfig) -> None:
        self.server = server_context(t)
        self.client = client_context(t)
        self._reloaders = [
            _tls.CertReloader(ctx, t.cert_file, t.key_file, t.key_password_file, t.ca_file,
                              FIELD) for ctx in (self.server, self.client)]
        self._next = 0.0

    @property
    def reloads(self) -> int:
        return self._reloaders[0].reloads

    def check(self, force: bool = False) -> bool:
        """Re-load if a file changed (or ``force``); True when new material is in use."""
        changed = [r.check(force) for r in self._reloaders]
        return any(changed)

    def check_every(self, now: float) -> bool:
        """:meth:`check` at most every :data:`RELOAD_INTERVAL_S` (``now``: monotonic s)."""
        if now < self._next:
            return False
        self._next = now + RELOAD_INTERVAL_S
        return self.check()


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


__all__ = ["FIELD", "RELOAD_INTERVAL_S", "ControlPlaneTls", "check", "client_context",
           "controller_endpoint", "server_context"]

"""TLS for motor's listeners and its upstream connections (Python's :mod:`ssl` over uvloop).

* :func:`server_context`: a server certificate chain and key (the key optionally encrypted,
  its password read from a file), TLS 1.2 at least, and with ``client_ca_file`` mutual TLS: a
  client without a certificate signed by that CA fails the handshake.
* :class:`CertReloader`: re-loads the certificate, key and client CA into the same context
  when their files change (polled) or on demand (SIGHUP); OpenSSL uses the context's current
  certificate for each new handshake, so new connections get the new certificate and open
  connections are not dropped.
* :func:`client_context`: HTTPS to engines: a CA bundle (default: the system's), verification
  on unless turned off, an optional client certificate.
* :func:`check_certificate`: the served certificate's dates (expired or not yet valid: an
  error at start and on a reload; expiring within :data:`EXPIRY_WARNING_DAYS`: a warning) and
  whether its names cover the listen host (a warning); read with ``cryptography``.

Errors are :class:`motor.errors.ConfigError` naming the config field and the file.
"""
from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable

from motor.errors import ConfigError

logger = logging.getLogger(__name__)


def _read_password(path: str | None, field: str) -> Callable[[], bytes] | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            pw = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path}: {e.strerror}") from None
    return lambda: pw


def _key_is_encrypted(path: str) -> bool:
    """Whether a PEM private key file is encrypted (PKCS#8 ``ENCRYPTED PRIVATE KEY`` or the
    traditional ``Proc-Type: 4,ENCRYPTED`` header)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
    except OSError:
        return False
    return b"ENCRYPTED PRIVATE KEY" in head or b"Proc-Type: 4,ENCRYPTED" in head


def _no_password() -> bytes:
    """The password callback without ``key_password_file``: never a terminal prompt (OpenSSL
    asks on the TTY when no callback is given)."""
    return b""


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str | None,
                password_file: str | None, field: str) -> None:
    pw = _read_password(password_file, f"{field}.key_password_file")
    for name, path in (("cert_file", cert_file), ("key_file", key_file)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{field}.{name}: expected a readable PEM file, got {path!r} "
                              f"(no such file)")
    key_path = key_file or cert_file
    encrypted = _key_is_encrypted(key_path)
    if encrypted and pw is None:
        raise ConfigError(f"{field}.key_password_file: expected the password file of the "
                          f"encrypted key {key_path!r}, got none")
    try:
        ctx.load_cert_chain(cert_file, key_file or None, password=pw or _no_password)
    except (ssl.SSLError, OSError) as e:
        if encrypted:
            raise ConfigError(f"{field}.key_password_file: expected the password of the "
                              f"encrypted key {key_path!r}, got one that does not decrypt it "
                              f"(from {password_file!r})") from None
        reason = e.reason if isinstance(e, ssl.SSLError) and e.reason else \
            (e.strerror or str(e))
        raise ConfigError(f"{field}: the certificate {cert_file!r} and key {key_path!r} do not "
                          f"load ({reason}); expected a PEM chain and its matching private "
                          f"key") from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str, field: str) -> None:
    if not os.path.isfile(ca_file):
        raise ConfigError(f"{field}: expected a readable PEM CA bundle, got {ca_file!r} "
                          f"(no such file)")
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{field}: the CA bundle {ca_file!r} does not load: {e}") from None


#: public names of the loaders (:mod:`motor.control_tls` builds its contexts with them)
load_chain = _load_chain
load_ca = _load_ca


#: a served certificate that expires within this many days is logged at WARNING (start, reload)
EXPIRY_WARNING_DAYS = 14


def check_certificate(cert_file: str, field: str, host: str | None = None,
                      now: float | None = None) -> list[str]:
    """The leaf certificate of ``cert_file`` (PEM, first block) checked for serving: returns
    warnings (expiring within :data:`EXPIRY_WARNING_DAYS`; ``host``, when given and not a
    wildcard address, not among its subject alternative names or common name).

    Raises
    ------
    ConfigError
        ``<field>.cert_file: the certificate ... expired on <date>`` / ``is not valid before
        <date>``, or a file whose first block is not a certificate.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID
    try:
        with open(cert_file, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}.cert_file: expected a PEM certificate, got {cert_file!r} "
                          f"({e})") from None
    t = datetime.datetime.fromtimestamp(now, datetime.UTC) if now is not None \
        else datetime.datetime.now(datetime.UTC)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if t > end:
        raise ConfigError(f"{field}.cert_file: expected a certificate valid now, got one that "
                          f"expired on {end:%Y-%m-%d %H:%M} UTC ({cert_file!r})")
    if t < start:
        raise ConfigError(f"{field}.cert_file: expected a certificate valid now, got one not "
                          f"valid before {start:%Y-%m-%d %H:%M} UTC ({cert_file!r}; the "
                          f"clock, or a certificate issued for later)")
    out = []
    if end - t < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
        out.append(f"{field}.cert_file: the certificate expires on {end:%Y-%m-%d %H:%M} UTC, "
                   f"in {(end - t).days} day(s) ({cert_file!r})")
    if host and host not in ("0.0.0.0", "::"):
        names: set[str] = set()
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names |= {n.lower() for n in san.get_values_for_type(x509.DNSName)}
            names |= {str(a) for a in san.get_values_for_type(x509.IPAddress)}
        except x509.ExtensionNotFound:
            pass
        names |= {str(a.value).lower() for a in
                  cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
        try:
            want = str(ipaddress.ip_address(host))
        except ValueError:
            want = host.lower().rstrip(".")
        wild = "*." + want.split(".", 1)[1] if "." in want else None
        if want not in names and (wild is None or wild not in names):
            out.append(f"{field}.cert_file: the certificate names {sorted(names) or 'nothing'}, "
                       f"not the listen host {host!r}: clients that connect by that name will "
                       f"refuse it")
    return out


def server_context(cert_file: str, key_file: str | None = None,
                   key_password_file: str | None = None, client_ca_file: str | None = None,
                   field: str = "coordinator.tls", host: str | None = None) -> ssl.SSLContext:
    """A server-side context: TLS >= 1.2, the chain of ``cert_file`` (PEM, leaf first) with
    ``key_file`` (PEM; default: in ``cert_file``), mTLS when ``client_ca_file`` is given. The
    certificate's dates and names are checked (:func:`check_certificate`; warnings logged).

    Raises
    ------
    ConfigError
        naming ``field`` and the file that is missing or does not load, or a certificate
        that is expired or not valid yet.
    """
    for w in check_certificate(cert_file, field, host) if os.path.isfile(cert_file) else ():
        logger.warning("%s", w)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    _load_chain(ctx, cert_file, key_file, key_password_file, field)
    if client_ca_file:
        _load_ca(ctx, client_ca_file, f"{field}.client_ca_file")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca_file: str | None = None, verify: bool = True,
                   cert_file: str | None = None, key_file: str | None = None,
                   key_password_file: str | None = None,
                   field: str = "coordinator.upstream_tls") -> ssl.SSLContext:
    """A client-side context for HTTPS to engines (or to the control plane): TLS >= 1.2,
    the system's CAs or ``ca_file``, host name checked; ``verify=False`` turns both off
    (logged once as a warning by the caller); a client certificate for mTLS when given.

    Raises
    ------
    ConfigError
        naming ``field`` and the file that is missing or does not load.
    """
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        _load_ca(ctx, ca_file, f"{field}.ca_file")
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert_file:
        _load_chain(ctx, cert_file, key_file, key_password_file, field)
    return ctx


class CertReloader:
    """Keeps a server context's certificate (and client CA) current with its files.

    :meth:`check` (called every few seconds by the server's housekeeping, and by the SIGHUP
    handler with ``force=True``) re-loads into the same context when a file's modification
    time or size changed. A new pair that fails to load is logged and the old one stays.
    """

    def __init__(self, ctx: ssl.SSLContext, cert_file: str, key_file: str | None = None,
                 key_password_file: str | None = None, client_ca_file: str | None = None,
                 field: str = "coordinator.tls") -> None:
        self.ctx = ctx
        self.cert_file, self.key_file = cert_file, key_file
        self.key_password_file, self.client_ca_file = key_password_file, client_ca_file
        self.field = field
        self._stamp = self._stat()
        self.reloads = 0

    def _stat(self) -> tuple[tuple[float, int], ...]:
        out = []
        for p in (self.cert_file, self.key_file, self.key_password_file, self.client_ca_file):
            try:
                st = os.stat(p) if p else None
                out.append((st.st_mtime, st.st_size) if st else (0.0, 0))
            except OSError:
                out.append((-1.0, -1))
        return tuple(out)

    def check(self, force: bool = False) -> bool:
        """Re-load if the files changed (or ``force``); True when new material is in use."""
        stamp = self._stat()
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            # first into a scratch context: a pair that does not load (a half-copied
            # rotation, a mismatched key) must not reach the live one, whose certificate
            # would then no longer match its key
            scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            _load_chain(scratch, self.cert_file, self.key_file, self.key_password_file,
                        self.field)
            for w in check_certificate(self.cert_file, self.field):  # expired: not loaded
                logger.warning("%s", w)
            if self.client_ca_file:
                _load_ca(scratch, self.client_ca_file, f"{self.field}.client_ca_file")
            _load_chain(self.ctx, self.cert_file, self.key_file, self.key_password_file,
                        self.field)
            if self.client_ca_file:
                _load_ca(self.ctx, self.client_ca_file, f"{self.field}.client_ca_file")
        except ConfigError as e:
            logger.error("TLS material not reloaded, the previous certificate stays in use: %s",
                         e)
            return False
        self.reloads += 1
        logger.info("TLS certificate reloaded from %s", self.cert_file)
        return True

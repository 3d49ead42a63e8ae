"""The served certificate checked at start and on a reload (motor.http.tls.check_certificate):
expired or not yet valid -> a config error naming the field and the date; expiring soon or
not naming the listen host -> a warning; a reload to an expired certificate keeps the old."""
from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import trustme

from motor.errors import ConfigError
from motor.http.tls import CertReloader, check_certificate, server_context

NOW = datetime.datetime.now(datetime.UTC)


def _write(tmp: Path, name: str, cert: trustme.LeafCert) -> tuple[str, str]:
    c, k = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(c))
    cert.private_key_pem.write_to_path(str(k))
    return str(c), str(k)


def test_dates_and_names(tmp_path: Path) -> None:
    ca = trustme.CA()
    good, _ = _write(tmp_path, "good", ca.issue_cert("gw.example", "127.0.0.1"))
    assert check_certificate(good, "coordinator.tls", "127.0.0.1") == []
    assert check_certificate(good, "coordinator.tls", "gw.example") == []
    assert check_certificate(good, "coordinator.tls", "0.0.0.0") == []      # wildcard: no check
    (w,) = check_certificate(good, "coordinator.tls", "10.1.2.3")
    assert "not the listen host '10.1.2.3'" in w and "gw.example" in w

    old, _ = _write(tmp_path, "old", ca.issue_cert(
        "127.0.0.1", not_before=NOW - datetime.timedelta(days=30),
        not_after=NOW - datetime.timedelta(days=1)))
    with pytest.raises(ConfigError, match=r"coordinator.tls.cert_file: expected a certificate "
                                          r"valid now, got one that expired on \d{4}-"):
        check_certificate(old, "coordinator.tls")
    later, _ = _write(tmp_path, "later", ca.issue_cert(
        "127.0.0.1", not_before=NOW + datetime.timedelta(days=2),
        not_after=NOW + datetime.timedelta(days=90)))
    with pytest.raises(ConfigError, match="not valid before"):
        check_certificate(later, "controller.tls")
    soon, _ = _write(tmp_path, "soon", ca.issue_cert(
        "127.0.0.1", not_after=NOW + datetime.timedelta(days=3)))
    (w,) = check_certificate(soon, "coordinator.tls", "127.0.0.1")
    assert "expires on" in w and ("in 2 day(s)" in w or "in 3 day(s)" in w)


def test_an_expired_certificate_refuses_to_start_and_is_not_reloaded(tmp_path: Path) -> None:
    ca = trustme.CA()
    live_c, live_k = tmp_path / "live.pem", tmp_path / "live.key"
    good_c, good_k = _write(tmp_path, "good", ca.issue_cert("127.0.0.1"))
    old_c, old_k = _write(tmp_path, "old", ca.issue_cert(
        "127.0.0.1", not_before=NOW - datetime.timedelta(days=30),
        not_after=NOW - datetime.timedelta(days=1)))
    with pytest.raises(ConfigError, match="expired"):
        server_context(old_c, old_k)
    live_c.write_bytes(Path(good_c).read_bytes())
    live_k.write_bytes(Path(good_k).read_bytes())
    ctx = server_context(str(live_c), str(live_k))
    r = CertReloader(ctx, str(live_c), str(live_k))
    live_c.write_bytes(Path(old_c).read_bytes())     # a rotation to an expired certificate
    live_k.write_bytes(Path(old_k).read_bytes())
    assert r.check() is False and r.reloads == 0

"""HTTPS endpoints in the coordinator's table (``Endpoint.scheme``): the pool speaks TLS with
``coordinator.upstream_tls``'s context, the endpoint routes only once a handshake verified,
a certificate that does not verify keeps it out (the reason kept), an unknown scheme is not
routed, and the model reader reads an HTTPS engine over TLS."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trustme

from motor.config.schema import Role
from motor.coordinator import endpoints as eps_mod
from motor.coordinator.endpoints import EndpointTable, ModelReader
from motor.http import Client
from motor.http.tls import client_context
from motor.protocol.instances import InstanceTable
from motor.sim.options import SimOptions, TlsOptions
from motor.sim.server import SimServer


def _files(d: Path, name: str) -> tuple[str, str, str]:
    ca = trustme.CA()
    ca_file, cert_file, key_file = (str(d / f"{name}-{x}.pem") for x in ("ca", "cert", "key"))
    ca.cert_pem.write_to_path(ca_file)
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(cert_file)
    leaf.private_key_pem.write_to_path(key_file)
    return ca_file, cert_file, key_file


def _table(port: int, scheme: str = "https", state: str = "ready") -> InstanceTable:
    return InstanceTable.model_validate({"version": 1, "instances": [{
        "id": "n/e/0", "model": "m", "role": "union", "engine": "sim", "node": "n",
        "state": state, "endpoints": [{"host": "127.0.0.1", "port": port, "scheme": scheme}]}]})


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_an_https_endpoint_routes_once_its_certificate_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eps_mod, "TLS_CHECK_RETRY_S", 0.05)
    ca_file, cert, key = _files(tmp_path, "engine")
    other_ca, _, _ = _files(tmp_path, "other")

    async def main() -> None:
        sim = SimServer(SimOptions(port=0, model="m", tls=TlsOptions(cert_file=cert,
                                                                     key_file=key)))
        await sim.start()
        good = EndpointTable(Client(tls=client_context(ca_file)))
        bad = EndpointTable(Client(tls=client_context(other_ca)))
        try:
            for t in (good, bad):
                t.apply(_table(sim.port))
                (ep,) = t.endpoints.values()
                assert ep.url == f"https://127.0.0.1:{sim.port}" and ep.https
                assert not ep.ready                        # not verified yet
                assert t.client.speaks_tls("127.0.0.1", sim.port)
            (g,) = good.endpoints.values()
            await _until(lambda: g.ready)
            assert g.tls_error is None and good.candidates(Role.UNION, "m") == [g]
            (b,) = bad.endpoints.values()
            await _until(lambda: b.tls_error is not None)
            assert "certificate verify failed" in b.tls_error and not b.ready
            assert bad.candidates(Role.UNION, "m") == []  # a 503, never plain HTTP

            # its instance leaves ready and comes back: verified again before it routes
            good.apply(_table(sim.port, state="unhealthy"))
            assert not g.ready and not g.tls_ok
            good.apply(_table(sim.port))
            assert not g.ready
            await _until(lambda: g.ready)

            # the engine restarted without TLS on the same port: a new plain endpoint
            good.apply(_table(sim.port, scheme="http"))
            (p,) = good.endpoints.values()
            assert p is not g and p.url == f"http://127.0.0.1:{sim.port}" and p.ready
            assert not good.client.speaks_tls("127.0.0.1", sim.port)

            # the models of an HTTPS engine are read over TLS
            good.apply(_table(sim.port))
            (g2,) = good.endpoints.values()
            await _until(lambda: g2.ready)
            reader_client = Client(tls=client_context(ca_file))
            got: list[object] = []
            reader = ModelReader(reader_client, lambda: good.endpoints.values(),
                                 lambda ep, m: got.append(m.ids))
            await reader.read(g2)
            assert got == [frozenset({"m"})]
            reader_client.close()
        finally:
            for t in (good, bad):
                t.close()
                t.client.close()
            await sim.stop(0.0)
    asyncio.run(main())


def test_an_unknown_scheme_or_no_tls_context_is_never_routed() -> None:
    async def main() -> None:
        t = EndpointTable(Client())
        t.apply(_table(1, scheme="h3"))
        assert t.endpoints == {}
        t.apply(_table(1))                   # https, but the client has no TLS context
        (ep,) = t.endpoints.values()
        assert not ep.ready and "needs a TLS client context" in str(ep.tls_error)
        assert not t.client.speaks_tls("127.0.0.1", 1)
        t.close()
        t.client.close()
    asyncio.run(main())

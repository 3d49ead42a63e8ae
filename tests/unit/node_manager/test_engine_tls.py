"""HTTPS engines (``engines[].tls``): the argv of vLLM, SGLang and motor sim, the config's
refusals, the endpoints registered as ``https``, and the node manager's probes of a real
HTTPS ``motor sim`` (verified against the group's CA; a wrong CA or a missing client
certificate fails the probe). Certificates come from a trustme CA made per test."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme

from motor.config.schema import ClusterConfig, EngineConfig, NodeConfig
from motor.errors import ConfigError
from motor.http import Client
from motor.node_manager.engines import plan_node
from motor.node_manager.health import HealthProbe
from motor.node_manager.supervisor import probe_client
from motor.protocol.instances import Endpoint, InstanceSpec
from motor.sim.options import SimOptions, TlsOptions
from motor.sim.server import SimServer


class Pki:
    """A test CA and files: the engines' certificate, a client certificate, the CA bundle."""

    def __init__(self, d: Path, name: str = "ca") -> None:
        self.ca = trustme.CA()
        self.dir = d
        self.ca_file = str(d / f"{name}.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)

    def pair(self, name: str, host: str = "127.0.0.1") -> tuple[str, str]:
        cert = self.ca.issue_cert(host)
        c, k = str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(c)
        cert.private_key_pem.write_to_path(k)
        return c, k


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def plans(tls: dict[str, Any], platform: str = "cuda", **kw: Any) -> list[Any]:
    base: dict[str, Any] = dict(name="e", model="/models/qwen", served_model_name="qwen",
                                base_port=9000, tls=tls)
    base.update(kw)
    return plan_node(NodeConfig(name="n", platform=platform, engines=[EngineConfig(**base)]))


def test_vllm_argv_golden_with_tls_and_a_client_ca(pki: Pki) -> None:
    cert, key = pki.pair("engine")
    (p,) = plans({"cert_file": cert, "key_file": key, "ca_file": pki.ca_file,
                  "client_ca_file": pki.ca_file, "client_cert_file": cert,
                  "client_key_file": key}, kind="vllm")
    assert p.processes[0].argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9000", "--model", "/models/qwen",
        "--served-model-name", "qwen", "--tensor-parallel-size", "1",
        "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", pki.ca_file,
        "--ssl-cert-reqs", "2",
        "--disable-access-log-for-endpoints", "/health,/metrics"]
    spec = p.spec()
    assert [e.url for e in spec.endpoints] == ["https://127.0.0.1:9000"]


def test_vllm_dp_ranks_each_serve_https(pki: Pki) -> None:
    cert, key = pki.pair("engine")
    (p,) = plans({"cert_file": cert, "key_file": key}, kind="vllm", dp_size=2)
    for proc in p.processes:
        i = proc.argv.index("--ssl-certfile")
        assert proc.argv[i:i + 4] == ["--ssl-certfile", cert, "--ssl-keyfile", key]
        assert proc.endpoint is not None and proc.endpoint.scheme == "https"
    assert "--ssl-ca-certs" not in p.processes[0].argv


def test_sim_argv_with_tls_and_span_master_only(pki: Pki) -> None:
    cert, key = pki.pair("engine")
    tls = {"cert_file": cert, "key_file": key}
    (p,) = plans(tls, platform="cpu", kind="sim", model="m", served_model_name=None)
    assert p.processes[0].argv == [
        sys.executable, "-m", "motor", "sim", "--host", "127.0.0.1", "--port", "9000",
        "--model", "m", "--role", "union", "--dp-rank", "0",
        "--ssl-certfile", cert, "--ssl-keyfile", key]
    span = {"nodes": ["a", "b"], "master_port": 13000}
    nodes = [{"name": n, "host": f"10.0.0.{i}", "engines": [
        {"name": "e", "model": "m", "dp_size": 2, "host": f"10.0.0.{i}", "span": span,
         "tls": tls}]} for i, n in ((1, "a"), (2, "b"))]
    cluster = ClusterConfig(nodes=nodes)
    (master,) = plan_node(cluster.nodes[0], cluster)
    (headless,) = plan_node(cluster.nodes[1], cluster)
    assert master.processes[0].argv[-4:] == ["--ssl-certfile", cert, "--ssl-keyfile", key]
    assert master.spec().endpoints[0].url == "https://10.0.0.1:18100"
    assert "--ssl-certfile" not in headless.processes[0].argv
    assert headless.processes[0].endpoint is None


def test_sglang_argv_with_tls(pki: Pki) -> None:
    cert, key = pki.pair("engine")
    (p,) = plans({"cert_file": cert, "key_file": key}, kind="sglang")
    argv = p.processes[0].argv
    assert argv[argv.index("--tp-size"):] == ["--tp-size", "1", "--ssl-certfile", cert,
                                              "--ssl-keyfile", key]


@pytest.mark.parametrize(("engine", "message"), [
    ({"kind": "sglang", "tls": {"cert_file": "c", "key_file": "k", "client_ca_file": "ca",
                                "client_cert_file": "c"}},
     "tls.client_ca_file: expected none for an sglang engine"),
    ({"kind": "vllm", "engine_config": {"ssl_certfile": "c"}},
     "engine_config.ssl_certfile: expected a flag motor does not set itself (it sets "
     "--ssl-certfile from tls"),
    ({"kind": "sim", "engine_config": {"--ssl-cert-reqs": 2}},
     "engine_config.--ssl-cert-reqs: expected a flag motor does not set itself"),
    ({"kind": "vllm", "host": "0.0.0.0", "tls": {"cert_file": "c", "key_file": "k"}},
     "host: expected the address the engines' certificate names with tls"),
    ({"kind": "vllm", "tls": {"cert_file": "c", "key_file": "k", "client_ca_file": "ca"}},
     "client_cert_file: expected the certificate the node manager's probes present"),
])
def test_config_refuses_what_cannot_work(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(name="e", model="m", **engine)
    assert message in str(e.value), e.value


def test_a_client_ca_needs_the_coordinators_client_certificate() -> None:
    tls = {"cert_file": "c", "key_file": "k", "client_ca_file": "ca", "client_cert_file": "c"}
    nodes = [{"name": "n", "engines": [{"name": "e", "model": "m", "tls": tls}]}]
    with pytest.raises(ValueError) as e:
        ClusterConfig(nodes=nodes)
    assert "coordinator.upstream_tls.cert_file: expected the client certificate the " \
           "coordinator presents to the engines of nodes[0].engines[0]" in str(e.value)
    ClusterConfig(nodes=nodes, coordinator={"upstream_tls": {"cert_file": "c"}})


def test_a_missing_tls_file_is_a_config_error_naming_the_field(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.pair("engine")
    with pytest.raises(ConfigError) as e:
        plans({"cert_file": str(tmp_path / "nope.pem"), "key_file": key}, kind="vllm")
    assert str(e.value) == (f"engines[0] of node 'n'.tls.cert_file: expected a readable PEM "
                            f"file, got '{tmp_path / 'nope.pem'}' (no such file)")
    with pytest.raises(ConfigError) as e:
        plans({"cert_file": cert, "key_file": key, "ca_file": str(tmp_path / "ca-nope.pem")},
              kind="vllm")
    assert "engines[0] of node 'n'.tls.ca_file: expected a readable PEM CA bundle" in \
        str(e.value)


def test_endpoint_scheme_is_wire_compatible() -> None:
    old = Endpoint.model_validate({"host": "h", "port": 1})          # an old node manager
    assert old.scheme == "http" and old.url == "http://h:1" and not old.https
    new = Endpoint(host="h", port=1, scheme="https")
    assert new.url == "https://h:1" and new.https
    # a later scheme parses (the table stays readable); the coordinator does not route it
    assert Endpoint.model_validate({"host": "h", "port": 1, "scheme": "h3"}).scheme == "h3"
    with pytest.raises(ValueError):
        Endpoint.model_validate({"host": "h", "port": 1, "scheme": "HTTPS://"})
    spec = InstanceSpec.model_validate({"id": "i", "model": "m", "role": "union",
                                        "engine": "sim",
                                        "endpoints": [{"host": "h", "port": 1}]})
    assert spec.endpoints[0].scheme == "http"


# ---------------------------------------------------------------- a real HTTPS motor sim
async def _sim(tls: TlsOptions) -> SimServer:
    s = SimServer(SimOptions(port=0, model="m", tls=tls))
    await s.start()
    return s


def _engine(tls: dict[str, Any], port: int) -> EngineConfig:
    return EngineConfig(name="e", model="m", base_port=port, tls=tls)


async def _probe(engine: EngineConfig, port: int) -> HealthProbe:
    (p,) = plan_node(NodeConfig(name="n", engines=[engine]))
    shared = Client()
    client = probe_client(p.processes[0], engine, shared)
    assert client is not shared and client.speaks_tls("127.0.0.1", port)
    probe = HealthProbe(client, "127.0.0.1", port, timeout_s=5.0)
    try:
        await probe.probe_once()
    finally:
        client.close()
        shared.close()
    return probe


def test_probes_of_an_https_sim_verify_its_certificate(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.pair("engine")
    other = Pki(tmp_path, "other")

    async def main() -> None:
        sim = await _sim(TlsOptions(cert_file=cert, key_file=key))
        try:
            port = sim.port
            good = await _probe(_engine({"cert_file": cert, "key_file": key,
                                         "ca_file": pki.ca_file}, port), port)
            assert good.last_error is None
            bad = await _probe(_engine({"cert_file": cert, "key_file": key,
                                        "ca_file": other.ca_file}, port), port)
            assert bad.last_error is not None and "CERTIFICATE_VERIFY_FAILED" in bad.last_error
            # plain HTTP to the TLS port gets no answer
            plain = Client()
            with pytest.raises((OSError, ConnectionError, asyncio.TimeoutError)):
                await plain.get_json_bytes("127.0.0.1", port, "/health", 2.0)
            plain.close()
        finally:
            await sim.stop(0.0)
    asyncio.run(main())


def test_an_sim_asking_for_client_certificates(pki: Pki) -> None:
    cert, key = pki.pair("engine")
    client_cert, client_key = pki.pair("probe")

    async def main() -> None:
        sim = await _sim(TlsOptions(cert_file=cert, key_file=key, ca_certs=pki.ca_file,
                                    cert_reqs=2))
        try:
            port = sim.port
            tls = {"cert_file": cert, "key_file": key, "ca_file": pki.ca_file,
                   "client_ca_file": pki.ca_file, "client_cert_file": client_cert,
                   "client_key_file": client_key}
            ok = await _probe(_engine(tls, port), port)
            assert ok.last_error is None
            # the same CA, no client certificate: the handshake is refused
            from motor.http.tls import client_context
            anon = Client(tls=client_context(pki.ca_file))
            anon.use_tls("127.0.0.1", port)
            with pytest.raises((OSError, ConnectionError)):
                await anon.get_json_bytes("127.0.0.1", port, "/health", 2.0)
            anon.close()
        finally:
            await sim.stop(0.0)
    asyncio.run(main())


def test_sim_cli_tls_flags(pki: Pki) -> None:
    import argparse

    from motor.sim.cli import add_arguments, options_from_args
    cert, key = pki.pair("engine")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options_from_args(parser.parse_args(["--ssl-certfile", cert, "--ssl-keyfile", key,
                                                "--ssl-ca-certs", pki.ca_file,
                                                "--ssl-cert-reqs", "2"]))
    assert opts.tls == TlsOptions(cert_file=cert, key_file=key, ca_certs=pki.ca_file,
                                  cert_reqs=2)
    assert options_from_args(parser.parse_args([])).tls is None
    with pytest.raises(ValueError, match="--ssl-cert-reqs 2: expected --ssl-ca-certs"):
        options_from_args(parser.parse_args(["--ssl-certfile", cert, "--ssl-cert-reqs", "2"]))
    with pytest.raises(ValueError, match="--ssl-keyfile: expected --ssl-certfile"):
        options_from_args(parser.parse_args(["--ssl-keyfile", key]))

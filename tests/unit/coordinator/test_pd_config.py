"""``coordinator.pd``: the PD modes take their policies, prefill timeout, union fallback
and metaserver URL from it (defaults: coordinator policy / least_load / first_token_s /
fallback on / the coordinator's own address)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from motor.config.schema import CoordinatorConfig, PdConfig, PolicyName, Role
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.policy import make_policy
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.coordinator.policy.least_load import LeastLoad
from motor.coordinator.policy.round_robin import RoundRobin
from motor.coordinator.routing.pd_decode_first import DecodeFirst
from motor.coordinator.routing.pd_prefill_first import PrefillFirst
from motor.coordinator.server import Coordinator
from motor.http.client import Client
from tests.support.gateway import Gateway, http, run_async


def _coord(**cfg: object) -> tuple[Coordinator, Client]:
    c = CoordinatorConfig(**cfg)
    client = Client(c.max_connections_per_endpoint, c.timeouts.connect_s)
    return Coordinator(c, EndpointTable(client), make_policy(c.policy.value)), client


def test_defaults() -> None:
    pd = PdConfig()
    assert pd.prefill_policy is None and pd.decode_policy is PolicyName.LEAST_LOAD
    assert pd.prefill_timeout_s is None and pd.fallback_to_union and pd.metaserver_url is None
    coord, client = _coord(mode="pd_prefill_first", port=8123,
                           timeouts={"first_token_s": 7.0})
    try:
        assert isinstance(coord.path, PrefillFirst)
        assert coord.path.prefill_policy is coord.policy          # coordinator.policy
        assert isinstance(coord.path.decode_policy, LeastLoad)
        assert coord.path.prefill_timeout_s == 7.0
    finally:
        client.close()


def test_overrides() -> None:
    coord, client = _coord(mode="pd_decode_first", policy="least_load", port=8123,
                           pd={"prefill_policy": "kv_affinity", "decode_policy": "round_robin",
                               "prefill_timeout_s": 3.5,
                               "metaserver_url": "http://10.0.0.9:9000/v1/metaserver"})
    try:
        pdm = coord.path
        assert isinstance(pdm, DecodeFirst)
        assert isinstance(pdm.prefill_policy, KvAffinity)
        assert isinstance(pdm.decode_policy, RoundRobin)
        assert pdm.prefill_timeout_s == 3.5
        assert pdm.metaserver_url == "http://10.0.0.9:9000/v1/metaserver"
    finally:
        client.close()
    coord, client = _coord(mode="pd_decode_first", host="127.0.0.1", port=8123)
    try:
        assert isinstance(coord.path, DecodeFirst)
        assert coord.path.metaserver_url == "http://127.0.0.1:8123/v1/metaserver"
    finally:
        client.close()


@pytest.mark.parametrize("bad", [{"prefill_timeout_s": 0}, {"metaserver_url": "10.0.0.9:9000"},
                                 {"decode_policy": "random"}, {"typo": 1}])
def test_invalid(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PdConfig(**bad)  # type: ignore[arg-type]


@run_async
async def test_fallback_off_gives_503_without_decode() -> None:
    # a prefill and a union backend, no decode; nothing listens on the ports (never reached)
    backends = [(Role.PREFILL, "127.0.0.1", 9), (Role.UNION, "127.0.0.1", 9)]
    gw = await Gateway(backends, mode="pd_prefill_first",
                       pd={"fallback_to_union": False}).start()
    try:
        st, _, body = await http(gw.port, "POST", "/v1/completions",
                                 b'{"model":"m","prompt":"hi","max_tokens":2}')
        assert st == 503 and b"no decode instance is ready" in body
    finally:
        await gw.stop()

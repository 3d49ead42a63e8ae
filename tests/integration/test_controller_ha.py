"""Controller HA on a real 3-member etcd (issue 14), controllers in this process.

One leader among three; followers redirect (307 + the leader's URL) and ControllerLink follows;
registrations are persisted before they are acknowledged, so a standby that takes over serves
the same table; a leader that can no longer renew its lease (frozen) is replaced and its late
write is fenced off; a restarted single controller recovers its state from etcd.
"""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from motor.config.schema import ControllerConfig, EtcdConfig, Role
from motor.control_link import ControllerLink
from motor.controller.etcd_store import NotLeader, fenced_write
from motor.controller.server import ControllerServer
from motor.http import Client
from motor.protocol.instances import (Endpoint, Heartbeat, InstanceSpec, InstanceState,
                                      NodeRegistration)
from tests.support.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


@pytest.fixture
def etcd3(tmp_path):
    cluster = EtcdCluster(3, str(tmp_path)).start()
    try:
        yield cluster
    finally:
        cluster.close()


def _cfg(endpoints: list[str], prefix: str) -> ControllerConfig:
    return ControllerConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                            etcd=EtcdConfig(endpoints=endpoints, prefix=prefix))


def _reg(node: str, ids: list[str], port0: int = 9000) -> bytes:
    insts = [InstanceSpec(id=i, model="m", role=Role.UNION, engine="sim", healthy=True,
                          endpoints=[Endpoint(host="127.0.0.1", port=port0 + k)])
             for k, i in enumerate(ids)]
    return NodeRegistration(node=node, host="127.0.0.1", instances=insts,
                            mgmt_port=None).model_dump_json().encode()


async def _leader(servers: list[ControllerServer], timeout_s: float = 10.0) -> ControllerServer:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leaders = [s for s in servers if s.leading and s.ha is not None and s.ha.token]
        if len(leaders) == 1 and leaders[0].registry.version > 0:
            return leaders[0]
        assert len(leaders) <= 1, [s.url for s in leaders]
        await asyncio.sleep(0.05)
    raise AssertionError("no leader elected in time")


def test_one_leader_redirects_persistence_and_takeover(etcd3):
    async def main() -> None:
        servers = [ControllerServer(_cfg(etcd3.endpoints, "/t1")) for _ in range(3)]
        for s in servers:
            await s.start("127.0.0.1", 0)
        client = Client(connect_timeout_s=1.0)
        try:
            leader = await _leader(servers)
            followers = [s for s in servers if s is not leader]
            # a follower redirects with the leader's URL in Location and in the body
            await asyncio.sleep(0.5)   # followers have read the leader key
            f = followers[0]
            status, raw = await client.get_json_bytes("127.0.0.1", f.port, "/v1/nodes", 2.0)
            assert status == 307, raw
            assert orjson.loads(raw)["leader"] == leader.url
            # a client given only the followers reaches the leader through the redirect
            link = ControllerLink([s.url for s in followers], client)
            status, raw = await link.request("POST", "/v1/nodes/register",
                                             _reg("n1", ["a", "b"]), 2.0)
            assert status == 200, raw
            assert link.redirects == 1 and link.current == ("127.0.0.1", leader.port)
            version = orjson.loads(raw)["version"]
            hb = Heartbeat(node="n1", health={"a": True, "b": False})
            status, raw = await link.request("POST", "/v1/nodes/heartbeat",
                                             hb.model_dump_json().encode(), 2.0)
            assert status == 200 and orjson.loads(raw)["known"] is True
            before = {i.id: i.state for i in leader.registry.table().instances}
            assert before == {"a": InstanceState.READY, "b": InstanceState.UNHEALTHY}

            # the leader stops (hands its lease back): a standby leads with the state intact
            t0 = time.monotonic()
            await leader.stop()
            new = await _leader(followers)
            took = time.monotonic() - t0
            after = {i.id: i.state for i in new.registry.table().instances}
            assert after == before
            assert new.registry.version > version
            assert took < 3.0, took
            # the link finds the new leader (the old address refuses connections now)
            status, raw = await link.request("GET", "/v1/instances", None, 2.0)
            assert status == 200
            assert sorted(i["id"] for i in orjson.loads(raw)["instances"]) == ["a", "b"]
            assert link.current == ("127.0.0.1", new.port)
            assert new.metrics.leader_changes._value.get() == 1
        finally:
            client.close()
            for s in servers:
                await s.stop()
    asyncio.run(main())


def test_frozen_leader_is_replaced_and_fenced(etcd3):
    """A leader whose election loop stops (a process frozen, or cut off from etcd) loses the
    lease within its TTL; a standby takes over; the old leader knows it does not lead (its own
    clock) and a write with its old fencing token fails."""
    async def main() -> None:
        servers = [ControllerServer(_cfg(etcd3.endpoints, "/t2")) for _ in range(2)]
        for s in servers:
            await s.start("127.0.0.1", 0)
        try:
            old = await _leader(servers)
            other = next(s for s in servers if s is not old)
            assert old.ha is not None and old.ha._task is not None
            token = old.ha.token
            assert token is not None
            old.ha._task.cancel()           # no keep-alive any more, nothing revoked
            t0 = time.monotonic()
            new = await _leader([other], timeout_s=10)
            took = time.monotonic() - t0
            assert new is other
            assert took < 2 * old.config.etcd.lease_ttl_s + 1.5, took  # type: ignore[union-attr]
            assert not old.leading         # stepped down by its own clock, before etcd moved on
            with pytest.raises(NotLeader):
                await fenced_write(old.ha.session, token, 10**15, [("x", {"node": "x"})], [])
            got = await new.ha.session.call("get", new.ha.session.node_key("x"))  # type: ignore[union-attr]
            assert got is None
        finally:
            for s in servers:
                await s.stop()
    asyncio.run(main())


async def _registered_then_stopped(cfg: ControllerConfig, client: Client) -> int:
    """A controller of ``cfg`` leads, node n1 registers instance a through its API, and it
    stops (its lease revoked); returns the registry's version it reached."""
    first = ControllerServer(cfg)
    await first.start("127.0.0.1", 0)
    try:
        await _leader([first])
        status, _ = await client.post_json_bytes("127.0.0.1", first.port, "/v1/nodes/register",
                                                 _reg("n1", ["a"]), 2.0)
        assert status == 200
        return first.registry.version
    finally:
        await first.stop()


def test_restarted_controller_recovers_its_state(etcd3):
    """One controller with etcd: after a restart the table is there at once (no warm-up, no
    re-registration needed), and heartbeats from the node are known."""
    async def main() -> None:
        cfg = _cfg(etcd3.endpoints, "/t3")
        client = Client(connect_timeout_s=1.0)
        try:
            v1 = await _registered_then_stopped(cfg, client)
            second = ControllerServer(cfg)
            await second.start("127.0.0.1", 0)
            try:
                await _leader([second])
                table = second.registry.table()
                assert [(i.id, i.state) for i in table.instances] == [("a", InstanceState.READY)]
                assert table.version > v1
                known, _ = second.registry.heartbeat(Heartbeat(node="n1", health={"a": True}))
                assert known
            finally:
                await second.stop()
        finally:
            client.close()
    asyncio.run(main())


def test_tls_to_etcd(tmp_path):
    """``controller.etcd.tls``: etcd serves its client port over TLS and asks for client
    certificates (``--client-cert-auth``); a controller with the CA and a client certificate
    leads and persists; one without a client certificate never reaches etcd."""
    import trustme

    from motor.errors import ConfigError

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {"ca": str(tmp_path / "ca.pem"), "cert": str(tmp_path / "cert.pem"),
             "key": str(tmp_path / "key.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    cluster = EtcdCluster(1, str(tmp_path), tls=paths).start()

    def cfg(client_cert: bool) -> ControllerConfig:
        tls = {"ca_file": paths["ca"]}
        if client_cert:
            tls |= {"cert_file": paths["cert"], "key_file": paths["key"]}
        return ControllerConfig(etcd=EtcdConfig(endpoints=cluster.endpoints, prefix="/tls",
                                                tls=tls))

    async def main() -> None:
        good = ControllerServer(cfg(True))
        bad = ControllerServer(cfg(False))
        await good.start("127.0.0.1", 0)
        await bad.start("127.0.0.1", 0)
        try:
            await _leader([good])
            good.registry.register(NodeRegistration.model_validate_json(_reg("n1", ["a"])))
            await good._persist()
            got = await good.ha.session.call("get", good.ha.session.node_key("n1"))  # type: ignore[union-attr]
            assert got is not None and orjson.loads(got.value)["node"] == "n1"
            await asyncio.sleep(1.0)
            assert not bad.leading and bad.ha is not None and not bad.ha.etcd_reachable
        finally:
            await good.stop()
            await bad.stop()
    try:
        asyncio.run(main())
    finally:
        cluster.close()
    with pytest.raises(ValueError, match=r"endpoints\[0\]: an https:// etcd endpoint needs "
                                         r"controller.etcd.tls"):
        EtcdConfig(endpoints=cluster.endpoints)
    bad_file = EtcdConfig(endpoints=cluster.endpoints, tls={"ca_file": str(tmp_path / "nope")})
    from motor.controller.etcd_store import credentials
    with pytest.raises(ConfigError, match="controller.etcd.tls.ca_file: cannot read"):
        credentials(bad_file)


def test_a_new_leader_answers_no_table_until_it_restored_its_registry(etcd3, monkeypatch):
    """Between its election and the registry read back from etcd, a leader answers 503 (no
    leader yet), never its empty registry: a coordinator that polled it then dropped every
    endpoint for a few ms and answered 503s (the etcd chaos test's kill -9, 2 of 624)."""
    from motor.controller import etcd_store

    real_load = etcd_store.load_state
    gate = asyncio.Event()

    async def slow_load(session):  # type: ignore[no-untyped-def]
        await gate.wait()
        return await real_load(session)

    async def main() -> None:
        cfg = _cfg(etcd3.endpoints, "/t5")
        client = Client(connect_timeout_s=1.0)
        try:
            await _registered_then_stopped(cfg, client)
            monkeypatch.setattr(etcd_store, "load_state", slow_load)
            second = ControllerServer(cfg)
            await second.start("127.0.0.1", 0)
            try:
                deadline = time.monotonic() + 10
                while not (second.ha is not None and second.ha.is_leader):
                    assert time.monotonic() < deadline, "not elected"
                    await asyncio.sleep(0.02)
                # elected, the registry not restored yet
                assert not second.leading
                status, body = await client.get_json_bytes("127.0.0.1", second.port,
                                                           "/v1/instances", 2.0)
                assert status == 503, (status, body)
                gate.set()
                await _leader([second])
                status, body = await client.get_json_bytes("127.0.0.1", second.port,
                                                           "/v1/instances", 2.0)
                assert status == 200
                assert [i["id"] for i in orjson.loads(body)["instances"]] == ["a"]
            finally:
                gate.set()
                await second.stop()
        finally:
            client.close()
    asyncio.run(main())

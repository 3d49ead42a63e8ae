"""The controllers' shared state in etcd: one client over the members, leader lease, fenced writes.

Client: `aetcd <https://github.com/martyanov/aetcd>`_ (asyncio over grpc.aio, etcd's v3 gRPC
API). aetcd talks to one member; :class:`EtcdSession` keeps a list of the members' client
addresses (``controller.etcd.endpoints``) and moves to the next one when a request fails on a
connection error or a timeout, so one stopped member costs one request's timeout.

Keys under ``controller.etcd.prefix`` (``P``)::

    P/leader          {"id": str, "url": str, "since": float}   attached to the leader's lease
    P/version         the instance table's last version (decimal)
    P/nodes/<name>    one node's record (Registry.node_record: host, management port, its
                      instances with their states and operator actions), JSON

Every write of the registry is one transaction that compares ``create_revision(P/leader)``
with the revision at which this controller created the key when it was elected: once the
lease has expired (or another controller won the key), the comparison fails and nothing is
written (fencing: a deposed leader's writes fail). Wire facts: etcd's v3 API (``Txn`` with
``Compare{target: CREATE}``, ``LeaseGrant`` / ``LeaseKeepAlive``; a keep-alive of an expired
lease answers ``TTL <= 0``), https://etcd.io/docs/v3.4/learning/api/.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import orjson

from motor.config.schema import EtcdConfig

logger = logging.getLogger(__name__)


class EtcdUnavailable(ConnectionError):
    """No etcd member answered (every endpoint failed or timed out)."""


class NotLeader(RuntimeError):
    """A fenced write failed: this controller's leader key is gone or belongs to another."""


def _is_transport_error(e: BaseException) -> bool:
    import aetcd
    return isinstance(e, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError,
                          aetcd.InternalError, TimeoutError, OSError)) or (
        isinstance(e, aetcd.ClientError) and "unavailable" in str(e).lower())


def retrieve_outcome(t: asyncio.Future[Any]) -> None:
    """Done callback of a task nobody awaits (a channel's close, an election task left
    behind): read its outcome, so a failure there (nothing to do about it) is not logged as
    "exception never retrieved" at exit."""
    if not t.cancelled():
        t.exception()


class EtcdSession:
    """aetcd over several members, with failover to the next member.

    Parameters
    ----------
    config : EtcdConfig
        ``endpoints`` (``HOST:PORT``), ``prefix``, ``timeout_s`` (per request).
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.prefix = config.prefix.rstrip("/")
        self.endpoints = config.addresses
        self._i = 0
        self._client: Any = None
        #: :meth:`close` was called: no new client is opened (a call fails, EtcdUnavailable)
        self._closed = False
        #: member (``HOST:PORT``) -> whether the last request sent to it succeeded (members
        #: not tried yet are absent)
        self.health: dict[str, bool] = {}
        self.leader_key = f"{self.prefix}/leader".encode()
        self.version_key = f"{self.prefix}/version".encode()
        self.nodes_prefix = f"{self.prefix}/nodes/".encode()

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the member in use now."""
        return self.endpoints[self._i]

    def node_key(self, name: str) -> bytes:
        return self.nodes_prefix + name.encode()

    async def _connected(self) -> Any:
        if self._client is None:
            if self._closed:
                raise EtcdUnavailable("the etcd session is closed")
            import aetcd
            host, _, port = self.endpoint.rpartition(":")
            if self.config.tls is None:
                client = aetcd.Client(host=host.strip("[]"), port=int(port),
                                      timeout=self.config.timeout_s)
            else:
                client = _tls_client_class()(host=host.strip("[]"), port=int(port),
                                             timeout=self.config.timeout_s)
                client.credentials = credentials(self.config)
            await client.connect()
            self._client = client
        return self._client

    async def _drop(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            # bounded with asyncio.wait, not wait_for: on Python 3.11 wait_for's timeout waits
            # for the cancelled close to end, and a gRPC channel's close may not
            t = asyncio.ensure_future(c.close())
            t.add_done_callback(retrieve_outcome)
            done, _ = await asyncio.wait({t}, timeout=1.0)
            if not done:
                t.cancel()

    async def call(self, op: str, *args: Any, wait_s: float | None = None, **kwargs: Any) -> Any:
        """``aetcd.Client.<op>(*args, **kwargs)`` on the current member; on a transport failure
        the next members are tried once each. ``wait_s``: how long one try may take (default
        ``timeout_s`` + 0.5 s; a watch waits longer).

        Raises
        ------
        EtcdUnavailable
            every member failed; the last error is chained.
        """
        last: BaseException | None = None
        for _ in range(len(self.endpoints)):
            try:
                client = await self._connected()
                out = await asyncio.wait_for(getattr(client, op)(*args, **kwargs),
                                             wait_s or self.config.timeout_s + 0.5)
                self.health[self.endpoint] = True
                return out
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted below
                if not _is_transport_error(e):
                    raise
                last = e
                failed = self.endpoint
                was_up = self.health.get(failed, True)
                self.health[failed] = False
                await self._drop()
                self._i = (self._i + 1) % len(self.endpoints)
                if len(self.endpoints) > 1 and was_up:   # once per member going down
                    logger.warning("etcd member %s failed (%s: %s); using %s", failed,
                                   type(e).__name__, e, self.endpoint)
        raise EtcdUnavailable(f"no etcd member answered ({', '.join(self.endpoints)}): "
                              f"{type(last).__name__}: {last}") from last

    @property
    def txn(self) -> Any:
        """aetcd's transaction builders (``.create(key) == rev``, ``.put``, ``.delete``)."""
        import aetcd
        return aetcd.Transactions()

    async def close(self) -> None:
        """Close the client; later calls fail (:class:`EtcdUnavailable`) instead of opening
        another (a task left behind by :meth:`Leadership.stop` cannot reach etcd again)."""
        self._closed = True
        await self._drop()


def credentials(config: EtcdConfig) -> Any:
    """gRPC channel credentials of ``controller.etcd.tls``: the CA, and the client certificate
    when one is given.

    Raises
    ------
    ConfigError
        a file that is missing or cannot be read, naming the field.
    """
    import grpc

    from motor.errors import ConfigError
    t = config.tls
    assert t is not None

    def read(path: str | None, field: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"controller.etcd.tls.{field}: cannot read {path!r}: "
                              f"{e.strerror or e}") from e

    ca = read(t.ca_file, "ca_file")
    chain = read(t.cert_file, "cert_file")
    key = read(t.key_file, "key_file") if t.key_file else chain
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key if chain else None,
                                        certificate_chain=chain)


def _tls_client_class() -> type:
    """aetcd's client over a TLS channel (aetcd 1.0 opens plain channels only; this subclass
    opens ``grpc.aio.secure_channel`` and sets up the same stubs aetcd's ``connect`` does:
    KV, Cluster, Lease, Maintenance and the watcher)."""
    import aetcd
    from aetcd import rpc, watcher

    class TlsClient(aetcd.Client):
        credentials: Any = None

        async def connect(self) -> None:
            if self._connected.is_set():
                return
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self.credentials,
                                              options=self._options.items())
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()

    return TlsClient


class Lease:
    """The leader's lease: granted, kept alive, and known locally to be valid until
    :attr:`valid_until` (the time the last keep-alive was *sent* + the TTL it got back), so a
    leader that cannot reach etcd stops acting as one before etcd gives the key away."""

    def __init__(self, session: EtcdSession, ttl_s: int) -> None:
        self.session = session
        self.ttl_s = ttl_s
        self.lease: Any = None
        self.valid_until = 0.0

    @property
    def id(self) -> int:
        return int(self.lease.id) if self.lease is not None else 0

    async def grant(self) -> None:
        sent = time.monotonic()
        self.lease = await self.session.call("lease", self.ttl_s)
        self.valid_until = sent + self.lease.ttl

    async def refresh(self) -> bool:
        """One keep-alive; False when etcd says the lease expired."""
        sent = time.monotonic()
        reply = await self.session.call("refresh_lease", self.id)
        ttl = int(getattr(reply, "TTL", 0)) if reply is not None else 0
        if ttl <= 0:
            self.valid_until = 0.0
            return False
        self.valid_until = sent + ttl
        return True

    def valid(self, margin_s: float = 0.25) -> bool:
        return time.monotonic() < self.valid_until - margin_s

    async def revoke(self) -> None:
        if self.lease is not None:
            try:
                await self.session.call("revoke_lease", self.id)
            except Exception as e:  # noqa: BLE001 - it expires by itself anyway
                logger.debug("lease revoke failed: %s", e)
        self.lease = None
        self.valid_until = 0.0


async def read_leader(session: EtcdSession) -> tuple[dict[str, Any] | None, int]:
    """The leader record and the key's mod revision (``(None, 0)`` when there is none)."""
    got = await session.call("get", session.leader_key)
    if got is None:
        return None, 0
    try:
        rec = orjson.loads(got.value)
    except orjson.JSONDecodeError:
        rec = {"id": "?", "url": None}
    return (rec if isinstance(rec, dict) else {"id": "?", "url": None}), int(got.mod_revision)


async def campaign(session: EtcdSession, lease: Lease, record: dict[str, Any]) -> int | None:
    """Create ``P/leader`` with ``record`` on ``lease`` if nobody holds it; returns its create
    revision (the fencing token) when this call created it, else None."""
    t = session.txn
    ok, _ = await session.call(
        "transaction", compare=[t.create(session.leader_key) == 0],
        success=[t.put(session.leader_key, orjson.dumps(record), lease.lease)], failure=[])
    if not ok:
        return None
    got = await session.call("get", session.leader_key)
    if got is None or int(got.lease) != lease.id:
        return None
    return int(got.create_revision)


async def load_state(session: EtcdSession) -> tuple[int, list[dict[str, Any]]]:
    """``(version, node records)`` as the last leader wrote them (``(0, [])`` for none)."""
    got = await session.call("get", session.version_key)
    version = int(got.value) if got is not None and got.value.isdigit() else 0
    records = []
    for kv in await session.call("get_prefix", session.nodes_prefix):
        try:
            rec = orjson.loads(kv.value)
        except orjson.JSONDecodeError:
            logger.warning("etcd key %r is not JSON; ignored", kv.key)
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return version, records


async def fenced_write(session: EtcdSession, token: int, version: int,
                       puts: Iterable[tuple[str, dict[str, Any]]],
                       deletes: Iterable[str]) -> None:
    """One transaction: ``P/nodes/<name>`` put / deleted and ``P/version``, if and only if
    ``P/leader`` still has create revision ``token``.

    Raises
    ------
    NotLeader
        the comparison failed (the lease expired or another controller leads).
    EtcdUnavailable
        no member answered.
    """
    t = session.txn
    ops = [t.put(session.node_key(name), orjson.dumps(rec)) for name, rec in puts]
    ops += [t.delete(session.node_key(name)) for name in deletes]
    ops.append(t.put(session.version_key, str(version).encode()))
    ok, _ = await session.call("transaction", compare=[t.create(session.leader_key) == token],
                               success=ops, failure=[])
    if not ok:
        raise NotLeader("the leader key is gone or another controller's")

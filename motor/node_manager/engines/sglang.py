"""SGLang (``python -m sglang.launch_server``): config -> argv / env.

SGLang runs all its DP ranks behind one HTTP server, so an instance is one process with one
endpoint (``base_port + i*dp_size``) and ``--dp-size``.

argv of instance ``i``::

    <launcher: python -m sglang.launch_server> --host H --port P --model-path <model>
        --served-model-name <name> --tp-size TP [--dp-size DP]
        [--disaggregation-mode prefill|decode]                                (PD roles)
        [--ssl-certfile C --ssl-keyfile K]                                    (tls)
        <engine_config flags>
        [--disaggregation-bootstrap-port 8998+i]             (prefill; user value wins)

An instance spanning nodes (``span``) runs one process per node, node ``k`` of
``span.nodes`` with ``--nnodes len(span.nodes) --node-rank k --dist-init-addr A:R`` (the DP
master's address and port, from the controller's order); the HTTP server is on the master
(node rank 0) only, the others are not probed. SGLang's sizes are then those of the whole
instance: ``--tp-size dp_size*tp_size`` (every device of the instance, on all nodes) and
``--dp-size dp_size`` (its DP-attention ranks: add ``enable_dp_attention: true``). Source:
sgl-project/sglang ``python/sglang/srt/server_args.py`` ("Multi-node distributed serving":
``--dist-init-addr`` "e.g., `192.168.0.2:25000`", ``--nnodes``, ``--node-rank``).

``tls``: SGLang's ``--ssl-certfile`` / ``--ssl-keyfile`` (sgl-project/sglang
``python/sglang/srt/server_args.py``, section "SSL/TLS", with ``--ssl-ca-certs`` and
``--ssl-keyfile-password`` but no flag that requires a client certificate, so the config
refuses ``tls.client_ca_file`` for SGLang; an SGLang older than that section exits at start
with an unknown-argument error, which the node manager reports as the engine failing).

Env: ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=true`` (``/health`` runs a 1-token
generation, so a stuck engine is unhealthy) and the node platform's device variable
(``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``, none on ``cpu``) with the instance's
``tp_size*dp_size`` devices of the group's (:func:`~motor.node_manager.engines.group_devices`),
each unless the engine's ``env`` sets it.
"""
from __future__ import annotations

import sys
from typing import Any

from motor.config.engine_flags import managed_flags
from motor.config.schema import ClusterConfig, EngineConfig, NodeConfig, Role
from motor.node_manager.engines import (InstancePlan, ProcessSpec, base_env, device_env,
                                        endpoint, engine_flags, group_devices, instance_id,
                                        join_host_port, launcher, master_endpoint,
                                        process_name, span_instance_id, span_part, tls_flags)
from motor.node_manager.engines.vllm import kv_events_address, user_value
from motor.protocol.instances import KvTransfer
BOOTSTRAP_PORT_BASE = 8998


def default_launcher() -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server"]


class SglangBackend:
    def bootstrap_port(self, engine: EngineConfig, index: int) -> int | None:
        if engine.role is not Role.PREFILL:
            return None
        v = user_value(engine, "disaggregation-bootstrap-port")
        return int(v) if v is not None else BOOTSTRAP_PORT_BASE + index

    def argv(self, engine: EngineConfig, index: int) -> list[str]:
        ep = endpoint(engine, index, 0)
        managed: list[tuple[str, Any]] = [
            ("host", ep.host), ("port", ep.port), ("model-path", engine.model),
            ("served-model-name", engine.model_name), ("tp-size", engine.tp_size)]
        if engine.dp_size > 1:
            managed.append(("dp-size", engine.dp_size))
        if engine.role is not Role.UNION:
            managed.append(("disaggregation-mode", engine.role.value))
        managed += tls_flags(engine, client_certs=False)
        defaults: list[tuple[str, Any]] = []
        bp = self.bootstrap_port(engine, index)
        if bp is not None:
            defaults.append(("disaggregation-bootstrap-port", bp))
        return launcher(engine, default_launcher()) + engine_flags(
            engine.engine_config, managed=managed, defaults=defaults,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("sglang"))

    def env(self, node: NodeConfig, engine: EngineConfig, index: int, iid: str) -> dict[str, str]:
        env: dict[str, str] = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}
        devs = group_devices(node, engine)
        n = engine.devices_per_instance
        env.update(device_env(node, engine, devs[index * n:(index + 1) * n] if devs else None))
        env.update(base_env(engine, iid, 0))
        return env

    def build(self, node: NodeConfig, engine: EngineConfig, index: int,
              cluster: ClusterConfig | None = None) -> InstancePlan:
        iid = instance_id(node.name, engine.name, index)
        proc = ProcessSpec(name=process_name(node.name, engine.name, index, 0, 1),
                           argv=self.argv(engine, index), env=self.env(node, engine, index, iid),
                           endpoint=endpoint(engine, index, 0), health_path=engine.health_path)
        return InstancePlan(id=iid, node=node.name, engine=engine, processes=[proc],
                            kv_events=kv_events_address(engine),
                            bootstrap_port=self.bootstrap_port(engine, index),
                            kv_transfer=self.kv_transfer(engine))

    def part_argv(self, engine: EngineConfig, node_rank: int, master_host: str,
                  master_port: int) -> list[str]:
        """argv of node ``node_rank``'s part of ``engine``'s instance spanning nodes."""
        assert engine.span is not None
        managed: list[tuple[str, Any]] = []
        if node_rank == 0:
            managed += [("host", engine.host), ("port", engine.base_port)]
        managed += [("model-path", engine.model), ("served-model-name", engine.model_name),
                    ("tp-size", engine.dp_size * engine.tp_size)]
        if engine.dp_size > 1:
            managed.append(("dp-size", engine.dp_size))
        if engine.role is not Role.UNION:
            managed.append(("disaggregation-mode", engine.role.value))
        managed += [("nnodes", len(engine.span.nodes)), ("node-rank", node_rank),
                    ("dist-init-addr", join_host_port(master_host, master_port))]
        if node_rank == 0:
            managed += tls_flags(engine, client_certs=False)
        defaults: list[tuple[str, Any]] = []
        bp = self.bootstrap_port(engine, 0)
        if bp is not None and node_rank == 0:
            defaults.append(("disaggregation-bootstrap-port", bp))
        return launcher(engine, default_launcher()) + engine_flags(
            engine.engine_config, managed=managed, defaults=defaults,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("sglang"))

    def build_part(self, node: NodeConfig, engine: EngineConfig,
                   cluster: ClusterConfig) -> InstancePlan:
        iid = span_instance_id(engine)
        rank = engine.span.nodes.index(node.name) if engine.span else 0

        def build(master_host: str, master_port: int) -> list[ProcessSpec]:
            env: dict[str, str] = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}
            env.update(device_env(node, engine, group_devices(node, engine)))
            env.update(base_env(engine, iid, rank * engine.dp_size_local))
            ep = master_endpoint(engine) if rank == 0 else None
            return [ProcessSpec(name=process_name(node.name, engine.name, 0, 0, 1),
                                argv=self.part_argv(engine, rank, master_host, master_port),
                                env=env, endpoint=ep,
                                health_path=engine.health_path if rank == 0 else None)]
        part = span_part(node, engine, cluster, build)
        return InstancePlan(id=iid, node=node.name, engine=engine,
                            processes=build(part.master_host, part.master_port),
                            kv_events=kv_events_address(engine) if rank == 0 else None,
                            bootstrap_port=self.bootstrap_port(engine, 0) if rank == 0 else None,
                            kv_transfer=self.kv_transfer(engine), part=part)

    def kv_transfer(self, engine: EngineConfig) -> KvTransfer | None:
        """PD instances: the transfer backend (SGLang's default: mooncake) as the connector."""
        if engine.role is Role.UNION:
            return None
        backend = user_value(engine, "disaggregation-transfer-backend") or "mooncake"
        return KvTransfer(connector=f"sglang-{backend}", role=engine.role.value)


BACKEND = SglangBackend()

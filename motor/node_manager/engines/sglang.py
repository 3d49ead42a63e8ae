"""SGLang (``python -m sglang.launch_server``): config -> argv / env.

SGLang runs all its DP ranks behind one HTTP server, so an instance is one process with one
endpoint (``base_port + i*dp_size``) and ``--dp-size``.

argv of instance ``i``::

    <launcher: python -m sglang.launch_server> --host H --port P --model-path <model>
        --served-model-name <name> --tp-size TP [--dp-size DP]
        [--disaggregation-mode prefill|decode]                                (PD roles)
        <engine_config flags>
        [--disaggregation-bootstrap-port 8998+i]             (prefill; user value wins)

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
                                        launcher, process_name)
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

    def kv_transfer(self, engine: EngineConfig) -> KvTransfer | None:
        """PD instances: the transfer backend (SGLang's default: mooncake) as the connector."""
        if engine.role is Role.UNION:
            return None
        backend = user_value(engine, "disaggregation-transfer-backend") or "mooncake"
        return KvTransfer(connector=f"sglang-{backend}", role=engine.role.value)


BACKEND = SglangBackend()

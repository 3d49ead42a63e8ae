"""The built-in simulator (``motor sim``): one process per DP rank, one endpoint each.

argv of instance ``i``, DP rank ``r``::

    <launcher: python -m motor sim> --host H --port base_port+i*dp_size+r
        --model <served model name> --role <role> --dp-rank r  <engine_config flags>

``engine_config`` booleans: ``true`` -> ``--flag``, ``false`` -> ``--no-flag`` (every boolean
flag of ``motor sim`` has a ``--no-`` form, e.g. ``enable_prefix_caching: false``).
``engine.launcher`` replaces ``python -m motor sim`` (tests use a tiny fake engine there).
"""
from __future__ import annotations

import sys

from motor.config.engine_flags import managed_flags
from motor.config.schema import ClusterConfig, EngineConfig, NodeConfig
from motor.node_manager.engines import (InstancePlan, ProcessSpec, base_env, endpoint,
                                        engine_flags, instance_id, launcher, process_name)

def default_launcher() -> list[str]:
    return [sys.executable, "-m", "motor", "sim"]


class SimBackend:
    def argv(self, engine: EngineConfig, index: int, dp_rank: int) -> list[str]:
        ep = endpoint(engine, index, dp_rank)
        managed = [("host", ep.host), ("port", ep.port), ("model", engine.model_name),
                   ("role", engine.role.value), ("dp-rank", dp_rank)]
        return launcher(engine, default_launcher()) + engine_flags(
            engine.engine_config, managed=managed, negate_all=True,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("sim"))

    def build(self, node: NodeConfig, engine: EngineConfig, index: int,
              cluster: ClusterConfig | None = None) -> InstancePlan:
        iid = instance_id(node.name, engine.name, index)
        procs = [ProcessSpec(name=process_name(node.name, engine.name, index, r, engine.dp_size),
                             argv=self.argv(engine, index, r), env=base_env(engine, iid, r),
                             endpoint=endpoint(engine, index, r), health_path=engine.health_path)
                 for r in range(engine.dp_size)]
        return InstancePlan(id=iid, node=node.name, engine=engine, processes=procs)


BACKEND = SimBackend()

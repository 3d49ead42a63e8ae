"""The built-in simulator (``motor sim``): one process per DP rank, one endpoint each.

argv of instance ``i``, DP rank ``r``::

    <launcher: python -m motor sim> --host H --port base_port+i*dp_size+r
        --model <served model name> --role <role> --dp-rank r  <engine_config flags>

An instance spanning nodes (``span``) runs one simulator per node playing that node's DP
ranks: the DP master (node rank 0) ``--host H --port base_port --model <name> --role <role>
--dp-rank 0 --dp-size DP --dp-size-local L --dp-master A:R`` serves the API once every rank
joined; node ``k`` ``--headless --dp-rank k*L --dp-size DP --dp-size-local L --dp-master
A:R`` joins it over TCP (``A:R``: the DP master's address and port; see docs/sim.md).

With ``tls`` the API server (not a headless part) also gets ``--ssl-certfile C --ssl-keyfile K``
and, with ``client_ca_file``, ``--ssl-ca-certs F --ssl-cert-reqs 2`` (vLLM's flags,
:func:`~motor.node_manager.engines.tls_flags`).

``engine_config`` booleans: ``true`` -> ``--flag``, ``false`` -> ``--no-flag`` (every boolean
flag of ``motor sim`` has a ``--no-`` form, e.g. ``enable_prefix_caching: false``).
``engine.launcher`` replaces ``python -m motor sim`` (tests use a tiny fake engine there).
"""
from __future__ import annotations

import sys

from motor.config.engine_flags import managed_flags
from motor.config.schema import ClusterConfig, EngineConfig, NodeConfig
from motor.node_manager.engines import (InstancePlan, ProcessSpec, base_env, endpoint,
                                        engine_flags, instance_id, join_host_port, launcher,
                                        master_endpoint, process_name, span_instance_id,
                                        span_part, tls_flags)


def default_launcher() -> list[str]:
    return [sys.executable, "-m", "motor", "sim"]


class SimBackend:
    def argv(self, engine: EngineConfig, index: int, dp_rank: int) -> list[str]:
        ep = endpoint(engine, index, dp_rank)
        managed = [("host", ep.host), ("port", ep.port), ("model", engine.model_name),
                   ("role", engine.role.value), ("dp-rank", dp_rank), *tls_flags(engine)]
        return launcher(engine, default_launcher()) + engine_flags(
            engine.engine_config, managed=managed, negate_all=True,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("sim"))

    def part_argv(self, engine: EngineConfig, node_rank: int, master_host: str,
                  master_port: int) -> list[str]:
        """argv of node ``node_rank``'s part of ``engine``'s instance spanning nodes."""
        local = engine.dp_size_local
        managed: list[tuple[str, object]] = []
        if node_rank == 0:
            managed += [("host", engine.host), ("port", engine.base_port)]
        else:
            managed.append(("headless", True))
        managed += [("model", engine.model_name), ("role", engine.role.value),
                    ("dp-rank", node_rank * local), ("dp-size", engine.dp_size),
                    ("dp-size-local", local),
                    ("dp-master", join_host_port(master_host, master_port))]
        if node_rank == 0:
            managed += tls_flags(engine)
        return launcher(engine, default_launcher()) + engine_flags(
            engine.engine_config, managed=managed, negate_all=True,
            where=f"engines[{engine.name}].engine_config", reserved=managed_flags("sim"))

    def build_part(self, node: NodeConfig, engine: EngineConfig,
                   cluster: ClusterConfig) -> InstancePlan:
        iid = span_instance_id(engine)
        rank = engine.span.nodes.index(node.name) if engine.span else 0

        def build(master_host: str, master_port: int) -> list[ProcessSpec]:
            ep = master_endpoint(engine) if rank == 0 else None
            return [ProcessSpec(name=process_name(node.name, engine.name, 0, 0, 1),
                                argv=self.part_argv(engine, rank, master_host, master_port),
                                env=base_env(engine, iid, rank * engine.dp_size_local),
                                endpoint=ep,
                                health_path=engine.health_path if rank == 0 else None)]
        part = span_part(node, engine, cluster, build)
        return InstancePlan(id=iid, node=node.name, engine=engine,
                            processes=build(part.master_host, part.master_port), part=part)

    def build(self, node: NodeConfig, engine: EngineConfig, index: int,
              cluster: ClusterConfig | None = None) -> InstancePlan:
        iid = instance_id(node.name, engine.name, index)
        procs = [ProcessSpec(name=process_name(node.name, engine.name, index, r, engine.dp_size),
                             argv=self.argv(engine, index, r), env=base_env(engine, iid, r),
                             endpoint=endpoint(engine, index, r), health_path=engine.health_path)
                 for r in range(engine.dp_size)]
        return InstancePlan(id=iid, node=node.name, engine=engine, processes=procs)


BACKEND = SimBackend()

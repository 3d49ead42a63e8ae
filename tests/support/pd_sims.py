"""A PD cluster in process for integration tests: an in-process coordinator in front of 2
prefill + 2 decode ``motor sim`` instances, with a look at what reaches each sim."""
from __future__ import annotations

from typing import Any

import orjson

from motor.config.schema import Role
from motor.sim.engine import EngineConfig
from motor.sim.options import PdOptions, SimOptions
from motor.sim.server import SimServer
from tests.support.gateway import Gateway


async def pd_cluster(mode: str, engine: EngineConfig, hook: Any = None, **cfg: Any
                     ) -> tuple[Gateway, list[SimServer], list[tuple[str, Any]]]:
    """(gateway in PD ``mode``, the 4 sims, ``seen``): ``seen`` gets ``(role, body)`` of every
    POST under ``/v1/`` as it reaches a sim; ``hook(sim)`` is called then, before it is
    served. ``cfg``: the coordinator's settings (:class:`tests.support.gateway.Gateway`)."""
    sims: list[SimServer] = []
    seen: list[tuple[str, Any]] = []
    for role in ("prefill", "prefill", "decode", "decode"):
        s = SimServer(SimOptions(port=0, role=role, model="m", engine=engine,
                                 pd=PdOptions(bootstrap_timeout_s=10.0)))
        orig = s._handle

        async def handle(req: Any, resp: Any, orig: Any = orig, role: str = role,
                         s: SimServer = s) -> None:
            if req.path.startswith("/v1/") and req.method == b"POST":
                seen.append((role, orjson.loads(req.body)))
                if hook is not None:
                    hook(s)
            await orig(req, resp)
        s._handle = handle  # type: ignore[method-assign]
        await s.start()
        sims.append(s)
    backends = [(Role.PREFILL if s.opts.role == "prefill" else Role.DECODE, "127.0.0.1", s.port)
                for s in sims]
    gw = await Gateway(backends, mode=mode, **cfg).start()
    if mode == "pd_decode_first":
        gw.coord.path.metaserver_url = f"http://127.0.0.1:{gw.port}/v1/metaserver"
    return gw, sims, seen


async def stop_pd(gw: Gateway, sims: list[SimServer]) -> None:
    await gw.stop()
    for s in sims:
        await s.stop(0.2)

"""Request paths of the PD deployment modes (see ``docs/pd.md``).

:func:`make_pd_mode` builds the handler of ``coordinator.mode``; the coordinator calls
its ``handle(route, request, response)`` for the two inference routes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from motor.config.schema import DeploymentMode

if TYPE_CHECKING:
    from motor.coordinator.routing.common import PdMode
    from motor.coordinator.server import Coordinator


def make_pd_mode(coord: "Coordinator") -> "PdMode | None":
    """The PD handler of ``coord.cfg.mode``; ``None`` for ``union``."""
    mode = coord.cfg.mode
    if mode == DeploymentMode.PD_PREFILL_FIRST:
        from motor.coordinator.routing.pd_prefill_first import PrefillFirst
        return PrefillFirst(coord)
    if mode == DeploymentMode.PD_DECODE_FIRST:
        from motor.coordinator.routing.pd_decode_first import DecodeFirst
        return DecodeFirst(coord)
    if mode == DeploymentMode.PD_BOOTSTRAP:
        from motor.coordinator.routing.pd_bootstrap import Bootstrap
        return Bootstrap(coord)
    return None


__all__ = ["make_pd_mode"]

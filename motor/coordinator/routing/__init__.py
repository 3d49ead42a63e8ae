"""The coordinator's request paths: one per deployment mode, behind one interface.

==================== ============================================ ============================
``coordinator.mode`` request path                                 file
==================== ============================================ ============================
``union``            :class:`~.union.UnionPath`                   ``routing/union.py``
``pd_prefill_first`` :class:`~.pd_prefill_first.PrefillFirst`     ``routing/pd_prefill_first.py``
``pd_decode_first``  :class:`~.pd_decode_first.DecodeFirst`       ``routing/pd_decode_first.py``
``pd_bootstrap``     :class:`~.pd_bootstrap.Bootstrap`            ``routing/pd_bootstrap.py``
==================== ============================================ ============================

The rest of the engines' API (``/v1/responses``, ``/tokenize``, rerank, score, audio...)
goes through :class:`~.passthrough.PassthroughPath` (``routing/passthrough.py``) in every
mode: the union path, by model, with response-id affinity.

Each is a :class:`~.base.RequestPath`: ``await path.handle(route, request, response)``
answers one inference request exactly once. What they all share (settings, request
parsing, forwarded headers, whole-body read, SSE relay, engine error bodies) is in
``routing/base.py``; what the PD modes share (pair selection, prefill and decode legs) in
``routing/pd_common.py``. Nothing here imports the HTTP routes (``server.py``).
"""
from __future__ import annotations

from motor.config.schema import CoordinatorConfig, DeploymentMode
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.policy import Policy
from motor.coordinator.routing.base import RequestPath, Settings
from motor.coordinator.routing.pd_bootstrap import Bootstrap
from motor.coordinator.routing.pd_decode_first import DecodeFirst
from motor.coordinator.routing.pd_prefill_first import PrefillFirst
from motor.coordinator.routing.union import UnionPath


def make_path(cfg: CoordinatorConfig, settings: Settings, table: EndpointTable,
              policy: Policy, union: UnionPath | None = None) -> RequestPath:
    """The request path of ``cfg.mode``: ``union`` itself (made when not given) in union
    mode, else a PD path holding it to fall back to."""
    if union is None:
        union = UnionPath(settings, table, policy)
    mode = cfg.mode
    if mode == DeploymentMode.PD_PREFILL_FIRST:
        return PrefillFirst(cfg, settings, table, policy, union)
    if mode == DeploymentMode.PD_DECODE_FIRST:
        return DecodeFirst(cfg, settings, table, policy, union)
    if mode == DeploymentMode.PD_BOOTSTRAP:
        return Bootstrap(cfg, settings, table, policy, union)
    return union


__all__ = ["RequestPath", "Settings", "UnionPath", "make_path"]

"""Routing policies, keyed by their config name (no aliases)."""
from __future__ import annotations

from typing import Any

from motor.coordinator.policy.base import Policy, RequestInfo
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.coordinator.policy.least_load import LeastLoad
from motor.coordinator.policy.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoad, KvAffinity)}


def make_policy(name: str, **settings: Any) -> Policy:
    """Build the policy registered under ``name`` (``settings`` go to its constructor,
    e.g. ``router=`` for ``kv_affinity``).

    Raises
    ------
    ValueError
        for an unknown name, listing the known ones.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy is expected to be one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(**settings)


__all__ = ["POLICIES", "Policy", "RequestInfo", "make_policy"]

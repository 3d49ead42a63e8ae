"""Routing policies, keyed by their config name (no aliases)."""
from __future__ import annotations

from motor.coordinator.policy.base import Policy, RequestInfo
from motor.coordinator.policy.least_load import LeastLoad
from motor.coordinator.policy.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoad)}


def make_policy(name: str) -> Policy:
    """Build the policy registered under ``name``.

    Raises
    ------
    ValueError
        for an unknown name, listing the known ones.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy is expected to be one of {sorted(POLICIES)}, got {name!r}") from None


__all__ = ["POLICIES", "Policy", "RequestInfo", "make_policy"]

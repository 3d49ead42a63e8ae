"""Instances, registration and heartbeats: the control-plane wire types.

Controller HTTP API (JSON bodies):

* ``POST /v1/nodes/register``  body :class:`NodeRegistration` -> ``{"version": int}``
* ``POST /v1/nodes/heartbeat`` body :class:`Heartbeat` -> ``{"known": bool, "version": int}``;
  ``known: false`` tells the node manager to register again (controller restarted).
* ``POST /v1/nodes/deregister`` body ``{"node": str}`` -> ``{"known": bool, "version": int}``
* ``GET /v1/instances?after=<version>&timeout=<s>`` -> :class:`InstanceTable`; long poll:
  answers at once when the table's version is greater than ``after``, else when it changes
  or after ``timeout`` seconds (then with the same version). ``timeout`` is capped by the
  controller's ``watch_timeout_s``. Without ``after`` it answers at once. A version *lower*
  than ``after`` also answers at once: the controller restarted; take its table as is.
* ``GET /v1/nodes`` -> ``{"version": int, "nodes": [{"node", "host", "last_heartbeat_age_s",
  "instances": [id...]}]}`` (diagnostics).
* ``GET /health`` (alive), ``GET /readiness`` (serving the registry), ``GET /metrics``.

Errors are OpenAI-style error bodies (400 for a malformed body, 409 for an instance id that
another node already registered).

Heartbeat semantics: ``health[id] = true`` -> ``ready``; ``false`` -> ``unhealthy`` for a
``ready`` instance while a ``starting`` one stays ``starting`` (the engine is still coming
up) unless the id is also in ``failed`` (the node manager gave up on it).
"""
from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from motor.config.schema import EngineKind, Role


class InstanceState(str, Enum):
    """Instance states (``starting -> ready <-> unhealthy -> removed``)."""
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    REMOVED = "removed"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Endpoint(_Wire):
    """One HTTP endpoint of an instance: one per DP rank where the engine runs per rank."""
    host: str
    port: int = Field(ge=1, le=65535)
    dp_rank: int = Field(0, ge=0)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class InstanceSpec(_Wire):
    """What a node manager registers for one instance."""
    id: str = Field(min_length=1)
    model: str
    role: Role
    engine: EngineKind
    endpoints: list[Endpoint] = Field(min_length=1)
    kv_events: str | None = Field(None, description="ZMQ endpoint of the engine's KV-event publisher")
    bootstrap_port: int | None = Field(None, description="SGLang PD bootstrap port (prefill instances)")
    healthy: bool = False


class Instance(InstanceSpec):
    """An instance as the controller publishes it."""
    node: str
    state: InstanceState = InstanceState.STARTING
    reason: str | None = Field(None, description="why the instance is in its state (last transition)")


class NodeRegistration(_Wire):
    node: str = Field(min_length=1)
    host: str = "127.0.0.1"
    instances: list[InstanceSpec] = Field(default_factory=list)


class Heartbeat(_Wire):
    node: str = Field(min_length=1)
    #: instance id -> healthy? (engine health as the node manager sees it)
    health: dict[str, bool] = Field(default_factory=dict)
    #: instances the node manager gave up on (restart limit reached, restart policy ``never``)
    failed: list[str] = Field(default_factory=list)
    #: optional short reason per instance ("exited with status -9, restart in 0.5 s")
    reasons: dict[str, str] = Field(default_factory=dict)


class InstanceTable(_Wire):
    version: int = 0
    instances: list[Instance] = Field(default_factory=list)

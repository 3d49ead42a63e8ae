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

Compatibility: every field added after v1 is optional with a default, and unknown fields are
ignored (``extra="ignore"``), so old and new controllers / node managers talk to each other.
Added for issue 8: ``InstanceSpec.dp_size / tp_size / kv_transfer / metaserver``,
``NodeRegistration.mgmt_port``, ``Heartbeat.engines`` (per-instance engine health incl. the
virtual-inference probe) and ``Heartbeat.npu`` (per-chip NPU sample). Added for issue 14: states ``draining`` and
``stopped``, ``Heartbeat.draining / stopped``.

Added for issue 16 (instances spanning nodes, :mod:`motor.controller.assembly`):
``NodeRegistration.parts`` (:class:`InstancePart`: this node's part of such an instance),
``Heartbeat.parts`` (:class:`PartReport` per part), and in the answers of register and
heartbeat ``"parts": [`` :class:`PartOrder` ``]`` (what each part runs now); a node manager
without parts sends none, and one that reads no ``parts`` in an answer starts none.

Added for issue 17 (HTTPS to engines): ``Endpoint.scheme`` (``http``, the default, or
``https``). An old node manager sends none (plain HTTP, as before); an old coordinator ignores
it and would speak plain HTTP to an HTTPS engine, so coordinators are upgraded before engines
get ``tls``. A coordinator routes no endpoint with a scheme it does not know (kept visible in
the table, logged), rather than guessing.

Added for issue 17 (per-instance caps): ``InstanceSpec.max_inflight`` (optional, null = no
cap of the instance's own). An old node manager sends none (the coordinator's
``admission.max_inflight_per_instance`` applies, 0 = none); an old coordinator ignores it.

Heartbeat semantics: ``health[id] = true`` -> ``ready``; ``false`` -> ``unhealthy`` for a
``ready`` instance while a ``starting`` one stays ``starting`` (the engine is still coming
up) unless the id is also in ``failed`` (the node manager gave up on it).
"""
from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from motor.config.schema import EngineKind, Role


class InstanceState(str, Enum):
    """Instance states (``starting -> ready <-> unhealthy -> removed``; an operator's
    ``drain`` -> ``draining -> stopped``, ``start`` -> ``starting``). Only ``ready`` routes."""
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    #: an operator asked for a drain: no new request, in-flight ones finish, then it stops
    DRAINING = "draining"
    #: stopped on purpose (drain finished, or an operator's stop); not an alert
    STOPPED = "stopped"
    REMOVED = "removed"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


#: bounds of the integers the controller keeps in its table: every one is a port or a rank, and
#: all must survive the coordinators' JSON parser (``orjson``: 64-bit integers at most; a larger
#: one comes back as a float, which the table's ``int`` fields then refuse, so one registration
#: with ``dp_rank: 1e30`` used to leave every coordinator unable to read any table)
MAX_PORT = 65535
MAX_RANKS = 65536  #: data- / tensor-parallel sizes (the config allows 256)


#: the schemes a coordinator speaks to an endpoint (:attr:`Endpoint.scheme`)
KNOWN_SCHEMES = frozenset({"http", "https"})


class Endpoint(_Wire):
    """One HTTP endpoint of an instance: one per DP rank where the engine runs per rank."""
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=MAX_PORT)
    dp_rank: int = Field(0, ge=0, lt=MAX_RANKS)
    #: a string, not an enum: a scheme a later version adds must not make a whole table
    #: unreadable; one outside :data:`KNOWN_SCHEMES` is not routed
    scheme: str = Field("http", min_length=1, max_length=16, pattern=r"^[a-z][a-z0-9+.-]*$",
                        description="what the engine speaks on the port: http, or https "
                                    "(config engines[].tls)")

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def https(self) -> bool:
        return self.scheme == "https"


class KvTransfer(_Wire):
    """The engine's KV connector (from its ``kv_transfer_config``), for PD routing."""
    connector: str = Field(description="e.g. NixlConnector, MooncakeConnectorV1, MooncakeLayerwiseConnector")
    role: str | None = Field(None, description="kv_producer / kv_consumer / kv_both")
    engine_id: str | None = None
    kv_port: int | None = Field(None, ge=1, le=MAX_PORT,
                                description="the connector's side-channel port, when set")


class InstanceSpec(_Wire):
    """What a node manager registers for one instance."""
    id: str = Field(min_length=1)
    model: str
    role: Role
    engine: EngineKind
    endpoints: list[Endpoint] = Field(min_length=1)
    kv_events: str | None = Field(None, description="ZMQ endpoint of the engine's KV-event publisher")
    bootstrap_port: int | None = Field(None, ge=1, le=MAX_PORT,
                                       description="SGLang PD bootstrap port (prefill instances)")
    healthy: bool = False
    dp_size: int = Field(1, ge=1, le=MAX_RANKS, description="data-parallel ranks of the instance")
    tp_size: int = Field(1, ge=1, le=MAX_RANKS, description="tensor-parallel size of each rank")
    kv_transfer: KvTransfer | None = Field(None, description="KV connector of a PD instance")
    max_inflight: int | None = Field(
        None, ge=1, description="requests a coordinator sends each endpoint of the instance at "
                                "once at most (the engine's own limit: config "
                                "engines[].max_inflight, else vLLM / sim max_num_seqs, SGLang "
                                "max_running_requests); null = no cap of its own")
    metaserver: bool = Field(
        False, description="the engine's KV connector speaks the decode-first metaserver protocol "
                           "(vLLM-Ascend MooncakeLayerwiseConnector): a decode request carries "
                           "kv_transfer_params.metaserver = a coordinator URL that D calls back")

    @model_validator(mode="after")
    def _unique_dp_ranks(self) -> InstanceSpec:
        # a coordinator keys an endpoint by (instance, DP rank): a second one would replace the
        # first without a word
        seen: set[int] = set()
        for i, e in enumerate(self.endpoints):
            if e.dp_rank in seen:
                raise ValueError(f"endpoints[{i}].dp_rank: expected a DP rank not used by an "
                                 f"earlier endpoint of instance {self.id!r}, got {e.dp_rank} again")
            seen.add(e.dp_rank)
        return self


class Instance(InstanceSpec):
    """An instance as the controller publishes it."""
    node: str
    state: InstanceState = InstanceState.STARTING
    reason: str | None = Field(None, description="why the instance is in its state (last transition)")


class InstancePart(_Wire):
    """One node's part of an instance spanning nodes (config ``engines[].span``): its DP ranks,
    and for the DP master the instance as it enters the table."""
    instance: str = Field(min_length=1, description="instance id <master node>/<engine>/0")
    nodes: list[str] = Field(min_length=2, description="the instance's nodes, DP master first")
    node_rank: int = Field(ge=0, lt=MAX_RANKS, description="this node's position in nodes")
    dp_start_rank: int = Field(ge=0, lt=MAX_RANKS, description="first DP rank of this part")
    dp_size_local: int = Field(ge=1, le=MAX_RANKS, description="DP ranks of this part")
    spec: InstanceSpec | None = Field(
        None, description="the DP master's part: the instance (model, role, API endpoints, "
                          "dp_size); null on a headless part")
    master_host: str | None = Field(None, min_length=1,
                                    description="DP master: the address the others connect to")
    master_port: int | None = Field(None, ge=1, le=MAX_PORT,
                                    description="DP master: its RPC port")
    epoch: int = Field(0, ge=0, description="the epoch this part's processes run at (0: none)")
    restart_backoff_initial_s: float = Field(0.5, gt=0, description="first whole-instance "
                                                                    "restart delay (seconds)")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="its cap (seconds)")
    restart_policy: str = Field("always", description="always / on-failure / never")
    max_restarts: int = Field(10, ge=0, description="whole restarts within window_s at most")
    restart_window_s: float = Field(300.0, gt=0)

    @property
    def master(self) -> bool:
        return self.node_rank == 0


class PartReport(_Wire):
    """A part's state in a heartbeat."""
    epoch: int = Field(0, ge=0, description="the epoch its processes run at; 0 = none runs")
    healthy: bool = Field(False, description="every process runs (the master's API healthy)")
    failed: bool = Field(False, description="a process of this epoch ended by itself")
    reason: str | None = None


class PartOrder(_Wire):
    """The controller's word on one part (in the answers of register and heartbeat)."""
    instance: str
    epoch: int = Field(0, ge=0, description="the epoch to run at")
    run: bool = Field(False, description="run the part's processes at epoch (else stop them)")
    master_host: str | None = None
    master_port: int | None = Field(None, ge=1, le=MAX_PORT)


class NodeRegistration(_Wire):
    node: str = Field(min_length=1)
    host: str = "127.0.0.1"
    instances: list[InstanceSpec] = Field(default_factory=list)
    mgmt_port: int | None = Field(None, ge=1, le=MAX_PORT,
                                  description="node manager's management API port, if on")
    parts: list[InstancePart] = Field(
        default_factory=list, description="this node's parts of instances spanning nodes")


class VirtualInferenceStatus(_Wire):
    """The virtual-inference probe of an instance (DP rank 0)."""
    #: ``waiting`` (for the first healthy /health), ``warmup``, ``ok``, ``failing`` (some failed
    #: rounds in a row), ``unhealthy`` (``failures`` in a row: the instance is reported unhealthy)
    state: str = "waiting"
    failures: int = Field(0, description="failed rounds in a row")
    rounds: int = 0
    busy_rounds: int = Field(0, description="failed requests not counted: the NPU was busy")
    last_error: str | None = None
    last_aicore_pct: float | None = None


class EngineHealth(_Wire):
    """Engine health of one instance as the node manager sees it."""
    state: str = Field(description="worst process state: starting / ready / unhealthy / backoff / failed / stopped")
    http_healthy: bool = Field(False, description="every process answers its health path")
    restarts: int = 0
    virtual_inference: VirtualInferenceStatus | None = None


class NpuChip(_Wire):
    """One NPU chip as ``npu-smi info`` last showed it (None = not shown / NA)."""
    npu: int
    chip: int
    device: int
    name: str = ""
    health: str = ""
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None


class Heartbeat(_Wire):
    node: str = Field(min_length=1)
    #: instance id -> healthy? (engine health as the node manager sees it)
    health: dict[str, bool] = Field(default_factory=dict)
    #: instances the node manager gave up on (restart limit reached, restart policy ``never``)
    failed: list[str] = Field(default_factory=list)
    #: optional short reason per instance ("exited with status -9, restart in 0.5 s")
    reasons: dict[str, str] = Field(default_factory=dict)
    #: instance id -> engine health details (optional; the controller keys on ``health``)
    engines: dict[str, EngineHealth] = Field(default_factory=dict)
    #: the node's NPU chips (empty without npu-smi)
    npu: list[NpuChip] = Field(default_factory=list)
    #: instances being drained on an operator's request (no new requests; they stop once idle)
    draining: list[str] = Field(default_factory=list)
    #: instances stopped on an operator's request (drain finished, or stop): not restarted
    stopped: list[str] = Field(default_factory=list)
    #: instance id -> this node's part of that instance spanning nodes
    parts: dict[str, PartReport] = Field(default_factory=dict)


class InstanceTable(_Wire):
    version: int = 0
    instances: list[Instance] = Field(default_factory=list)

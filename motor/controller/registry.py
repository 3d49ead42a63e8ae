"""The controller's registry: nodes, instances, their states, a versioned table, long-poll watch.

States and transitions (every transition bumps the table version and is logged at info
with the instance id and the reason)::

    register (healthy=false) -> starting         register (healthy=true) -> ready
    starting  --heartbeat health=true-->  ready
    starting  --heartbeat health=false--> starting      (engine still coming up)
    ready     --heartbeat health=false--> unhealthy
    unhealthy --heartbeat health=true-->  ready
    any       --heartbeat failed=[id]-->  unhealthy     (node manager gave up on it)
    any       --no heartbeat for heartbeat_timeout_s--> unhealthy
    unhealthy --node still silent, unhealthy for remove_after_s--> removed (dropped)
    any       --deregister / left out of a new registration--> removed (dropped)

Operator actions (:meth:`Registry.act`, the lifecycle API) set the state at once and hold it
until the node manager's heartbeats acknowledge the action::

    drain / restart(drain) -> draining   (until the id is in the heartbeat's draining / stopped)
    stop / restart(no drain) -> stopped  (until the id is in the heartbeat's stopped)
    start -> starting                    (until the id is in neither list)
    heartbeat stopped=[id] -> stopped    heartbeat draining=[id] -> draining
    after a start / restart is acknowledged, "not healthy" means starting, not unhealthy

``removed`` instances leave the table; the state exists for logs and metrics only.

Instances spanning nodes (registered in parts, ``NodeRegistration.parts``) are assembled by
:class:`motor.controller.assembly.Assembler` (``self.assembly``): it decides their entries
(in the table once every part registered; ready only when every part is healthy) and the
orders returned to each node manager (:meth:`Registry.orders`).

With etcd (:mod:`motor.controller.ha`), every change marks the nodes it touched dirty
(:meth:`Registry.take_dirty`) and the leader writes their records (:meth:`Registry.node_record`)
in one fenced transaction; a new leader rebuilds the registry from them
(:meth:`Registry.restore`).

Without etcd, a restarted controller starts empty and learns the nodes again as their node managers
heartbeat (``known: false`` -> they register again). So for its first ``warmup_s`` (default
``heartbeat_timeout_s``: by then every live node manager has heartbeated) a long poll from a
follower of another incarnation (``after`` is a version this registry never published:
below its initial version or above its current one; not absent or 0) is held rather than answered with a table that lacks nodes not heard from yet: the
coordinator keeps routing on its last table meanwhile instead of dropping every instance.

The registry is plain synchronous code driven by an injectable clock; :meth:`Registry.check`
applies the timeouts (the server calls it periodically, tests call it with a fake clock).
Every mutation goes through :meth:`Registry._commit`, the one place where a persistent
backend (etcd: one transaction per change, leader lease) would hook in later.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from motor.controller.assembly import Assembler, Update
from motor.protocol.instances import (Heartbeat, Instance, InstancePart, InstanceState,
                                      InstanceTable, NodeRegistration, PartOrder)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class RegistryConflict(ValueError):
    """A registration names an instance id that another node owns."""


class UnknownInstance(KeyError):
    """An operator action names an instance the registry does not hold."""


#: operator actions (:meth:`Registry.act`)
ACTIONS = ("drain", "stop", "start", "restart")


@dataclass
class _Node:
    name: str
    host: str
    last_heartbeat: float
    instance_ids: list[str] = field(default_factory=list)
    mgmt_port: int | None = None


@dataclass
class _Entry:
    inst: Instance
    since: float  #: clock time of the last state change
    #: an operator action not yet acknowledged by a heartbeat (``drain``, ``stop``, ``start``,
    #: ``restart``), or ``started`` / ``restarted``: acknowledged, not healthy yet
    admin: str | None = None


@dataclass
class Transition:
    """One state change (``new`` is ``removed`` when the instance left the table)."""
    instance: str
    old: InstanceState | None
    new: InstanceState
    reason: str


class Registry:
    """In-memory registry of nodes and instances.

    Parameters
    ----------
    heartbeat_timeout_s : float
        A node silent this long -> its instances become ``unhealthy``.
    remove_after_s : float
        An instance ``unhealthy`` this long while its node stays silent -> removed.
    clock : callable
        Monotonic seconds (``time.monotonic`` by default; tests inject a fake).
    initial_version : int
        First version of the table. The server starts from wall-clock milliseconds so a
        restarted controller publishes versions above the ones it published before.
    warmup_s : float or None
        How long after start a long poll from a follower of another incarnation is held
        (see the module docstring); ``None`` = ``heartbeat_timeout_s``, 0 = not held.
    """

    def __init__(self, heartbeat_timeout_s: float = 5.0, remove_after_s: float = 60.0,
                 clock: Clock = time.monotonic, initial_version: int = 0,
                 warmup_s: float | None = None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.remove_after_s = remove_after_s
        self.clock = clock
        self.warmup_s = heartbeat_timeout_s if warmup_s is None else warmup_s
        self.started = clock()
        self.version = self.initial_version = initial_version
        self._nodes: dict[str, _Node] = {}
        self._entries: dict[str, _Entry] = {}
        self._event: asyncio.Event | None = None
        self._table_cache: InstanceTable | None = None
        #: nodes whose record changed since the last :meth:`take_dirty`
        self._dirty: set[str] = set()
        #: called with each batch of transitions after a commit (metrics, persistence)
        self.listeners: list[Callable[[list[Transition]], None]] = []
        #: instances spanning nodes (:mod:`motor.controller.assembly`)
        self.assembly = Assembler()

    # ------------------------------------------------------------------ queries
    def table(self) -> InstanceTable:
        """The current table (instances sorted by id); cached until the next change."""
        if self._table_cache is None or self._table_cache.version != self.version:
            insts = [e.inst.model_copy() for _, e in sorted(self._entries.items())]
            self._table_cache = InstanceTable(version=self.version, instances=insts)
        return self._table_cache

    def instance(self, instance_id: str) -> Instance | None:
        e = self._entries.get(instance_id)
        return e.inst if e is not None else None

    def state(self, instance_id: str) -> InstanceState:
        e = self._entries.get(instance_id)
        return e.inst.state if e is not None else InstanceState.REMOVED

    def counts(self) -> dict[InstanceState, int]:
        out: dict[InstanceState, int] = {
            s: 0 for s in InstanceState if s is not InstanceState.REMOVED}
        for e in self._entries.values():
            out[e.inst.state] += 1
        return out

    def knows(self, node: str) -> bool:
        return node in self._nodes

    def nodes(self) -> list[dict[str, object]]:
        now = self.clock()
        return [{"node": n.name, "host": n.host, "mgmt_port": n.mgmt_port,
                 "last_heartbeat_age_s": round(now - n.last_heartbeat, 3),
                 "instances": list(n.instance_ids)}
                for _, n in sorted(self._nodes.items())]

    def node_of(self, instance_id: str) -> tuple[str, str, int | None]:
        """``(node, host, mgmt_port)`` of the node holding ``instance_id``.

        Raises
        ------
        UnknownInstance
            no such instance.
        """
        e = self._entries.get(instance_id)
        if e is None or e.inst.node not in self._nodes:
            raise UnknownInstance(instance_id)
        n = self._nodes[e.inst.node]
        return n.name, n.host, n.mgmt_port

    # ------------------------------------------------------------ persistence
    def node_record(self, name: str) -> dict[str, object] | None:
        """The JSON-ready record of node ``name`` (None once it is gone): host, management
        port, and its instances with state, reason and pending operator action."""
        n = self._nodes.get(name)
        if n is None:
            return None
        insts = []
        for iid in n.instance_ids:
            e = self._entries.get(iid)
            if e is not None:
                insts.append({"instance": e.inst.model_dump(mode="json"), "admin": e.admin})
        rec: dict[str, object] = {"node": n.name, "host": n.host, "mgmt_port": n.mgmt_port,
                                  "instances": insts}
        parts = self.assembly.records(name)
        if parts:
            rec["parts"] = parts
        return rec

    def spanning(self, instance_id: str) -> bool:
        """True for an instance that spans nodes (its lifecycle is the controller's own)."""
        return instance_id in self.assembly.ids()

    def orders(self, node: str) -> list[PartOrder]:
        """What ``node``'s parts of instances spanning nodes run now (the answers' ``parts``)."""
        return self.assembly.orders(node)

    def _apply(self, updates: list[Update], now: float) -> list[Transition]:
        """The assembler's updates of spanning instances, applied to the table."""
        out: list[Transition] = []
        for u in updates:
            self._dirty.update(n for n in u.nodes if n in self._nodes)
            e = self._entries.get(u.instance)
            if u.inst is None:
                if e is not None:
                    out.append(self._drop(u.instance, u.reason))
            elif e is None:
                self._entries[u.instance] = _Entry(u.inst, now)
                out.append(Transition(u.instance, None, u.inst.state, u.reason))
            else:
                old = e.inst.state
                e.inst, e.since = u.inst, now
                out.append(Transition(u.instance, old, u.inst.state, u.reason))
        return out

    def take_dirty(self) -> set[str]:
        """The nodes changed since the last call (and forget them)."""
        out, self._dirty = self._dirty, set()
        return out

    def mark_dirty(self, names: set[str]) -> None:
        """Put back nodes whose write failed (the next write carries them)."""
        self._dirty |= names

    def restore(self, records: list[dict[str, object]], version: int) -> None:
        """Replace the registry with the node records a previous leader wrote; every node
        counts as just heard from (its heartbeats reach this controller within one interval).
        The version continues above ``version``.

        Raises
        ------
        ValueError
            a record that does not validate (the message names the node).
        """
        now = self.clock()
        nodes: dict[str, _Node] = {}
        entries: dict[str, _Entry] = {}
        for rec in records:
            name = str(rec.get("node"))
            raw_insts = rec.get("instances", [])
            try:
                if not isinstance(raw_insts, list):
                    raise TypeError(f"instances: expected a list, got {type(raw_insts).__name__}")
                insts = [(Instance.model_validate(i["instance"]), i.get("admin"))
                         for i in raw_insts]
            except Exception as e:
                raise ValueError(f"node record {name!r} in etcd does not validate: {e}") from e
            mp = rec.get("mgmt_port")
            nodes[name] = _Node(name, str(rec.get("host")), now, [i.id for i, _ in insts],
                                mp if isinstance(mp, int) else None)
            for inst, admin in insts:
                entries[inst.id] = _Entry(inst, now, admin if admin in _ADMIN_STATES else None)
        self._nodes, self._entries = nodes, entries
        self.assembly = Assembler()
        for rec in records:
            raw_parts = rec.get("parts") or []
            try:
                if not isinstance(raw_parts, list):
                    raise TypeError(f"expected a list, got {type(raw_parts).__name__}")
                parts = [InstancePart.model_validate(p) for p in raw_parts]
            except Exception as e:
                raise ValueError(f"node record {rec.get('node')!r} in etcd: parts do not "
                                 f"validate: {e}") from e
            if parts:
                self._apply(self.assembly.register(str(rec.get("node")), parts, now), now)
        self.version = self.initial_version = max(self.version, version + 1)
        self._table_cache = None
        self._dirty.clear()
        logger.info("registry restored from etcd: %d node(s), %d instance(s), version %d",
                    len(nodes), len(entries), self.version)
        if self._event is not None:
            self._event.set()
            self._event = None

    # ---------------------------------------------------------------- mutations
    def register(self, reg: NodeRegistration) -> int:
        """Replace ``reg.node``'s instances; returns the new version.

        Raises
        ------
        RegistryConflict
            an instance id is already registered by another node (nothing changes).
        """
        now = self.clock()
        ids = [s.id for s in reg.instances]
        if len(set(ids)) != len(ids):
            raise RegistryConflict(f"node {reg.node!r} registers the same instance id twice")
        spanning = self.assembly.ids()
        for s in reg.instances:
            e = self._entries.get(s.id)
            if s.id in spanning:
                raise RegistryConflict(f"instance {s.id!r} spans nodes (registered in parts), "
                                       f"not an instance of node {reg.node!r} alone")
            if e is not None and e.inst.node != reg.node:
                raise RegistryConflict(f"instance {s.id!r} is already registered by node "
                                       f"{e.inst.node!r}, not {reg.node!r}")
        taken = {iid for iid in self._entries if iid not in spanning} | set(ids)
        try:
            self.assembly.check_parts(reg.node, reg.parts, taken)
        except ValueError as e:
            raise RegistryConflict(str(e)) from None
        changes: list[Transition] = []
        old = self._nodes.get(reg.node)
        if old is not None:
            for iid in old.instance_ids:
                if iid not in ids:
                    changes.append(self._drop(iid, "left out of the node's new registration"))
        for s in reg.instances:
            state = InstanceState.READY if s.healthy else InstanceState.STARTING
            reason = "registered " + ("healthy" if s.healthy else "(engine starting)")
            prev = self._entries.get(s.id)
            self._entries[s.id] = _Entry(
                Instance(**s.model_dump(), node=reg.node, state=state, reason=reason), now)
            changes.append(Transition(s.id, prev.inst.state if prev else None, state, reason))
        self._nodes[reg.node] = _Node(reg.node, reg.host, now, ids, reg.mgmt_port)
        changes += self._apply(self.assembly.register(reg.node, reg.parts, now), now)
        self._dirty.add(reg.node)
        logger.info("node %s registered (%s) with %d instance(s)", reg.node, reg.host, len(ids))
        return self._commit(changes, force=True)

    def heartbeat(self, hb: Heartbeat) -> tuple[bool, int]:
        """Record a heartbeat; returns ``(known, version)``; unknown node -> ``known=False``."""
        node = self._nodes.get(hb.node)
        if node is None:
            return False, self.version
        now = self.clock()
        node.last_heartbeat = now
        changes: list[Transition] = []
        failed, draining, stopped = set(hb.failed), set(hb.draining), set(hb.stopped)
        for iid in node.instance_ids:
            e = self._entries.get(iid)
            if e is None:
                continue
            healthy = hb.health.get(iid)
            detail = hb.reasons.get(iid)
            cur = e.inst.state
            admin = e.admin
            held = iid in draining or iid in stopped
            if admin in ACTIONS:
                acked = {"drain": held, "stop": iid in stopped, "start": not held,
                         "restart": held or healthy is False}[admin]
                if not acked:
                    continue  # the heartbeat predates the action: the operator's state holds
                e.admin = _ACKED[admin]
                self._dirty.add(node.name)
            elif admin == "restarting" and not held:
                e.admin = "started"   # back up: not healthy = still starting
                self._dirty.add(node.name)
            if iid in stopped:
                new, why = InstanceState.STOPPED, "stopped by an operator"
                detail = None
            elif iid in draining:
                new, why = InstanceState.DRAINING, "draining on an operator's request"
                detail = None
            elif iid in failed:
                new, why = InstanceState.UNHEALTHY, "node manager gave up on the engine"
            elif healthy is None:
                continue  # no word on this instance
            elif healthy:
                new, why = InstanceState.READY, "engine healthy"
                if e.admin is not None:
                    e.admin = None
                    self._dirty.add(node.name)
            elif cur in (InstanceState.STARTING, InstanceState.STOPPED) or e.admin == "started":
                new, why = InstanceState.STARTING, "engine starting"
            else:
                new, why = InstanceState.UNHEALTHY, "engine unhealthy"
            if detail:
                why = f"{why}: {detail}"
            if new is not cur:
                changes.append(self._set(e, new, why, now))
                self._dirty.add(node.name)
        if hb.parts or self.assembly.orders(hb.node):
            changes += self._apply(self.assembly.heartbeat(hb.node, hb.parts, now), now)
        return True, self._commit(changes)

    def act(self, instance_id: str, action: str, drain: bool = True) -> int:
        """Record an operator's ``action`` on ``instance_id`` (the lifecycle API; the server
        then tells the node manager) and set the state it implies at once; returns the version.

        Raises
        ------
        UnknownInstance
            no such instance.
        ValueError
            ``action`` is not one of :data:`ACTIONS`.
        """
        if action not in ACTIONS:
            raise ValueError(f"action: expected one of {', '.join(ACTIONS)}, got {action!r}")
        e = self._entries.get(instance_id)
        if e is None:
            raise UnknownInstance(instance_id)
        if self.spanning(instance_id):   # the assembler orders every part itself
            now = self.clock()
            try:
                updates = self.assembly.act(instance_id, action, now)
            except KeyError:
                raise UnknownInstance(instance_id) from None
            return self._commit(self._apply(updates, now), force=True)
        if action == "restart" and not drain:
            state = InstanceState.STOPPED
        else:
            state = {"drain": InstanceState.DRAINING, "restart": InstanceState.DRAINING,
                     "stop": InstanceState.STOPPED, "start": InstanceState.STARTING}[action]
        e.admin = action
        self._dirty.add(e.inst.node)
        # the words the heartbeats' mapping uses for the same states
        why = {"drain": "draining on an operator's request", "stop": "stopped by an operator"
               }.get(action, f"operator: {action}" + ("" if drain or action != "restart"
                                                      else " (no drain)"))
        changes = [self._set(e, state, why, self.clock())] if state is not e.inst.state else []
        return self._commit(changes, force=True)

    def deregister(self, node: str) -> tuple[bool, int]:
        """Remove ``node`` and its instances; returns ``(known, version)``."""
        n = self._nodes.pop(node, None)
        if n is None:
            return False, self.version
        self._dirty.add(node)
        changes = [self._drop(iid, "node deregistered") for iid in n.instance_ids
                   if iid in self._entries]
        changes += self._apply(self.assembly.forget(node, "node deregistered", self.clock()),
                               self.clock())
        logger.info("node %s deregistered", node)
        return True, self._commit(changes, force=True)

    def check(self, now: float | None = None) -> int:
        """Apply heartbeat timeouts at ``now`` (default: the clock); returns the version."""
        if now is None:
            now = self.clock()
        changes: list[Transition] = []
        for name in list(self._nodes):
            node = self._nodes[name]
            silent = now - node.last_heartbeat
            if silent < self.heartbeat_timeout_s:
                continue
            changes += self._apply(self.assembly.silent(name, silent, now), now)
            for iid in list(node.instance_ids):
                e = self._entries.get(iid)
                if e is None:
                    continue
                if e.inst.state is not InstanceState.UNHEALTHY:
                    self._dirty.add(name)
                    changes.append(self._set(e, InstanceState.UNHEALTHY, _NO_HEARTBEAT, now,
                                             detail=f"{silent:.1f} s"))
                elif now - e.since >= self.remove_after_s and \
                        now - node.last_heartbeat >= self.remove_after_s:
                    changes.append(self._drop(
                        iid, f"unhealthy and no heartbeat for {self.remove_after_s:g} s"))
                    node.instance_ids.remove(iid)
                    self._dirty.add(name)
            if not node.instance_ids and silent >= self.heartbeat_timeout_s + self.remove_after_s:
                del self._nodes[name]
                self._dirty.add(name)
                changes += self._apply(self.assembly.forget(
                    name, f"no heartbeat for {silent:.1f} s", now), now)
                logger.info("node %s forgotten: no heartbeat for %.1f s", name, silent)
        changes += self._apply(self.assembly.check(now), now)
        return self._commit(changes)

    # ---------------------------------------------------------------- watching
    def wake(self) -> None:
        """Wake every long poll waiting now (they answer with the table as it is)."""
        if self._event is not None:
            self._event.set()
            self._event = None

    def warmup_left(self) -> float:
        """Seconds of the warm-up left (0 once over)."""
        return max(0.0, self.started + self.warmup_s - self.clock())

    async def wait(self, after: int | None, timeout_s: float) -> InstanceTable:
        """Long poll: the table once its version differs from ``after``, or at ``timeout_s``.

        During the warm-up a follower of another incarnation (``after`` a version this
        registry never published) waits for the end of the warm-up (at most ``timeout_s``)."""
        if after and not self.initial_version <= after <= self.version and timeout_s > 0:
            hold = min(self.warmup_left(), timeout_s)
            if hold > 0:
                await asyncio.sleep(hold)
            return self.table()
        if after is None or after != self.version or timeout_s <= 0:
            return self.table()
        if self._event is None:
            self._event = asyncio.Event()
        ev = self._event
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.table()

    # ---------------------------------------------------------------- internals
    def _set(self, e: _Entry, new: InstanceState, reason: str, now: float,
             detail: str | None = None) -> Transition:
        old = e.inst.state
        text = f"{reason} ({detail})" if detail else reason
        # ``healthy`` (the registration's word) follows the state, so the table never says
        # ``ready`` and ``healthy: false`` at once
        e.inst = e.inst.model_copy(update={"state": new, "reason": text,
                                           "healthy": new is InstanceState.READY})
        e.since = now
        return Transition(e.inst.id, old, new, text)

    def _drop(self, iid: str, reason: str) -> Transition:
        e = self._entries.pop(iid)
        return Transition(iid, e.inst.state, InstanceState.REMOVED, reason)

    def _commit(self, changes: Iterable[Transition], force: bool = False) -> int:
        """Apply a batch: bump the version, log, wake watchers, tell listeners.

        A persistent backend (etcd) writes the batch here in one transaction.
        """
        changes = list(changes)
        if not changes and not force:
            return self.version
        self.version += 1
        for t in changes:
            logger.info("instance %s: %s -> %s (%s) [version %d]", t.instance,
                        t.old.value if t.old else "new", t.new.value, t.reason, self.version)
        if self._event is not None:
            self._event.set()
            self._event = None
        for fn in self.listeners:
            fn(changes)
        return self.version


_NO_HEARTBEAT = "no heartbeat from the node"
#: what a pending action becomes once a heartbeat acknowledges it
_ACKED: dict[str, str | None] = {"drain": None, "stop": None, "start": "started",
                                 "restart": "restarting"}
_ADMIN_STATES = (*ACTIONS, "started", "restarting")

"""Assembly of instances that span nodes: parts in, one instance in the table, one epoch out.

An instance whose DP ranks run on several nodes (config ``engines[].span``) is registered in
parts, one per node (:class:`~motor.protocol.instances.InstancePart`: the node's DP ranks; the
DP master's part carries the instance's spec and the master's address). The
:class:`Assembler` keeps them per instance id and decides, for all the parts together:

* **assembled**: every node of the part's ``nodes`` has registered its part and the master's
  address is known. Only then is the instance in the table and do the node managers start
  their ranks: the answers of register and heartbeat carry a
  :class:`~motor.protocol.instances.PartOrder` per part, ``{epoch, run: true, master_host,
  master_port}``. A node manager runs its part's processes at the ordered epoch and restarts
  them when the epoch changes.
* **all-or-nothing readiness**: the instance is ``ready`` only while every part reports
  ``healthy`` at the current epoch (the master's API healthy, every headless part's processes
  running) and no node of it is silent; else ``starting`` (after a start) or ``unhealthy``.
  Coordinators route to ``ready`` instances only.
* **whole-instance restart**: a part that reports ``failed`` at the current epoch (one of its
  processes ended), or that ran at the current epoch and comes back without it (its node
  manager restarted), stops the whole instance (``run: false`` to every part, state
  ``unhealthy``) and, after a backoff of ``min(backoff_initial_s * 2**(n-1), backoff_max_s)``
  (the n-th restart in a row; the DP master's ``restart`` config), orders every part to run
  at epoch + 1. A restart policy ``never``, or ``max_restarts`` restarts within
  ``window_s``, leaves it ``unhealthy`` and stopped. The count starts over once the instance
  was ``ready``.

Operator actions (:meth:`Assembler.act`, the lifecycle API; the controller does them itself,
as no single node manager holds the instance): ``drain`` marks it ``draining`` (coordinators
stop routing to it; the server waits for the DP master's engine to be idle, then stops it),
``stop`` orders every part to stop (``stopped``, no restart), ``start`` and ``restart`` order
every part to run at epoch + 1 (node managers restart their processes on a new epoch). An
operator's stop is not persisted: a new leader starts the instance again.

A controller that starts without state (no etcd) adopts the epoch the parts report when they
all run at one epoch (their engines keep running); else it starts them at the highest epoch
reported + 1. With etcd, the parts are in the node records (:meth:`Assembler.records`), so a
new leader knows them at once.

The assembler is plain synchronous code with the time passed in (``now``, the registry's
clock); it returns :class:`Update` records that :class:`~motor.controller.registry.Registry`
applies to its table (its only hooks into the registry).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from motor.procs import backoff_delay
from motor.protocol.instances import (Instance, InstancePart, InstanceState, PartOrder,
                                      PartReport)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """What the table should hold for a spanning instance: ``inst`` (with its state and
    reason), or None: not in the table."""
    instance: str
    inst: Instance | None
    reason: str
    nodes: tuple[str, ...] = ()   #: the nodes whose records the change touches


@dataclass
class _Assembly:
    id: str
    nodes: list[str]
    parts: dict[str, InstancePart] = field(default_factory=dict)
    reports: dict[str, PartReport] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    #: nodes that reported running at ``epoch`` since it was ordered
    started: set[str] = field(default_factory=set)
    epoch: int = 0
    run: bool = False
    restart_at: float | None = None
    consecutive: int = 0
    restart_times: collections.deque[float] = field(default_factory=collections.deque)
    #: what the table holds (None: not in it)
    state: InstanceState | None = None
    reason: str = ""
    #: an operator's hold: ``drain`` (draining, running) or ``stop`` (stopped); None: none
    admin: str | None = None

    @property
    def complete(self) -> bool:
        m = self.parts.get(self.nodes[0])
        return all(n in self.parts for n in self.nodes) and m is not None and \
            m.spec is not None and m.master_host is not None and m.master_port is not None

    @property
    def master(self) -> InstancePart:
        return self.parts[self.nodes[0]]


class Assembler:
    """The instances spanning nodes of one registry (see the module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Assembly] = {}

    # ---------------------------------------------------------------- queries
    def ids(self) -> set[str]:
        return set(self._by_id)

    def epoch(self, instance_id: str) -> int:
        a = self._by_id.get(instance_id)
        return a.epoch if a is not None else 0

    def orders(self, node: str) -> list[PartOrder]:
        """The orders for ``node``'s parts (the ``parts`` of the controller's answers)."""
        out = []
        for a in self._by_id.values():
            if node not in a.parts:
                continue
            m = a.parts.get(a.nodes[0])
            out.append(PartOrder(instance=a.id, epoch=a.epoch, run=a.run and a.complete,
                                 master_host=m.master_host if m is not None else None,
                                 master_port=m.master_port if m is not None else None))
        return out

    def records(self, node: str) -> list[dict[str, object]]:
        """``node``'s parts for its etcd record (each with the instance's current epoch)."""
        return [a.parts[node].model_copy(update={"epoch": a.epoch}).model_dump(mode="json")
                for a in self._by_id.values() if node in a.parts]

    # -------------------------------------------------------------- mutations
    def check_parts(self, node: str, parts: list[InstancePart], taken: set[str]) -> None:
        """Refuse ``node``'s parts before anything changes.

        Raises
        ------
        ValueError
            a part's id is a single-node instance's (``taken``), or it does not fit the parts
            of that instance registered before (another node list, a rank that is not the
            node's position); the message names the instance, the field, expected and got.
        """
        for p in parts:
            if p.instance in taken:
                raise ValueError(f"instance {p.instance!r}: expected one id per instance, got "
                                 f"a part of node {node!r} with the id of an instance on one "
                                 f"node")
            if node not in p.nodes or p.nodes.index(node) != p.node_rank:
                raise ValueError(f"instance {p.instance!r}: node_rank of node {node!r} is "
                                 f"expected to be its position in nodes {p.nodes}, got "
                                 f"{p.node_rank}")
            a = self._by_id.get(p.instance)
            if a is not None and a.nodes != p.nodes:
                raise ValueError(f"instance {p.instance!r}: nodes of node {node!r}'s part are "
                                 f"expected to be {a.nodes} (as the parts registered before), "
                                 f"got {p.nodes}")

    def register(self, node: str, parts: list[InstancePart], now: float) -> list[Update]:
        """``node`` registered (again) with ``parts`` (checked by :meth:`check_parts`)."""
        out: list[Update] = []
        ids = {p.instance for p in parts}
        for a in list(self._by_id.values()):
            if node in a.parts and a.id not in ids:
                out += self._drop_part(a, node, "left out of the node's new registration", now)
        for p in parts:
            found = self._by_id.get(p.instance)
            if found is None:
                found = self._by_id[p.instance] = _Assembly(p.instance, list(p.nodes))
            a = found
            a.parts[node] = p
            a.reports[node] = PartReport(epoch=p.epoch)
            a.silent.discard(node)
            out += self._evaluate(a, now, registered=node)
        return out

    def heartbeat(self, node: str, reports: dict[str, PartReport], now: float) -> list[Update]:
        out: list[Update] = []
        for a in self._by_id.values():
            if node not in a.parts:
                continue
            a.silent.discard(node)
            rep = reports.get(a.id)
            if rep is not None:
                a.reports[node] = rep
            out += self._evaluate(a, now)
        return out

    def silent(self, node: str, silent_s: float, now: float) -> list[Update]:
        """``node`` has not heartbeated for ``silent_s``: its instances are not ready."""
        out: list[Update] = []
        for a in self._by_id.values():
            if node in a.parts and node not in a.silent:
                a.silent.add(node)
                out += self._evaluate(a, now, detail=f"{silent_s:.1f} s")
        return out

    def forget(self, node: str, why: str, now: float) -> list[Update]:
        """``node`` deregistered or was forgotten: its parts leave."""
        out: list[Update] = []
        for a in list(self._by_id.values()):
            if node in a.parts:
                out += self._drop_part(a, node, why, now)
        return out

    def check(self, now: float) -> list[Update]:
        """Whole restarts whose backoff is over: every part ordered to run at epoch + 1."""
        out: list[Update] = []
        for a in self._by_id.values():
            if a.restart_at is not None and now >= a.restart_at and a.complete:
                a.restart_at = None
                self._order(a, a.epoch + 1, now)
                out += self._evaluate(a, now)
        return out

    def act(self, instance_id: str, action: str, now: float) -> list[Update]:
        """An operator's ``drain`` / ``stop`` / ``start`` / ``restart`` (see the module
        docstring; a restart's drain is the server's: ``drain`` first, then ``restart``).

        Raises
        ------
        KeyError
            ``instance_id`` is not a spanning instance, or it is not assembled.
        """
        a = self._by_id.get(instance_id)
        if a is None or not a.complete:
            raise KeyError(instance_id)
        if action == "drain":
            a.admin = "drain"
            return self._publish(a, InstanceState.DRAINING, "draining on an operator's request")
        if action == "stop":
            a.admin, a.run, a.restart_at = "stop", False, None
            logger.info("instance %s: every part of %s ordered to stop (operator)", a.id,
                        ", ".join(a.nodes))
            return self._publish(a, InstanceState.STOPPED, "stopped by an operator")
        a.admin, a.restart_at, a.consecutive = None, None, 0
        self._order(a, a.epoch + 1, now)
        a.state = None    # re-published as starting by the evaluation
        return self._evaluate(a, now) or self._publish(
            a, InstanceState.STARTING, f"operator: {action} (epoch {a.epoch})")

    def master_endpoints(self, instance_id: str) -> list[tuple[str, int]]:
        """``(host, port)`` of the spanning instance's API endpoints (the DP master's)."""
        a = self._by_id.get(instance_id)
        if a is None or a.master.spec is None:
            return []
        return [(e.host, e.port) for e in a.master.spec.endpoints]

    # -------------------------------------------------------------- internals
    def _drop_part(self, a: _Assembly, node: str, why: str, now: float) -> list[Update]:
        del a.parts[node]
        a.reports.pop(node, None)
        a.silent.discard(node)
        a.started.discard(node)
        if not a.parts:
            del self._by_id[a.id]
        a.run = False
        a.restart_at = None
        logger.info("instance %s: the part of node %s left (%s): the instance stops until "
                    "every part is registered again", a.id, node, why)
        return self._publish(a, None, f"part of node {node} left: {why}")

    def _order(self, a: _Assembly, epoch: int, now: float) -> None:
        a.epoch, a.run = epoch, True
        a.started = set()
        logger.info("instance %s: every part of %s ordered to run at epoch %d (DP master %s:%s)",
                    a.id, ", ".join(a.nodes), epoch, a.master.master_host, a.master.master_port)

    def _evaluate(self, a: _Assembly, now: float, registered: str | None = None,
                  detail: str | None = None) -> list[Update]:
        if not a.complete:
            if a.state is not None:
                return self._publish(a, None, "a part is missing")
            return []
        if a.admin is not None:
            return []   # an operator's drain or stop holds the state
        if a.epoch == 0 or (not a.run and a.restart_at is None and a.state is None):
            self._assemble(a, now)
        if a.run:
            for n in a.nodes:
                if a.reports.get(n, PartReport()).epoch == a.epoch:
                    a.started.add(n)
            failure = self._failure(a, registered)
            if failure is not None:
                return self._restart_later(a, failure, now)
            waiting = [n for n in a.nodes if a.reports.get(n, PartReport()).epoch != a.epoch]
            sick = [n for n in a.nodes if n not in waiting
                    and not a.reports[n].healthy]
            if a.silent:
                n = sorted(a.silent)[0]
                state = InstanceState.UNHEALTHY
                why = f"no heartbeat from node {n}" + (f" ({detail})" if detail else "")
            elif not waiting and not sick:
                a.consecutive = 0
                return self._publish(a, InstanceState.READY,
                                     f"every rank healthy (epoch {a.epoch})")
            elif a.state is InstanceState.READY:
                n = (sick or waiting)[0]
                state = InstanceState.UNHEALTHY
                why = f"node {n}: {a.reports[n].reason or 'not healthy'}"
            else:
                state = InstanceState.STARTING
                n = (waiting or sick)[0]
                rep = a.reports.get(n)
                detail_n = (rep.reason if rep is not None else None) or "starting"
                why = (f"waiting for the part of node {n} to run at epoch {a.epoch}"
                       if n in waiting else f"node {n}: {detail_n}")
            return self._publish(a, state, why)
        return []

    def _assemble(self, a: _Assembly, now: float) -> None:
        """Every part is registered: adopt the epoch they all run at, else start them."""
        epochs = {a.reports.get(n, PartReport()).epoch for n in a.nodes}
        if len(epochs) == 1 and 0 not in epochs:
            a.epoch, a.run = epochs.pop(), True
            a.started = set(a.nodes)
            logger.info("instance %s: assembled from %d parts already running at epoch %d",
                        a.id, len(a.nodes), a.epoch)
            return
        logger.info("instance %s: assembled (%s)", a.id, ", ".join(a.nodes))
        self._order(a, max(epochs | {a.epoch}) + 1, now)

    def _failure(self, a: _Assembly, registered: str | None) -> str | None:
        """Why the instance must restart as a whole, or None."""
        for n in a.nodes:
            rep = a.reports.get(n)
            if rep is None:
                continue
            if rep.epoch == a.epoch and rep.failed:
                return f"node {n}: {rep.reason or 'a process ended'}"
            if n in a.started and rep.epoch != a.epoch:
                what = "registered again" if n == registered else "reports"
                return (f"node {n} {what} without its part running at epoch {a.epoch} (its "
                        f"node manager restarted?)")
        return None

    def _restart_later(self, a: _Assembly, failure: str, now: float) -> list[Update]:
        m = a.master
        a.run = False
        window = m.restart_window_s
        while a.restart_times and now - a.restart_times[0] > window:
            a.restart_times.popleft()
        if m.restart_policy == "never" or len(a.restart_times) >= m.max_restarts:
            why = ("restart policy never" if m.restart_policy == "never" else
                   f"{len(a.restart_times)} whole restart(s) within {window:g} s")
            logger.error("instance %s: %s; not restarting it (%s)", a.id, failure, why)
            return self._publish(a, InstanceState.UNHEALTHY, f"{failure}; not restarted ({why})")
        a.consecutive += 1
        a.restart_times.append(now)
        delay = backoff_delay(a.consecutive, m.restart_backoff_initial_s, m.restart_backoff_max_s)
        a.restart_at = now + delay
        logger.warning("instance %s: %s; every part stops, the whole instance restarts at "
                       "epoch %d in %.2f s", a.id, failure, a.epoch + 1, delay)
        return self._publish(a, InstanceState.UNHEALTHY,
                             f"{failure}; restarting the whole instance (epoch {a.epoch + 1}) "
                             f"in {delay:.2f} s")

    def _publish(self, a: _Assembly, state: InstanceState | None, reason: str) -> list[Update]:
        nodes = tuple(a.nodes)
        if state is None:
            if a.state is None:
                return []
            a.state, a.reason = None, reason
            return [Update(a.id, None, reason, nodes)]
        if state is a.state and reason == a.reason:
            return []
        a.state, a.reason = state, reason
        spec = a.master.spec
        assert spec is not None
        inst = Instance(**(spec.model_dump() | {"healthy": state is InstanceState.READY}),
                        node=a.nodes[0], state=state, reason=reason)
        return [Update(a.id, inst, reason, nodes)]


__all__ = ["Assembler", "Update"]

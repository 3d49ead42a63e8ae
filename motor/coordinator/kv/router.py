"""The coordinator's KV state: instance slots, the exact index fed by KV events, the
approximate indexes fed by routing decisions, and request keys.

* Every endpoint (instance DP rank) that ``kv_affinity`` may route to gets a slot
  ``0 .. max_instances-1`` (:meth:`KvRouter.slot`); a removed endpoint's slot is purged
  and reused (:meth:`KvRouter.forget`), so a churn of instances never grows the index
  (case B29).
* **Exact** index: one :class:`~motor._fast.radix.PrefixIndex`, written only by
  :class:`~motor.coordinator.kv.ingest.KvIngest` from engine KV events.
* **Approximate** index per instance group (= model): what this coordinator routed
  where (:meth:`KvRouter.routed`), forgotten after ``ttl_s`` and capped at
  ``max_blocks`` distinct blocks (least recently routed first). Used for endpoints
  without a publisher (``mode: auto``), for all (``on``), or never (``off``).
* A request's overlap per candidate is the larger of the two indexes' answers.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from motor._fast.radix import PrefixIndex
from motor.config.schema import ApproximateMode, KvApproximateConfig, KvRoutingConfig
from motor.coordinator import metrics
from motor.coordinator.kv.ingest import KvIngest
from motor.coordinator.tokenize import TokenizeError, Tokenizers
from motor.errors import ConfigError
from motor.protocol.kv_events import N_TIERS, TIER_DEVICE, adapter_salt

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState

logger = logging.getLogger(__name__)

MAX_INSTANCES = 256
#: approximate indexes run their TTL sweep at most this often (seconds)
_SWEEP_PERIOD_S = 1.0
#: the modes as module constants: an enum class's attribute read goes through its
#: metaclass's ``__getattr__`` hook (~10x a plain read), and :meth:`KvRouter.routed` reads
#: them on every request
_ON = ApproximateMode.ON
_OFF = ApproximateMode.OFF


class ApproximateIndex:
    """Routed blocks of one instance group, with TTL and a cap on distinct blocks."""

    def __init__(self, cfg: KvApproximateConfig) -> None:
        self.cfg = cfg
        #: ``cfg.mode`` and ``cfg.max_blocks``, read on every routed request (a pydantic
        #: model's attribute costs ~10x a plain one's; the config does not change at run time)
        self.mode = cfg.mode
        self.max_blocks = cfg.max_blocks
        self.index = PrefixIndex(MAX_INSTANCES)
        #: monotonic seconds of the next TTL sweep (:meth:`sweep`)
        self.next_sweep = 0.0

    def insert(self, slot: int, hashes: npt.NDArray[np.uint64], now: float) -> None:
        index = self.index
        index.store(slot, TIER_DEVICE, 0, hashes, now)
        if index.n_nodes > self.max_blocks:
            n = index.evict_to_cap(self.max_blocks)
            metrics.KV_APPROX_EVICTED.labels("cap").inc(n)
        if now >= self.next_sweep:
            self.sweep(now)

    def sweep(self, now: float) -> None:
        if now >= self.next_sweep:
            self.next_sweep = now + _SWEEP_PERIOD_S
            n = self.index.evict_older_than(now - self.cfg.ttl_s)
            if n:
                metrics.KV_APPROX_EVICTED.labels("ttl").inc(n)


class KvRouter:
    """Slots, indexes, tokenizers and the request key of KV-aware routing.

    Parameters
    ----------
    cfg : KvRoutingConfig
        ``coordinator.kv``.
    clock : callable, optional
        Monotonic seconds (tests pass a fake one).
    on_routed : callable, optional
        ``on_routed(ep, group, hashes)``: called after each approximate-mode insertion of
        :meth:`routed` (``hashes``: the non-empty uint64 block hashes inserted for ``ep``).
        A multi-worker coordinator's :class:`~motor.coordinator.rings.WorkerLink` sets it
        (attribute of the same name) to pass the insertion on to the other workers.
    """

    def __init__(self, cfg: KvRoutingConfig | None = None, clock: Any = time.monotonic,
                 on_routed: Callable[[EndpointState, str | None, npt.NDArray[np.uint64]],
                                     None] | None = None,
                 adapters: set[str] | None = None) -> None:
        self.cfg = cfg or KvRoutingConfig()
        self.block_size = self.cfg.block_size
        self.clock = clock
        self.on_routed = on_routed
        self.tokenizers = Tokenizers(self.cfg.tokenizers)
        try:
            self.tokenizers.load_all()      # now, not on a first request's loop turn
        except ConfigError as e:    # `motor coordinator` refuses it before it starts: the
            logger.warning("%s", e)     # files changed since; that model: load alone
        self.exact = PrefixIndex(MAX_INSTANCES)
        self.ingest = KvIngest(self.exact, self.block_size, on_drop=self._on_drop,
                               on_apply=self._on_apply)
        self.approx: dict[str, ApproximateIndex] = {}
        self._slots: dict[str, int] = {}
        self._free = list(range(MAX_INSTANCES - 1, -1, -1))
        self._warned_full = False
        self.event_slots: set[int] = set()   # slots fed by a live subscription
        self._out = np.zeros((MAX_INSTANCES, N_TIERS), np.int32)
        self._out2 = np.zeros((MAX_INSTANCES, N_TIERS), np.int32)
        self._warned_tok: set[str] = set()
        #: model names that are LoRA adapters (their blocks hash apart): the endpoint
        #: table's set (``EndpointTable.adapters``, learned from the engines' /v1/models)
        self.adapters: set[str] = adapters if adapters is not None else set()
        self._next_gauges = 0.0
        self._gauges_pending = False
        #: called with a slot when its endpoint leaves (per-slot state elsewhere resets:
        #: ``kv_affinity``'s learned rates)
        self.on_forget: list[Callable[[int], None]] = []

    # -- metrics hooks ------------------------------------------------------------
    @staticmethod
    def _on_drop(reason: str, n: int) -> None:
        metrics.KV_EVENTS_DROPPED.labels(reason).inc(n)

    @staticmethod
    def _on_apply(kind: str, n: int) -> None:
        metrics.KV_EVENTS_APPLIED.labels(kind).inc(n)

    # -- slots --------------------------------------------------------------------
    def slot(self, key: str) -> int:
        """The slot of endpoint ``key`` (allocated on first use).

        Raises
        ------
        RuntimeError
            when more than 256 endpoints are in use at once.
        """
        s = self._slots.get(key)
        if s is None:
            if not self._free:
                raise RuntimeError(f"KV routing supports {MAX_INSTANCES} endpoints at once")
            s = self._slots[key] = self._free.pop()
            self.ingest.add_slot(s, key)
        return s

    def slot_if_free(self, key: str) -> int | None:
        """:meth:`slot`, or ``None`` when no slot is left for ``key`` (more than 256
        endpoints at once: warned once; what has no slot is routed on load alone and
        kept out of the indexes)."""
        s = self._slots.get(key)
        if s is None:
            if not self._free:
                self._warn_full()
                return None
            s = self.slot(key)
        return s

    def give_slots(self, keys: Iterable[str]) -> bool:
        """Give each endpoint of ``keys`` its slot; False when no slot is left for one
        (:meth:`slot_if_free`): its request is then routed on load alone."""
        slots = self._slots
        for k in keys:
            if k not in slots and self.slot_if_free(k) is None:
                return False
        return True

    @staticmethod
    def load_alone(keys: Iterable[str]) -> dict[str, int]:
        """The slot map a request with a candidate beyond the slots is gathered with
        (:meth:`give_slots` false): every endpoint of ``keys`` on slot 0, matched against no
        index, so the choice is made on load alone."""
        return dict.fromkeys(keys, 0)

    def _warn_full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning("KV routing supports %d endpoints at once; a request with a "
                           "candidate beyond them is routed on load alone, and what that "
                           "endpoint caches is not indexed", MAX_INSTANCES)

    def slots(self) -> dict[str, int]:
        return dict(self._slots)

    @property
    def slot_map(self) -> dict[str, int]:
        """Endpoint key -> slot, the live dict (read it, never write it: :meth:`slot`
        allocates, :meth:`forget` frees)."""
        return self._slots

    def forget(self, key: str, reason: str = "removed") -> int:
        """Endpoint ``key`` left: purge its blocks everywhere and free its slot."""
        s = self._slots.pop(key, None)
        if s is None:
            return 0
        n = self.ingest.drop_slot(s)
        for a in self.approx.values():
            n += a.index.clear(s)
        self.event_slots.discard(s)
        for cb in self.on_forget:
            cb(s)
        self._free.append(s)
        metrics.KV_PURGES.labels(reason).inc()
        logger.info("KV index: endpoint %s %s, %d block holding(s) purged", key, reason, n)
        self.update_gauges(force=True)
        return n

    def sync(self, keys: Iterable[str]) -> None:
        """Forget every slot whose endpoint is not in ``keys``."""
        live = set(keys)
        for k in [k for k in self._slots if k not in live]:
            self.forget(k)

    def purge(self, key: str, reason: str) -> int:
        """Drop the exact blocks of ``key`` (keeps the slot): event gap, publisher restart."""
        s = self._slots.get(key)
        if s is None:
            return 0
        n = self.ingest.purge(s)
        metrics.KV_PURGES.labels(reason).inc()
        return n

    # -- groups -------------------------------------------------------------------
    def approx_cfg(self, group: str | None) -> KvApproximateConfig:
        g = self.cfg.groups.get(group or "")
        return g.approximate if g is not None else self.cfg.approximate

    def note_sent(self, slot: int, group: str | None, hashes: Any) -> None:
        """Another worker sent a request with block ``hashes`` to instance ``slot`` of
        ``group`` (a routing hint from the feed): record it in the approximate index."""
        self._approx(group).insert(slot, hashes, self.clock())

    def _approx(self, group: str | None) -> ApproximateIndex:
        name = group or ""
        a = self.approx.get(name)
        if a is None:
            a = self.approx[name] = ApproximateIndex(self.approx_cfg(group))
        return a

    def uses_approximate(self, ep: EndpointState, group: str | None) -> bool:
        mode = self.approx_cfg(group).mode
        if mode is _ON:
            return True
        if mode is _OFF:
            return False
        return self._slots.get(ep.key, -1) not in self.event_slots

    # -- requests -----------------------------------------------------------------
    def request_hashes(self, route: str, body: dict[str, Any]) -> tuple[int, npt.NDArray[np.uint64]] | None:
        """(prompt tokens, block hashes of the routing key) or None when not tokenizable."""
        # a LoRA adapter's blocks hash apart (case N12)
        name = body.get("model")
        salt = adapter_salt(name) if self.adapters and isinstance(name, str) \
            and name in self.adapters else 0
        try:
            return self.tokenizers.block_key(route, body, self.block_size, salt)
        except (TokenizeError, ValueError) as e:
            model = str(name)
            if model not in self._warned_tok:
                self._warned_tok.add(model)
                logger.warning("KV routing: cannot tokenize a %s request for model %s (%s); "
                               "such requests are routed on load alone", route, model, e)
            return None

    def indexes(self, group: str | None) -> tuple[PrefixIndex, PrefixIndex | None]:
        """(the exact index, ``group``'s approximate index or None when it holds nothing):
        what a match of a ``group`` request reads, the approximate one swept of its expired
        blocks first when its sweep is due."""
        a = self.approx.get(group or "")
        if a is None or not a.index.n_nodes:
            return self.exact, None
        now = self.clock()
        if now >= a.next_sweep:
            a.sweep(now)
        return self.exact, a.index

    def match(self, hashes: npt.NDArray[np.uint64], group: str | None) -> npt.NDArray[np.int32]:
        """int32[MAX_INSTANCES, 3]: leading cached blocks per slot and fastest tier, the
        larger of the two :meth:`indexes`' counts (a view of a reused buffer: valid until
        the next call)."""
        out = self._out
        exact, approx = self.indexes(group)
        if approx is None:
            exact.match_into(hashes, out)
            return out
        if not exact.n_nodes:           # approximate mode only: one match
            approx.match_into(hashes, out)
            return out
        exact.match_into(hashes, out)
        approx.match_into(hashes, self._out2)
        np.maximum(out, self._out2, out=out)
        return out

    def routed(self, ep: EndpointState, group: str | None,
               hashes: npt.NDArray[np.uint64] | None) -> None:
        """Approximate mode: ``ep`` got a request whose key has ``hashes``; then
        :attr:`on_routed`, if set, hears of the insertion."""
        if hashes is None or not len(hashes):
            return
        a = self.approx.get(group or "")    # uses_approximate, without creating the index
        mode = a.mode if a is not None else self.approx_cfg(group).mode
        if mode is _OFF or (mode is not _ON and self._slots.get(
                ep.key, -1) in self.event_slots):
            return
        s = self._slots.get(ep.key)
        if s is None:
            s = self.slot_if_free(ep.key)
            if s is None:
                return      # no slot left for it (the policy routed on load alone)
        if a is None:
            a = self._approx(group)
        a.insert(s, hashes, self.clock())
        self.update_gauges()
        if self.on_routed is not None:
            self.on_routed(ep, group, hashes)

    # -- size ---------------------------------------------------------------------
    def index_blocks(self, kind: str) -> int:
        if kind == "exact":
            return int(self.exact.n_blocks)
        return sum(int(a.index.n_blocks) for a in self.approx.values())

    def index_bytes(self, kind: str) -> int:
        if kind == "exact":
            return int(self.exact.memory_bytes) + self.ingest.memory_bytes()
        return sum(int(a.index.memory_bytes) for a in self.approx.values())

    def update_gauges(self, force: bool = False) -> None:
        """Refresh the index-size gauges (at most every 0.5 s unless ``force``).

        A throttled call schedules one trailing refresh on the running event loop, so
        the gauges never stay behind the index (a burst of batches within 0.5 s used to
        leave them at the size before the burst until the next batch came)."""
        now = time.monotonic()
        if not force and now < self._next_gauges:
            if not self._gauges_pending:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return   # no loop (tests, tools): the next call refreshes
                self._gauges_pending = True
                loop.call_later(self._next_gauges - now, self._trailing_gauges)
            return
        self._next_gauges = now + 0.5
        for kind in ("exact", "approximate"):
            metrics.KV_INDEX_BLOCKS.labels(kind).set(self.index_blocks(kind))
            metrics.KV_INDEX_BYTES.labels(kind).set(self.index_bytes(kind))

    def _trailing_gauges(self) -> None:
        self._gauges_pending = False
        self.update_gauges(force=True)

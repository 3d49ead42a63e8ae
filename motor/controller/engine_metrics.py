"""The engines' own Prometheus figures, re-exported by the controller with instance labels.

The controller knows every instance and its endpoints (the instance table), so one scrape
target shows the whole cluster:

* ``GET /metrics/engines``: every scraped endpoint's ``/metrics`` families (vLLM
  ``vllm:*``, SGLang ``sglang:*``, ``motor sim``'s vLLM names), each sample with the labels
  ``motor_instance`` (the instance id), ``motor_node``, ``motor_role`` (``union``,
  ``prefill``, ``decode``) and ``dp_rank`` added (they replace an engine label of the same
  name), HELP / TYPE once per family, in Prometheus text format 0.0.4; followed by
  ``motor_engine_scrape_up`` / ``_duration_seconds`` / ``_samples`` per endpoint. An
  endpoint that does not answer 200 within the timeout, or answers text that does not
  parse, gets ``motor_engine_scrape_up 0`` and none of its families: the scrape as a whole
  never fails. A family whose type differs from the one an earlier endpoint gave under the
  same name (two engine versions) is left out for that endpoint.
* ``GET /v1/engines``: a JSON summary per endpoint (:meth:`Snapshot.summary`) for the
  cluster page (:mod:`motor.controller.page`).

Scraped: the endpoints of instances in state ``ready``, ``unhealthy`` or ``draining``
(``starting`` engines may still be loading, ``stopped`` ones are stopped), over plain HTTP
(:attr:`motor.protocol.instances.Endpoint.url`), all at once, each within ``timeout_s``.
A scrape round happens at most once per ``min_interval_s`` whatever the number of callers
(Prometheus servers, open pages): callers in between get the last round, callers during a
round wait for it. No task runs between requests: a round is made by the request that
needs it, and the connections it opened are closed when it ends.

Wire formats: the text exposition format 0.0.4 (prometheus.io, "Exposition formats"),
read with prometheus-client's parser (``prometheus_client.parser``) and written with its
``generate_latest``. The summary's engine names are those of
:mod:`motor.protocol.engine_metrics` plus the prefix-cache counters and TTFT histograms
below.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from motor.http import Client
from motor.protocol.engine_metrics import parse_engine_metrics
from motor.protocol.instances import InstanceState, InstanceTable

logger = logging.getLogger(__name__)

#: the labels added to every re-exported sample, in this order
LABELS = ("motor_instance", "motor_node", "motor_role", "dp_rank")
#: instance states whose endpoints are scraped
SCRAPED_STATES = frozenset({InstanceState.READY, InstanceState.UNHEALTHY,
                            InstanceState.DRAINING})

# counters and histograms the summary reads besides the load gauges. vLLM: its Prometheus
# stat logger (vllm/v1/metrics/loggers.py: vllm:prefix_cache_queries / _hits counters,
# vllm:time_to_first_token_seconds histogram); SGLang: its metrics collector
# (python/sglang/srt/metrics/collector.py: sglang:cache_hit_rate gauge,
# sglang:time_to_first_token_seconds histogram). motor sim exports the vLLM ones.
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
SGLANG_CACHE_HIT_RATE = "sglang:cache_hit_rate"
TTFT_SUM = ("vllm:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_sum")
TTFT_COUNT = ("vllm:time_to_first_token_seconds_count",
              "sglang:time_to_first_token_seconds_count")
_SUMMED = {VLLM_PREFIX_HITS: "prefix_hits", VLLM_PREFIX_QUERIES: "prefix_queries",
           SGLANG_CACHE_HIT_RATE: "cache_hit_rate",
           **dict.fromkeys(TTFT_SUM, "ttft_sum_s"), **dict.fromkeys(TTFT_COUNT, "ttft_count")}

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def scrape_registry() -> tuple[CollectorRegistry, Gauge, Gauge, Gauge]:
    """A fresh registry with the ``motor_engine_scrape_*`` gauges (labels :data:`LABELS`):
    (registry, up, duration, samples). One per scrape round; docs/metrics.md lists them."""
    reg = CollectorRegistry(auto_describe=True)
    up = Gauge("motor_engine_scrape_up",
               "1 when the endpoint answered its /metrics in time with text that parses, else 0 "
               "(its families are then left out).", LABELS, registry=reg)
    duration = Gauge("motor_engine_scrape_duration_seconds",
                     "Time the endpoint's /metrics took to answer (the timeout when it did not).",
                     LABELS, registry=reg)
    samples = Gauge("motor_engine_scrape_samples",
                    "Samples re-exported from the endpoint (0 when it was not scraped).",
                    LABELS, registry=reg)
    return reg, up, duration, samples


@dataclass
class Target:
    """One endpoint to scrape: the instance's id, node and role, the endpoint's DP rank and
    address."""
    instance: str
    node: str
    role: str
    dp_rank: int
    host: str
    port: int

    @property
    def labels(self) -> dict[str, str]:
        return {"motor_instance": self.instance, "motor_node": self.node,
                "motor_role": self.role, "dp_rank": str(self.dp_rank)}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def targets(table: InstanceTable) -> list[Target]:
    """The endpoints of ``table`` to scrape (instances in :data:`SCRAPED_STATES`), in table
    order (instance id, then DP rank as registered)."""
    return [Target(inst.id, inst.node, inst.role.value, ep.dp_rank, ep.host, ep.port)
            for inst in table.instances if inst.state in SCRAPED_STATES
            for ep in inst.endpoints]


@dataclass
class Scraped:
    """What one endpoint answered: ``text`` (its exposition, ``None`` when it failed),
    ``error`` (why not, for logs and the summary), ``duration_s``."""
    target: Target
    text: str | None
    error: str | None
    duration_s: float


class _Families:
    """What ``generate_latest`` reads: an object with ``collect()``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


@dataclass
class Snapshot:
    """One scrape round: every endpoint's answer, when the round started (``taken_at``,
    Unix seconds) and how long it took (``duration_s``). Its text and summary are made on
    first use and kept."""
    scraped: list[Scraped]
    taken_at: float
    duration_s: float
    version: int
    _text: bytes | None = field(default=None, repr=False)
    _summary: dict[str, Any] | None = field(default=None, repr=False)

    def render(self) -> bytes:
        """The Prometheus text (exposition format 0.0.4) of this round: the engines'
        families with :data:`LABELS` added, then the ``motor_engine_scrape_*`` gauges."""
        if self._text is None:
            self._text = render(self.scraped)
        return self._text

    def summary(self) -> dict[str, Any]:
        """``{"scraped_at": Unix s, "scrape_s": s, "version": table version, "endpoints":
        [{"instance", "node", "role", "dp_rank", "url", "up", "error", "scrape_s",
        "waiting", "running", "kv_usage", "prefix_hits", "prefix_queries",
        "prefix_hit_ratio", "ttft_sum_s", "ttft_count"}]}``. Figures of an endpoint that
        was not scraped are ``null``; ``kv_usage`` and ``prefix_hit_ratio`` are fractions
        0..1 (the ratio is cumulative since the engine started: vLLM hits / queries,
        SGLang's ``cache_hit_rate``; ``null`` before the first query); ``ttft_*`` are the
        engine's own TTFT histogram sum (seconds) and count (requests)."""
        if self._summary is None:
            self._summary = {"scraped_at": round(self.taken_at, 3),
                             "scrape_s": round(self.duration_s, 4), "version": self.version,
                             "endpoints": [_summarize(s) for s in self.scraped]}
        return self._summary


def _summarize(s: Scraped) -> dict[str, Any]:
    t = s.target
    out: dict[str, Any] = {"instance": t.instance, "node": t.node, "role": t.role,
                           "dp_rank": t.dp_rank, "url": t.url, "up": s.text is not None,
                           "error": s.error, "scrape_s": round(s.duration_s, 4)}
    figures = dict.fromkeys(("waiting", "running", "kv_usage", "prefix_hits", "prefix_queries",
                             "prefix_hit_ratio", "ttft_sum_s", "ttft_count"))
    out.update(figures)
    if s.text is None:
        return out
    waiting, running, kv = parse_engine_metrics(s.text)
    sums = _sum_samples(s.text)
    out.update(waiting=waiting, running=running, kv_usage=kv,
               prefix_hits=sums.get("prefix_hits"), prefix_queries=sums.get("prefix_queries"),
               ttft_sum_s=sums.get("ttft_sum_s"), ttft_count=sums.get("ttft_count"))
    q = sums.get("prefix_queries")
    if q:
        out["prefix_hit_ratio"] = sums.get("prefix_hits", 0.0) / q
    elif "cache_hit_rate" in sums:
        out["prefix_hit_ratio"] = sums["cache_hit_rate"]
    return out


def _sum_samples(text: str) -> dict[str, float]:
    """The samples of the :data:`_SUMMED` names, summed over their label sets, by key;
    lines that do not parse are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key = _SUMMED.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is None:
            continue
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[key] = out.get(key, 0.0) + v
    return out


def parse(text: str) -> list[Metric]:
    """The families of an exposition (prometheus-client's text parser, which gives a
    counter family its name without ``_total`` and ``_created`` samples as gauge families of
    their own).

    Raises
    ------
    ValueError
        the text does not parse (the parser's own message).
    """
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"malformed exposition: {type(e).__name__}: {e}") from None


def render(scraped: list[Scraped]) -> bytes:
    """The re-exported text of one round (see the module docstring): the engines' families
    merged by name in the order first seen, then the scrape gauges.

    ``scraped``: each endpoint's answer; one whose text does not parse counts as down.
    Returns Prometheus text format 0.0.4 (``generate_latest``'s output; :data:`CONTENT_TYPE`).
    """
    reg, up, duration, samples = scrape_registry()
    merged: dict[str, Metric] = {}
    for s in scraped:
        labels = s.target.labels
        n = 0
        ok = False
        if s.text is not None:
            try:
                families = parse(s.text)
                ok = True
            except ValueError as e:
                logger.info("engine %s (%s): /metrics not re-exported: %s", s.target.instance,
                            s.target.url, e)
        if ok:
            for fam in families:
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
                elif into.type != fam.type:
                    logger.debug("engine %s: family %s is a %s here, a %s before: left out",
                                 s.target.instance, fam.name, fam.type, into.type)
                    continue
                for sm in fam.samples:
                    into.samples.append(Sample(sm.name, {**sm.labels, **labels}, sm.value,
                                               sm.timestamp, sm.exemplar))
                n += len(fam.samples)
        up.labels(**labels).set(1 if ok else 0)
        duration.labels(**labels).set(s.duration_s)
        samples.labels(**labels).set(n)
    families = list(merged.values()) + list(reg.collect())
    return generate_latest(_Families(families))


async def scrape_one(client: Client, target: Target, timeout_s: float) -> Scraped:
    """GET ``target``'s ``/metrics`` within ``timeout_s``; never raises (but cancellation)."""
    t0 = time.perf_counter()
    try:
        status, body = await client.get_json_bytes(target.host, target.port, "/metrics",
                                                   timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return Scraped(target, None, f"no answer within {timeout_s:g} s", timeout_s)
    except Exception as e:  # noqa: BLE001 - refused, reset, malformed HTTP: down
        return Scraped(target, None, f"{type(e).__name__}: {e}", time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if status != 200:
        return Scraped(target, None, f"answered {status}", dt)
    return Scraped(target, body.decode("utf-8", "replace"), None, dt)


class EngineScraper:
    """Scrape rounds over the instance table, at most one per ``min_interval_s``.

    Parameters
    ----------
    table : callable
        Returns the current :class:`~motor.protocol.instances.InstanceTable` (read at each
        round: the controller's registry is replaced when it becomes leader).
    timeout_s : float
        Per endpoint, seconds (connect included); default 1.
    min_interval_s : float
        A round newer than this (seconds) is answered again instead of scraping; default 1.
    clock : callable
        Monotonic seconds (tests inject one).
    """

    def __init__(self, table: Callable[[], InstanceTable], timeout_s: float = 1.0,
                 min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.table = table
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._last: Snapshot | None = None
        self._last_at = 0.0
        self._lock = asyncio.Lock()
        #: scrape rounds made (tests read it)
        self.rounds = 0

    async def snapshot(self) -> Snapshot:
        """The last round if younger than ``min_interval_s``, else a new one (callers
        arriving during a round wait for it)."""
        if self._fresh():
            assert self._last is not None
            return self._last
        async with self._lock:
            if self._fresh():
                assert self._last is not None
                return self._last
            snap = await self._round()
            self._last, self._last_at = snap, self.clock()
            return snap

    def _fresh(self) -> bool:
        return self._last is not None and self.clock() - self._last_at < self.min_interval_s

    async def _round(self) -> Snapshot:
        table = self.table()
        todo = targets(table)
        taken_at = time.time()
        t0 = time.perf_counter()
        client = Client(max_connections_per_endpoint=1, connect_timeout_s=self.timeout_s)
        try:
            scraped = list(await asyncio.gather(
                *(scrape_one(client, t, self.timeout_s) for t in todo)))
        finally:
            client.close()
        self.rounds += 1
        dt = time.perf_counter() - t0
        down = [s.target.instance for s in scraped if s.text is None]
        logger.debug("engine metrics: %d endpoint(s) scraped in %.1f ms, %d down %s",
                     len(scraped), dt * 1000, len(down), down)
        return Snapshot(scraped, taken_at, dt, table.version)

    async def render(self) -> bytes:
        """The text of ``GET /metrics/engines`` (:meth:`Snapshot.render`; parsed and written
        in a worker thread so the event loop keeps serving)."""
        snap = await self.snapshot()
        if snap._text is None:
            snap._text = await asyncio.to_thread(render, snap.scraped)
        return snap._text

    async def summary(self) -> dict[str, Any]:
        """The body of ``GET /v1/engines`` (:meth:`Snapshot.summary`)."""
        return (await self.snapshot()).summary()


__all__ = ["CONTENT_TYPE", "LABELS", "SCRAPED_STATES", "EngineScraper", "Scraped", "Snapshot",
           "Target", "parse", "render", "scrape_one", "scrape_registry", "targets"]

"""Joint (prefill, decode) choice of the PD modes and conditional disaggregation
(``coordinator.pd.joint``; docs/pd.md, "Joint choice").

One cost in seconds over every (prefill P, decode D) pair and, with ``local_prefill``,
every decode instance alone (:func:`motor._fast.pairs.pick_pair` has the formula,
:func:`motor._fast.pairs.pick_joint` computes it in the decision)::

    pair(P, D) = predicted prefill time on P (its queued prefill tokens + this request's
                 tokens not cached on P, at P's learned rates)
                 + ``stall_weight`` x the stall that prefill imposes on P's running
                   prefills (running x prefill time of the uncached tokens)
                 + KV transfer of the tokens not cached on D (us per token by topology:
                   same node / same rack / other)
                 + D's first step (its batch, its queued local prefills)
                 + this request's decode on D (max_tokens steps with D's batch)
                 + ``stall_weight`` x the delay those steps impose on D's running
                   sequences (running x decode time per sequence x max_tokens)
                 + the hand-off: what a pair's decode leg takes beyond these terms
                   more than a local leg does (learned, below)
    local(D)   = prefill on D itself + the stall it imposes on D's running batch
                 (``stall_weight`` x running x prefill time) + the decode on D (as above)

A decode instance serves alone when its cost is strictly lower than the best pair's: the
threshold on the uncached prompt is the cost's, not a constant (a short or mostly cached
prompt on an idle D goes local; a long one, or a busy D, goes to a pair). Cached prefixes
come from the KV router (the prefill policy's when it is ``kv_affinity``, else one of
its own on the approximate index). Rates are ``coordinator.kv.ttft``'s priors; a prefill
instance's are learned (``kv.ttft.learn``, :class:`motor.coordinator.policy.ttft.RateModel`)
from its observed prefill legs, whose time is its prefill alone; a planned prefill leg
counts only the tokens P computes (not its cached prefix) as P's in-flight prefill, the
queued work of the next decisions and of that fit. A decode instance stays at
the priors: its first-token times mix its decode batch with any prefill, and a fit to them
skewed the decode choice in the benchmark (worse TPOT, docs/benchmarks.md). The hand-off
is learned instead (``kv.ttft.learn`` with local prefill): each decode leg's time from its
send to its first token minus its prediction (a pair: the transfer + D's first step, plus
the prefill in the modes that send D first; alone: D's prefill; legs predicted with queued
prefill work are left out: a queue's pace is the rates' guess), a running mean per kind
over about ``kv.ttft.halflife_requests`` legs; the pairs' mean minus the local legs' (>= 0)
is what a pair costs beyond its terms: P's answer relayed and D's request for the KV (both
kinds share the rest: the HTTP legs, the step D is in when the request arrives). Ties: the first
pair in rotated order, deterministic. In ``pd_prefill_first`` the decode leg is sent after
the prefill: :meth:`PairChooser.decode_for` chooses its instance again then, on the decode
instances' load of that moment (the plan's D saw none of the pairs prefilling meanwhile).
Every decision is logged at debug level with its terms in ms.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from motor._fast.pairs import pick_joint
from motor.config.schema import CoordinatorConfig
from motor.coordinator.kv.router import MAX_INSTANCES, KvRouter
from motor._fast.columns import gather, uncached
from motor.coordinator.loadtable import load_columns
from motor.coordinator.policy.base import RequestInfo
from motor.coordinator.policy.ttft import RateModel, TtftWatch

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState

logger = logging.getLogger(__name__)

#: a local decision's reason is ``cached_on_decode`` when at least this share of the prompt
#: is cached on the decode instance, else ``short_prompt``
CACHED_SHARE = 0.5

SAME_NODE, SAME_RACK, OTHER = 0, 1, 2
#: the kinds of decode leg :meth:`PairChooser.observe_decode` learns from
PAIR, LOCAL = 0, 1


def closeness(a: EndpointState, b: EndpointState, labels: dict[str, str]) -> int:
    """How close two endpoints are: :data:`SAME_NODE`, :data:`SAME_RACK` or :data:`OTHER`.

    ``labels``: ``pd.joint.topology`` (instance id, ``host:port`` or host -> ``RACK/NODE``).
    Without a label for either, endpoints on the same host are one node."""
    la, lb = _label(a, labels), _label(b, labels)
    if la is None or lb is None:
        return SAME_NODE if la is None and lb is None and a.host == b.host else OTHER
    if la == lb:
        return SAME_NODE
    return SAME_RACK if la.split("/", 1)[0] == lb.split("/", 1)[0] else OTHER


def _label(e: EndpointState, labels: dict[str, str]) -> str | None:
    if not labels:
        return None
    return labels.get(e.instance_id) or labels.get(f"{e.host}:{e.port}") or labels.get(e.host)


class Choice:
    """One decision: ``p`` (None when ``d`` serves alone), ``d``, ``reason`` (metric label),
    predicted ``cost_s``, and what the prefill leg's learning needs (``p_obs``)."""

    __slots__ = ("p", "d", "reason", "cost_s", "p_uncached", "d_uncached", "p_obs",
                 "p_ttft_s", "d_ttft_s", "queued")

    def __init__(self, p: EndpointState | None, d: EndpointState, reason: str,
                 cost_s: float) -> None:
        self.p = p
        self.d = d
        self.reason = reason
        self.cost_s = cost_s
        self.p_uncached = 0
        self.d_uncached = 0
        self.p_obs: tuple[int, tuple[float, float, float]] | None = None
        #: predicted seconds of the prefill on ``p`` (0 alone) and from the decode leg's
        #: start to its first token without the hand-off (a pair: the transfer and D's
        #: first step; alone: D's prefill): what :meth:`PairChooser.watch_decode` compares
        self.p_ttft_s = 0.0
        self.d_ttft_s = 0.0
        #: prefill tokens queued on (P, D) when chosen (0 on P when ``d`` serves alone)
        self.queued = (0.0, 0.0)

    @property
    def local(self) -> bool:
        return self.p is None


class PairChooser:
    """The joint choice over a coordinator's prefill and decode endpoints.

    Parameters
    ----------
    cfg : CoordinatorConfig
        ``pd.joint`` (topology, transfer times, local prefill, stall weight) and ``kv``
        (block size, tier credit, TTFT priors).
    router : KvRouter or None
        The KV router to read cached prefixes from (the prefill policy's); None = its own.
    """

    def __init__(self, cfg: CoordinatorConfig, router: KvRouter | None = None) -> None:
        j = cfg.pd.joint
        self.router = router if router is not None else KvRouter(cfg.kv)
        c = self.router.cfg
        self.credit = np.array([c.tier_credit.device, c.tier_credit.host, c.tier_credit.disk],
                               np.float64)
        t = cfg.kv.ttft
        self.learn = t.learn
        self.chunk_tokens = float(t.chunk_tokens)
        self.rates = RateModel(t, MAX_INSTANCES)
        self.router.on_forget.append(self.rates.reset)
        self.local_prefill = j.local_prefill
        self.stall_weight = j.stall_weight
        x = j.transfer_us_per_token
        self.transfer_s = (x.same_node * 1e-6, x.same_rack * 1e-6, x.other * 1e-6)
        self.labels = dict(j.topology)
        #: endpoint key -> (node id, rack id) (:meth:`_place`), and the ids given out
        self._places: dict[Any, tuple[int, int]] = {}
        self._ids: dict[tuple[str, Any], int] = {}
        self._xfer: dict[tuple[tuple[EndpointState, ...], tuple[EndpointState, ...]],
                         npt.NDArray[np.float64]] = {}
        self._next = 0
        #: per kind (:data:`PAIR`, :data:`LOCAL`): [mean, observations] of the decode legs'
        #: observed time to their first token minus its prediction, seconds
        self._resid: list[list[float]] = [[0.0, 0.0], [0.0, 0.0]]
        self._resid_window = float(t.halflife_requests)

    @property
    def handoff_s(self) -> float:
        """What a pair's hand-off costs beyond its terms, seconds, >= 0: the mean residual
        of the pairs' decode legs minus that of the local ones, once both were observed
        (``kv.ttft.learn``); 0 before. Both legs' residuals hold what the terms of either
        miss (the HTTP legs, the decode step in progress when the request arrives), so the
        difference is the pair's own (P's answer relayed, D's request for the KV)."""
        (pm, pn), (lm, ln) = self._resid
        return max(0.0, pm - lm) if pn and ln else 0.0

    @property
    def handoff_observations(self) -> tuple[int, int]:
        """(pair, local) decode legs observed so far."""
        return int(self._resid[PAIR][1]), int(self._resid[LOCAL][1])

    def observe_decode(self, kind: int, predicted_s: float, observed_s: float) -> None:
        """One decode leg's first token came ``observed_s`` after it was sent, predicted
        ``predicted_s``: the running mean of its kind's residual (over the last
        ``kv.ttft.halflife_requests`` legs or so, an exponentially weighted mean)."""
        r = self._resid[kind]
        r[1] += 1
        r[0] += (observed_s - predicted_s - r[0]) / min(r[1], self._resid_window)

    def watch_decode(self, ch: Choice, with_prefill: bool) -> Callable[[float], None] | None:
        """The learner of the decode leg of ``ch`` (for its lease: the time from its send
        to its first token); ``with_prefill``: that time holds the prefill too (the legs
        of ``pd_decode_first`` / ``pd_bootstrap``). None unless ``kv.ttft.learn`` and local
        prefill (the hand-off only weighs a pair against a decode instance alone), and for
        a leg whose prediction holds queued prefill work (on D; on P too ``with_prefill``):
        how fast a queue drains is the rates' guess, and its errors are not the hand-off."""
        if not (self.learn and self.local_prefill):
            return None
        if ch.queued[1] > 0 or (with_prefill and ch.queued[0] > 0):
            return None     # queued work drains at a pace the terms guess: not the hand-off's
        kind = LOCAL if ch.p is None else PAIR
        pred = ch.d_ttft_s + (ch.p_ttft_s if with_prefill else 0.0)
        return lambda s: self.observe_decode(kind, pred, s)

    def prepare(self, info: RequestInfo, route: str, body: dict[str, Any]) -> None:
        """Fill ``info.block_hashes`` (and the exact prompt size) when no policy did."""
        if info.block_hashes is None:
            key = self.router.request_hashes(route, body)
            if key is not None:
                info.prompt_tokens, info.block_hashes = key
                info.prefill_tokens = info.prompt_tokens

    def _place(self, e: EndpointState) -> tuple[int, int]:
        """(node id, rack id) of ``e`` for :meth:`transfer_matrix`, as :func:`closeness`
        compares them: a labelled endpoint's node is its label and its rack the label's
        first part; an unlabelled one's node is its host (one node with any unlabelled
        endpoint of that host, none with a labelled one) and its rack its own."""
        got = self._places.get(e.key)
        if got is None:
            if len(self._places) >= 4096:      # endpoints come and go: stay bounded
                self._places.clear()
                self._ids.clear()
            ids = self._ids
            label = _label(e, self.labels)
            if label is None:
                node = ids.setdefault(("host", e.host), len(ids))
                rack = ids.setdefault(("alone", e.key), len(ids))
            else:
                node = ids.setdefault(("node", label), len(ids))
                rack = ids.setdefault(("rack", label.split("/", 1)[0]), len(ids))
            got = self._places[e.key] = (node, rack)
        return got

    def transfer_matrix(self, ps: list[EndpointState], ds: list[EndpointState]
                        ) -> npt.NDArray[np.float64]:
        """float64[P, D], C-contiguous: KV transfer seconds per token of each pair (its
        :func:`closeness`)."""
        pp = np.array([self._place(e) for e in ps], np.int64).reshape(len(ps), 2)
        dp = np.array([self._place(e) for e in ds], np.int64).reshape(len(ds), 2)
        node = pp[:, 0, None] == dp[None, :, 0]
        rack = pp[:, 1, None] == dp[None, :, 1]
        near, mid, far = self.transfer_s
        return np.ascontiguousarray(np.where(node, near, np.where(rack, mid, far)),
                                    np.float64)

    def _transfer(self, ps: list[EndpointState], ds: list[EndpointState]
                  ) -> npt.NDArray[np.float64]:
        """:meth:`transfer_matrix`, remembered per (prefill, decode) candidate lists (the
        endpoints hash and compare by identity: the key is the lists' objects)."""
        key = (tuple(ps), tuple(ds))
        got = self._xfer.get(key)
        if got is None:
            if len(self._xfer) >= 64:
                self._xfer.clear()
            got = self._xfer[key] = self.transfer_matrix(ps, ds)
        return got

    def choose(self, info: RequestInfo, ps: list[EndpointState], ds: list[EndpointState],
               local: bool, mode: str = "", reason: str | None = None) -> Choice | None:
        """The cheapest pair (or decode instance alone when ``local`` and
        ``pd.joint.local_prefill``) among ``ps`` x ``ds``; None when ``ds`` is empty, or
        ``ps`` is and no local choice is allowed. ``mode``: what the debug line names the
        decision by; ``reason``: a pair's reason when given (else ``cost``, or ``local_off``
        when no local choice is allowed)."""
        if not ds or (not ps and not (local and self.local_prefill)):
            return None
        local = local and self.local_prefill
        n_p = len(ps)
        cands = ps + ds                                         # both roles
        r = self.router
        h = info.block_hashes
        m = r.match(h, info.model) if h is not None and len(h) else None
        slots, ov, queued, running, slotted = self._columns(cands, m)
        if not slotted:
            m = None                # a candidate beyond the KV slots: on load alone
        rates = self.rates.rates(slots)
        xfer = self._transfer(ps, ds)
        start = self._next
        self._next = start + 1
        handoff = self.handoff_s
        # one compiled pass: the uncached tokens, the columns' roles, the argmin
        pi, di, cost, pair_s, local_s, d_unc, d_share, p_unc, xs = pick_joint(
            n_p, ov if m is not None else None, float(info.prompt_tokens), r.block_size,
            self.credit, queued, running, rates, xfer, float(info.max_tokens),
            self.chunk_tokens, local, self.stall_weight, start, handoff)
        if di < 0:
            return None
        d = ds[di]
        j = n_p + di
        rd = rates[j].tolist()
        dq, dr = float(queued[j]), float(running[j])
        if pi < 0:
            reason = "cached_on_decode" if d_share >= CACHED_SHARE else "short_prompt"
            ch = Choice(None, d, reason, cost)
            ch.d_ttft_s = self._ttft(dq + d_unc, dr, rd)
            ch.queued = (0.0, dq)
        else:
            ch = Choice(ps[pi], d, reason or ("cost" if local else "local_off"), cost)
            pq, pr = float(queued[pi]), float(running[pi])
            ch.p_uncached = int(p_unc)
            ch.p_ttft_s = self._ttft(pq + p_unc, pr, rates[pi].tolist())
            ch.d_ttft_s = xs * d_unc + rd[0] + rd[2] * dr + rd[1] * dq
            ch.queued = (pq, dq)
            if self.learn and slotted:      # else slot 0's rates stood in for all
                ch.p_obs = (int(slots[pi]), self.rates.features(pq, p_unc, pr))
        ch.d_uncached = int(d_unc)
        if logger.isEnabledFor(logging.DEBUG):
            if m is None:
                unc = np.full(len(cands), float(info.prompt_tokens))
            else:
                unc, _ = uncached(ov, float(info.prompt_tokens), r.block_size, self.credit)
            self._log(mode, info, ch, ps, ds, unc[:n_p], queued[:n_p], running[:n_p],
                      rates[:n_p], unc[n_p:], queued[n_p:], running[n_p:], pair_s, local_s,
                      handoff)
        return ch

    def _columns(self, cands: list[EndpointState], m: npt.NDArray[np.int32] | None
                 ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int32],
                            npt.NDArray[np.float64], npt.NDArray[np.float64], bool]:
        """(rate slots intp[k], cached blocks int32[k, 3], prefill tokens queued float64[k],
        requests running float64[k], slotted) per candidate: one compiled gather (two when
        an endpoint is new to KV routing: it gets a slot). ``slotted`` false: no slot was
        left for one (more than 256 endpoints), every candidate stands on slot 0 with
        nothing cached: the choice is made on load alone."""
        r = self.router
        local = getattr(cands[0], "shared", None) is None
        slots, ov, loads, missing, _ = gather(cands, r.slot_map, m, local)
        slotted = True
        if missing:                 # an endpoint new to KV routing: give it a slot
            keys = [e.key for e in cands]
            slotted = r.give_slots(keys)
            slots, ov, loads, missing, _ = gather(
                cands, r.slot_map if slotted else r.load_alone(keys), m if slotted else None,
                local)
        if loads is not None:
            return slots, ov, loads[0], loads[2], slotted
        queued, _, running = load_columns(cands)
        return (slots, ov, np.ascontiguousarray(queued), np.ascontiguousarray(running),
                slotted)

    def _ttft(self, work: float, running: float, r: Any) -> float:
        """:func:`motor._fast.pairs.pick_pair`'s ``ttft`` of one instance, seconds."""
        steps = max(1.0, math.ceil(work / self.chunk_tokens))
        return float(steps * (r[0] + r[2] * running) + r[1] * work)

    def decode_for(self, info: RequestInfo, p: EndpointState, ds: list[EndpointState],
                   mode: str = "", reason: str | None = None) -> Choice | None:
        """The cheapest pair with a prefill done (or running) on ``p`` (its ``d``: the
        decode instance); the approximate index learns that ``d`` will hold the prompt.
        ``mode`` / ``reason``: the debug line's (the plan's reason: the pair was chosen over
        the local choices then). None when ``ds`` is empty."""
        ch = self.choose(info, [p], ds, False, mode, reason)
        if ch is None:
            return None
        self.router.routed(ch.d, info.model, info.block_hashes)
        return ch

    def routed(self, ch: Choice, info: RequestInfo, decode: bool = True) -> None:
        """The choice was sent: the approximate index learns that the legs' instances
        hold the prompt (D holds it after the transfer too). ``decode`` false: a pair's
        decode instance is chosen again later (:meth:`decode_for` tells the index then)."""
        if ch.p is not None:
            self.router.routed(ch.p, info.model, info.block_hashes)
        if decode or ch.p is None:
            self.router.routed(ch.d, info.model, info.block_hashes)

    def watch(self, obs: tuple[int, tuple[float, float, float]] | None) -> TtftWatch | None:
        """The learner of a prefill leg's observed time (its whole answer)."""
        if obs is None:
            return None
        return TtftWatch(self.rates, obs[0], obs[1])

    def _log(self, mode: str, info: RequestInfo, ch: Choice, ps: list[EndpointState],
             ds: list[EndpointState], p_unc: Any, p_queued: Any, p_running: Any, pr: Any,
             d_unc: Any, d_queued: Any, d_running: Any, pair_s: float, local_s: float,
             handoff: float = 0.0) -> None:
        terms = [f"P {e.key}: uncached {p_unc[i]:.0f} tokens, queued {p_queued[i]:.0f} "
                 f"tokens, running {p_running[i]:.0f}, rates {1e3 * pr[i, 0]:.2f} ms/step "
                 f"{1e6 * pr[i, 1]:.1f} us/token {1e6 * pr[i, 2]:.0f} us/seq"
                 for i, e in enumerate(ps)]
        terms += [f"D {e.key}: uncached {d_unc[i]:.0f} tokens, queued {d_queued[i]:.0f} "
                  f"tokens, running {d_running[i]:.0f}" for i, e in enumerate(ds)]
        if ch.p is not None:
            xfer = self.transfer_s[closeness(ch.p, ch.d, self.labels)]
            what = (f"pair {ch.p.key} -> {ch.d.key} (transfer {ch.d_uncached} tokens x "
                    f"{1e6 * xfer:.2f} us = {1e3 * xfer * ch.d_uncached:.2f} ms, hand-off "
                    f"{1e3 * handoff:.2f} ms)")
        else:
            what = f"{ch.d.key} alone"
        logger.debug("pd joint choice %s: %d prompt tokens, %d max tokens -> %s, %s; "
                     "predicted %.2f ms (best pair %.2f ms, best local %.2f ms); %s", mode,
                     info.prompt_tokens, info.max_tokens, what, ch.reason, 1e3 * ch.cost_s,
                     1e3 * pair_s, 1e3 * local_s, "; ".join(terms))


__all__ = ["CACHED_SHARE", "LOCAL", "OTHER", "PAIR", "SAME_NODE", "SAME_RACK", "Choice",
           "PairChooser", "closeness"]

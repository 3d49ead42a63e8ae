"""Per-instance rates of the TTFT model (``coordinator.kv.cost: time``), learned online.

The model (:func:`motor._fast.scoring.pick_ttft`, docs/kv-routing.md "Cost") predicts a
request's TTFT on instance ``i`` as a linear function of three features fixed at routing
time::

    x = (steps, steps * running, work)          engine steps, sequence-steps, tokens
    ttft = theta . x                            seconds
    theta = (step_s, decode_s_per_seq, prefill_s_per_token)

where ``work`` = prefill tokens queued on ``i`` + the request's uncached tokens, ``steps`` =
``max(1, ceil(work / chunk_tokens))`` and ``running`` = sequences in ``i``'s batch. (The
scorer's ``rates`` columns are ``(step_s, prefill_s_per_token, decode_s_per_seq)``:
:meth:`RateModel.rates` reorders.)

Learning: exponentially weighted least squares with a fixed prior, per instance slot::

    A <- lam * A + x x^T        b <- lam * b + x y          (y: observed TTFT, seconds)
    theta = (A + L0)^-1 (b + L0 theta0),   L0 = prior_weight * diag(1, 8**2, 1000**2)

with ``lam = 0.5 ** (1 / halflife_requests)``: an observation's weight halves after
``halflife_requests`` newer ones; the prior ``theta0`` (``coordinator.kv.ttft``) weighs as
``prior_weight`` observations at 1 step, 8 sequences and 1000 tokens, and is what an
instance without observations (or a new one) is priced with. Each rate is kept at >= 1 %
of its prior (a fit never makes an instance free). Observed TTFT: the time from sending
the request to the engine to its first token (streams) or to the whole answer (the
client's first byte, as ``motor_coordinator_ttft_seconds`` counts it); failed attempts
are not observed.

Against the cold-start divergence (issue 19; docs/benchmarks.md, "PD routing"): the first
wave of requests lands on an instance all at once, their TTFTs hold queueing the features
explain badly (the wave shares the engine's steps), and a fit to those few observations
alone priced one of two identical instances far slower; the router then avoided it, so it
got no observations to correct the fit. Hence shrinkage toward the pooled fit
(``pool_weight``): each slot's fit has the pooled fit of every slot this model observes as
its prior, weighing ``pool_weight`` average observations of the pool::

    A_pool = sum_i A_i    b_pool = sum_i b_i    n_pool = sum_i n_i   (n_i <- lam n_i + 1)
    theta_pool = (A_pool + L0)^-1 (b_pool + L0 theta0)
    K = pool_weight * A_pool / n_pool
    theta_i = (A_i + L0 + K)^-1 (b_i + L0 theta0 + K theta_pool)

so the pool's share of a slot's fit falls as the slot's own observations grow (about
``pool_weight / (pool_weight + n_i)``; ``n_i`` tends to ~1.44 x ``halflife_requests``): an
avoided instance is priced near its peers, one that is really slower stays slower (in
``tests/unit/coordinator/test_kv_ttft_burst.py`` a 1.5x slower one is learned about 4 %
off its truth, the test allows 15 %). ``pool_weight`` 0 is each fit alone. The pool is every slot of this model
(``kv_affinity``: its candidates; the PD joint choice: the prefill instances, the only
ones it fits), so instances of different engines behind one policy pull each other's fits
by that prior too. Every slot's prior moves with the pool: all active slots are refit
every :data:`REFIT_EVERY` observations of the model (one batched solve), the observed slot
at each (against the pool as of the last refit). A Huber-like down-weighting of
observations far off the slot's prediction was tried and dropped: it protected the
burst-skewed fit from the observations that would correct it (PD benchmark, debug log).

Everything here is plain Python / numpy state of one worker process, updated at request
end (first token); with ``coordinator.workers`` > 1 each worker learns from its own
requests.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from motor.config.schema import KvTtftConfig

#: feature scales of the prior's weight (1 step, 8 sequence-steps, 1000 tokens)
PRIOR_SCALE = (1.0, 8.0, 1000.0)
#: each learned rate stays >= this share of its prior
FLOOR = 0.01
#: with ``pool_weight``: every slot's rates are refit to the pool (its prior moved) every
#: this many observations of the model; in between, an observation refits its own slot
#: against the pool's prior as of the last refit
REFIT_EVERY = 16
#: observations above this TTFT (s) are clipped (a stuck request is no rate)
MAX_TTFT_S = 600.0


class RateModel:
    """Learned ``(step_s, decode_s_per_seq, prefill_s_per_token)`` per instance slot.

    Each slot's exponentially weighted least-squares fit is shrunk toward the pooled fit
    of all observed slots (``pool_weight`` average observations, less as the slot's own
    accumulate): identical instances do not learn far apart from the cold-start burst,
    really slower ones stay slower (the module docstring has the formulas). One :meth:`observe` is one 3x3 solve and a
    few small numpy updates; each :data:`REFIT_EVERY`-th adds a batched refit of every
    active slot.

    Parameters
    ----------
    cfg : KvTtftConfig
        ``coordinator.kv.ttft`` (prior rates, half-life, prior and pool weights, chunk size).
    n_slots : int
        Instance slots (:data:`motor.coordinator.kv.router.MAX_INSTANCES`).
    """

    def __init__(self, cfg: KvTtftConfig | None = None, n_slots: int = 256) -> None:
        self.cfg = c = cfg or KvTtftConfig()
        self.chunk_tokens = float(c.chunk_tokens)
        self.lam = 0.5 ** (1.0 / c.halflife_requests)
        #: prior (step_s, decode_s_per_seq, prefill_s_per_token)
        self.theta0 = np.array([c.step_ms * 1e-3, c.decode_us_per_seq * 1e-6,
                                c.prefill_us_per_token * 1e-6], np.float64)
        self.l0 = c.prior_weight * np.diag(np.square(np.array(PRIOR_SCALE)))
        self.l0_theta0 = self.l0 @ self.theta0
        self.floor = FLOOR * self.theta0
        self._a = np.zeros((n_slots, 3, 3), np.float64)
        self._b = np.zeros((n_slots, 3), np.float64)
        self.n_obs = np.zeros(n_slots, np.int64)
        # the scorer's column order: (step_s, prefill_s_per_token, decode_s_per_seq)
        self._rates = np.empty((n_slots, 3), np.float64)
        self._rates[:] = self.theta0[[0, 2, 1]]
        #: shrinkage toward the pooled fit (``pool_weight``), effective observations per slot
        self.pool_weight = float(c.pool_weight)
        self._w = np.zeros(n_slots, np.float64)
        self._a_pool = np.zeros((3, 3), np.float64)
        self._b_pool = np.zeros(3, np.float64)
        self._active = np.zeros(0, np.intp)          # slots with observations
        #: the pool's prior as of the last full refit (L0 + K, L0 theta0 + K theta_pool)
        self._l0_k, self._rhs_k = self.l0, self.l0_theta0
        self._since_refit = 0

    # -- reads --------------------------------------------------------------------------
    def rates(self, slots: npt.NDArray[np.intp]) -> npt.NDArray[np.float64]:
        """float64[k, 3], C-contiguous: ``(step_s, prefill_s_per_token, decode_s_per_seq)``
        of each slot, the scorer's ``rates`` argument."""
        out: npt.NDArray[np.float64] = self._rates.take(slots, axis=0)
        return out

    def theta(self, slot: int) -> tuple[float, float, float]:
        """``(step_s, decode_s_per_seq, prefill_s_per_token)`` of ``slot``, seconds."""
        r = self._rates[slot]
        return float(r[0]), float(r[2]), float(r[1])

    def features(self, queued_tokens: float, uncached_tokens: float, running: float
                 ) -> tuple[float, float, float]:
        """``x = (steps, steps * running, work)`` of a request (see the module docstring)."""
        work = queued_tokens + uncached_tokens
        steps = max(1.0, math.ceil(work / self.chunk_tokens))
        return steps, steps * running, work

    # -- learning -----------------------------------------------------------------------
    def observe(self, slot: int, x: Sequence[float], ttft_s: float) -> None:
        """One observed TTFT (seconds) of a request routed to ``slot`` with features ``x``
        (:meth:`features` at routing time): refit the slot's rates."""
        if not ttft_s > 0.0:
            return
        y = min(ttft_s, MAX_TTFT_S)
        xv = np.asarray(x, np.float64)
        a = self._a[slot]
        b = self._b[slot]
        lam = self.lam
        if self.pool_weight > 0.0:      # the pool: sums of the slots' sums, kept in step
            self._a_pool += (lam - 1.0) * a
            self._b_pool += (lam - 1.0) * b
        a *= lam
        xx = np.outer(xv, xv)
        a += xx
        b *= lam
        xy = xv * y
        b += xy
        self._w[slot] = lam * self._w[slot] + 1.0
        if self.n_obs[slot] == 0:
            # not np.union1d: its first call in a process (np.unique's) takes ~30 ms, on the
            # loop that relays the other requests' first tokens
            self._active = np.sort(np.append(self._active, np.intp(slot)))
        self.n_obs[slot] += 1
        if self.pool_weight <= 0.0:
            theta = np.linalg.solve(a + self.l0, b + self.l0_theta0)
            np.maximum(theta, self.floor, out=theta)
            self._rates[slot] = theta[[0, 2, 1]]
            return
        self._a_pool += xx
        self._b_pool += xy
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY or self.n_obs[slot] == 1:
            self._refit()
            return
        theta = np.linalg.solve(a + self._l0_k, b + self._rhs_k)
        np.maximum(theta, self.floor, out=theta)
        self._rates[slot] = theta[[0, 2, 1]]

    def _refit(self) -> None:
        """Every active slot's rates from its sums and the pool's (the module docstring):
        the pool's 3x3 solve and a batched one over the active slots (the pool moved, so
        did every slot's prior)."""
        self._since_refit = 0
        act = self._active
        if not len(act):
            self._l0_k, self._rhs_k = self.l0, self.l0_theta0
            return
        theta_pool = np.linalg.solve(self._a_pool + self.l0, self._b_pool + self.l0_theta0)
        k = (self.pool_weight / float(self._w[act].sum())) * self._a_pool
        self._l0_k = self.l0 + k
        self._rhs_k = self.l0_theta0 + k @ theta_pool
        lhs = self._a[act] + self._l0_k
        rhs = self._b[act] + self._rhs_k
        theta = np.linalg.solve(lhs, rhs[:, :, None])[:, :, 0]
        np.maximum(theta, self.floor, out=theta)
        self._rates[act] = theta[:, [0, 2, 1]]

    def reset(self, slot: int) -> None:
        """Forget ``slot``'s observations (its endpoint left; the slot may be reused)."""
        if self.n_obs[slot]:
            self._a_pool -= self._a[slot]
            self._b_pool -= self._b[slot]
            self._active = self._active[self._active != slot]
        self._a[slot] = 0.0
        self._b[slot] = 0.0
        self._w[slot] = 0.0
        self.n_obs[slot] = 0
        self._rates[slot] = self.theta0[[0, 2, 1]]
        if self.pool_weight > 0.0:
            self._refit()


class TtftWatch:
    """Feeds one request's observed TTFT to the rate model (:meth:`observe`, called once by
    :class:`motor.coordinator.endpoints.Lease` at the first token or whole answer)."""

    __slots__ = ("model", "slot", "x")

    def __init__(self, model: RateModel, slot: int, x: tuple[float, float, float]) -> None:
        self.model = model
        self.slot = slot
        self.x = x

    def __call__(self, ttft_s: float) -> None:
        self.model.observe(self.slot, self.x, ttft_s)


def engine_columns(cands: Sequence[Any], now: float, max_age_s: float
                   ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """(waiting, running) requests the engines last reported (the multi-worker load table's
    engine figures, scraped from their /metrics), float64[k] each, 0 where the figures are
    older than ``max_age_s`` seconds; None when the candidates have no shared cells (one
    worker: there is no scrape)."""
    k = len(cands)
    if not k or any(getattr(e, "shared", None) is None for e in cands):
        return None
    table = cands[0].shared.table
    slots = np.fromiter((e.shared.slot for e in cands), np.intp, k)
    eng = table.engine[slots]           # a torn read is one scrape's staleness at most
    fresh = (now - eng[:, 3]) <= max_age_s
    waiting = np.where(fresh, eng[:, 0], 0.0)
    running = np.where(fresh, eng[:, 1], 0.0)
    return np.ascontiguousarray(waiting), np.ascontiguousarray(running)


__all__ = ["RateModel", "TtftWatch", "engine_columns"]

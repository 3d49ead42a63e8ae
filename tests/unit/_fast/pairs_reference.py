"""Pure-Python reference of :func:`motor._fast.pairs.pick_pair` (same formula, same
tie-break), for the compiled-vs-reference tests."""
from __future__ import annotations

import math
from collections.abc import Sequence


def _ttft(work: float, running: float, r: Sequence[float], chunk: float) -> float:
    steps = max(1.0, math.ceil(work / chunk))
    return steps * (r[0] + r[2] * running) + r[1] * work


def _decode(rd: Sequence[float], running: float, decode_tokens: float,
            stall_weight: float) -> float:
    # this request's decode steps + the delay they impose on the running sequences
    return decode_tokens * (rd[0] + rd[2] * (running + 1.0) + stall_weight * running * rd[2])


def pair_cost(p_work, p_running, p_rates, d_queued, d_uncached, d_running, d_rates, xfer,
              p: int, d: int, decode_tokens: float, chunk: float,
              stall_weight: float = 0.0, p_uncached=None, handoff_s: float = 0.0) -> float:
    rd = d_rates[d]
    pre = _ttft(p_work[p], p_running[p], p_rates[p], chunk)
    if p_uncached is not None and stall_weight > 0.0:
        pre = pre + stall_weight * p_running[p] * p_rates[p][1] * p_uncached[p]
    dec = _decode(rd, d_running[d], decode_tokens, stall_weight)
    first_d = rd[0] + rd[2] * d_running[d] + rd[1] * d_queued[d]
    return pre + xfer[p][d] * d_uncached[d] + (first_d + dec) + handoff_s


def local_cost(d_queued, d_uncached, d_running, d_rates, d: int, decode_tokens: float,
               chunk: float, stall_weight: float) -> float:
    rd = d_rates[d]
    dec = _decode(rd, d_running[d], decode_tokens, stall_weight)
    return (_ttft(d_queued[d] + d_uncached[d], d_running[d], rd, chunk)
            + stall_weight * d_running[d] * rd[1] * d_uncached[d] + dec)


def pick_pair(p_work, p_running, p_rates, d_queued, d_uncached, d_running, d_rates, xfer,
              decode_tokens=0.0, chunk_tokens=8192.0, local=False, stall_weight=0.0,
              start=0, p_uncached=None, handoff_s=0.0):
    P, D = len(p_work), len(d_queued)
    best, bp, bd = math.inf, -1, -1
    n = P * D
    for i in range(n):
        j = (start % n + i) % n
        p, d = divmod(j, D)
        c = pair_cost(p_work, p_running, p_rates, d_queued, d_uncached, d_running, d_rates,
                      xfer, p, d, decode_tokens, chunk_tokens, stall_weight, p_uncached,
                      handoff_s)
        if c < best:
            best, bp, bd = c, p, d
    lbest, ld = math.inf, -1
    if local and D:
        for i in range(D):
            d = (start % D + i) % D
            c = local_cost(d_queued, d_uncached, d_running, d_rates, d, decode_tokens,
                           chunk_tokens, stall_weight)
            if c < lbest:
                lbest, ld = c, d
    if ld >= 0 and lbest < best:
        return -1, ld, lbest, best, lbest
    if bp >= 0:
        return bp, bd, best, best, lbest
    return -1, -1, math.inf, math.inf, math.inf

"""What no router can change: the first wave of a closed-loop multi-turn run (issue 19).

A closed loop at concurrency ``c`` starts with ``c`` conversations' first turns at once:
``c`` prompts of ``--prompt-tokens`` uncached tokens each (a 2048-token system prompt and the
first user turn with the chat template: 2205 in ``bench/bench_kv_routing.py``), cached
nowhere. Whatever the router does, it splits them over the ``n`` instances; each instance
then runs the sim's (and vLLM V1's) scheduler on its share: FIFO, chunked prefill with at
most ``--budget`` tokens a step (``max_num_batched_tokens``), a request's first token at the
end of the step that computes its last prompt token, and the step time of the sim's timing
model (``--step-fixed-ms`` + ``--prefill-token-us`` per prefill token +
``--decode-token-us`` per decoding sequence).

For every split (compositions of ``c`` into ``n`` parts, instances alike) this computes the
wave's engine-side TTFTs and prints, per concurrency, the smallest achievable

* p99 TTFT of the run (``--requests`` requests, numpy's linear interpolation): the run's
  p99 is at least the value it would have with the wave's TTFTs as the largest ones and
  every other request at 0 ms;
* share of the run's mean TTFT (the wave's TTFT sum / ``--requests``);

with the split that reaches it. Client TTFT adds the coordinator and HTTP time on top.

Run::

    .venv/bin/python bench/kv_first_wave_bound.py [--concurrency 4,8,16]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import numpy as np


def splits(c: int, n: int, most: int | None = None) -> Iterator[tuple[int, ...]]:
    """Partitions of ``c`` requests over ``n`` alike instances (non-increasing parts)."""
    most = c if most is None else most
    if n == 1:
        if c <= most:
            yield (c,)
        return
    for first in range(min(c, most), -1, -1):
        if first * n < c:
            break
        for rest in splits(c - first, n - 1, first):
            yield (first,) + rest


def wave_ttfts(k: int, prompt: int, budget: int, fixed_ms: float, prefill_us: float,
               decode_us: float) -> list[float]:
    """Engine TTFTs (ms) of ``k`` prompts of ``prompt`` tokens arriving together at one idle
    instance: FIFO chunked prefill of ``budget`` tokens a step, decoding sequences first."""
    left = [prompt] * k
    out = [0.0] * k
    t = 0.0
    decoding = 0
    while any(left):
        room = budget - decoding       # decoding sequences take one token each first
        n_pre = 0
        done = []
        for i in range(k):
            if left[i] and room > 0:
                take = min(left[i], room)
                left[i] -= take
                room -= take
                n_pre += take
                if not left[i]:
                    done.append(i)
        t += fixed_ms + prefill_us * 1e-3 * n_pre + decode_us * 1e-3 * decoding
        for i in done:
            out[i] = t
        decoding += len(done)
    return out


def wave_splits(c: int, n: int, prompt: int, budget: int, fixed_ms: float,
                prefill_us: float, decode_us: float) -> Iterator[tuple[tuple[int, ...],
                                                                   list[float]]]:
    """Every split of a wave of ``c`` first turns over ``n`` instances with its engine
    TTFTs (ms, :func:`wave_ttfts` per instance)."""
    for sp in splits(c, n):
        ttfts: list[float] = []
        for k in sp:
            ttfts += wave_ttfts(k, prompt, budget, fixed_ms, prefill_us, decode_us)
        yield sp, ttfts


def run_bound(floors: list[float], wave: int, wave_prompt: int, n: int, budget: int,
              fixed_ms: float, prefill_us: float, decode_us: float) -> tuple[float, float]:
    """Least engine-side (mean, p99) TTFT (ms) of a run whose requests after the first wave
    have TTFTs of at least ``floors`` (ms each) and whose first ``wave`` requests are
    simultaneous first turns of ``wave_prompt`` uncached tokens, over every split of the
    wave on ``n`` instances."""
    best_mean = best_p99 = float("inf")
    for _, ttfts in wave_splits(wave, n, wave_prompt, budget, fixed_ms, prefill_us, decode_us):
        run = np.asarray(ttfts + floors)
        best_mean = min(best_mean, float(run.mean()))
        best_p99 = min(best_p99, float(np.percentile(run, 99)))
    return best_mean, best_p99


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="4,8,16")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=2205)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--step-fixed-ms", type=float, default=6.0)
    p.add_argument("--prefill-token-us", type=float, default=37.0)
    p.add_argument("--decode-token-us", type=float, default=100.0)
    a = p.parse_args()
    print(f"{a.instances} instances, first turns of {a.prompt_tokens} uncached tokens, "
          f"{a.requests} requests a run, step {a.step_fixed_ms} ms + {a.prefill_token_us} "
          f"us/prefill token + {a.decode_token_us} us/decoding sequence, budget {a.budget}\n")
    print("| concurrency | least p99 TTFT of the run (ms) | split | least share of the mean "
          "TTFT (ms) | split |")
    print("|---|---|---|---|---|")
    for c in (int(x) for x in a.concurrency.split(",")):
        best_p99: tuple[float, tuple[int, ...]] = (float("inf"), ())
        best_mean = best_p99
        for sp, ttfts in wave_splits(c, a.instances, a.prompt_tokens, a.budget,
                                     a.step_fixed_ms, a.prefill_token_us, a.decode_token_us):
            run = np.zeros(max(a.requests, len(ttfts)))
            run[:len(ttfts)] = ttfts
            p99 = float(np.percentile(run, 99))
            mean = float(sum(ttfts)) / a.requests
            best_p99 = min(best_p99, (p99, sp))
            best_mean = min(best_mean, (mean, sp))
        print(f"| {c} | {best_p99[0]:.1f} | {'/'.join(map(str, best_p99[1]))} | "
              f"{best_mean[0]:.1f} | {'/'.join(map(str, best_mean[1]))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

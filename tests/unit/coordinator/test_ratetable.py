"""The shared rate-limit table (``coordinator.workers > 1``): every key's limit holds for all the
workers together, each counting in its own row (fake clocks; two processes in lockstep)."""
from __future__ import annotations

import math
import multiprocessing
import os
import random

import pytest

from motor.coordinator.ratelimit import Limit, RateLimiter
from motor.coordinator.ratetable import BUCKET_S, N_BUCKETS, RateTable, SharedRateLimiter
from tests.support.ratetable_worker import StepClock, greedy

T0 = 1000.0


@pytest.fixture
def table_name(request):
    name = f"motor-test-rate-{os.getpid()}-{request.node.name[:40]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def limiters(table_name, workers, limits, default=None, n_hashed=16, clock=None):
    t = RateTable.create(table_name, workers, len([n for n, lim in limits.items()
                                                   if lim.rpm or lim.tpm]), n_hashed)
    clock = clock or StepClock(T0)
    default = default or Limit()
    return t, clock, [SharedRateLimiter(limits, default, 1.0, t if w == 0 else
                                        RateTable.attach(table_name), w, clock=clock)
                      for w in range(workers)]


def admit_greedily(rl, name, tokens=0):
    n = 0
    while rl.admit(name, tokens) is None:
        n += 1
    return n


def test_two_processes_hold_the_limit_together_within_one_request_per_worker(table_name):
    limits = {"a": Limit(rpm=600)}                  # 10 / s, burst 1 s = 10 requests
    t = RateTable.create(table_name, 2, 1)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(2)
        result = ctx.Array("q", 2)
        steps, step_s = 3000, 0.02                   # 60 s of the fake clock
        procs = [ctx.Process(target=greedy, args=(table_name, w, limits, "a", T0, steps,
                                                   step_s, barrier, result))
                 for w in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        per_worker = list(result)
        total = sum(per_worker)
        elapsed = (steps - 1) * step_s
        # the one-process bound (rate x time + one burst), 1/8 s of the rate for the bucket
        # granularity, and one request per other worker (two admitting at the same instant)
        assert 10 * elapsed <= total <= 10 * elapsed + 10 + math.ceil(10 * BUCKET_S) + 1
        assert min(per_worker) > 0 and all(t.used[w].sum() > 0 for w in range(2))
    finally:
        t.close()
        t.unlink()


def test_a_worker_alone_gets_the_whole_limit_and_the_other_sees_it(table_name):
    t, clock, (w0, w1) = limiters(table_name, 2, {"a": Limit(rpm=600)})
    n = admit_greedily(w0, "a")
    end = clock.t + 60.0
    while clock.t < end:
        clock.t += 0.01
        n += admit_greedily(w0, "a")
    assert 600 <= n <= 600 + 10 + math.ceil(10 * BUCKET_S)   # not 1 / workers of it
    refused = w1.admit("a", 0)                  # the other worker's view is the same bucket
    assert refused is not None and refused[1] == "requests" and 0 < refused[0] <= 0.1
    h = dict(refused[2])
    assert h[b"x-ratelimit-limit-requests"] == b"600"
    assert h[b"x-ratelimit-remaining-requests"] == b"0"
    assert w1.peek("a") is not None
    clock.t += 1.0                               # a burst later either worker may take it
    assert admit_greedily(w1, "a") == 10
    assert w0.peek("a") is not None
    t.close()


def test_same_decisions_as_the_in_process_bucket_within_the_granularity(table_name):
    t, clock, (shared,) = limiters(table_name, 1, {"a": Limit(rpm=300, tpm=30000)})
    local = RateLimiter({"a": Limit(rpm=300, tpm=30000)}, clock=clock)
    rng = random.Random(7)
    got = {"shared": 0, "local": 0}
    end = clock.t + 60.0
    while clock.t < end:
        tokens = rng.randrange(0, 200)
        for label, rl in (("shared", shared), ("local", local)):
            got[label] += rl.admit("a", tokens) is None
        clock.t += rng.expovariate(20.0)         # offered ~4x the limit, in random bursts
    # the shared view checks windows from bucket boundaries only: at most 1/8 s of the rate
    # more (and the two histories then differ by that much)
    assert abs(got["shared"] - got["local"]) <= math.ceil(5 * BUCKET_S) + 1
    t.close()


def test_settle_corrects_the_tokens_in_the_admission_bucket_for_every_worker(table_name):
    t, clock, (w0, w1) = limiters(table_name, 2, {"a": Limit(tpm=6000)})   # 100 / s
    assert w0.admit("a", 300) is None            # 200 tokens of debt, for both workers
    refused = w1.admit("a", 1)
    assert refused is not None and refused[1] == "tokens" and 1.9 < refused[0] <= 2.0
    clock.t += 0.5
    w0.settle("a", 300, 50)                      # the engine used 50
    assert w1.admit("a", 1) is None
    # as the one-process bucket: -150 + 250, capped at the burst (100), then 1 taken
    assert dict(w1.headers("a"))[b"x-ratelimit-remaining-tokens"] == b"99"
    w1.settle("a", 1, None)                      # unknown usage: the estimate stands
    # a request whose admission bucket left the ring: a larger count is charged now
    assert w0.admit("a", 10) is None
    clock.t += N_BUCKETS * BUCKET_S
    w0.settle("a", 10, 500)
    assert w1.admit("a", 1) is not None
    t.close()


def test_hashed_names_share_slots_by_tag_and_fall_back_when_the_window_is_full(table_name):
    t, clock, (w0, w1) = limiters(table_name, 2, {}, default=Limit(rpm=60), n_hashed=1)
    assert w0.admit("x", 0) is None and w1.admit("x", 0) is not None   # shared: one slot
    clock.t += 1.0
    assert w1.admit("x", 0) is None and w0.admit("x", 0) is not None   # both rows hold x
    # the one slot of y's window is x's in both rows: each worker limits y alone, at 1/2
    assert w0.admit("y", 0) is None and w1.admit("y", 0) is None
    clock.t += 1.0
    assert w0.admit("y", 0) is not None          # 0.5 / s: not yet
    clock.t += N_BUCKETS * BUCKET_S              # x unused for a whole ring: its slot frees
    assert w0.admit("y", 0) is None              # y now has the slot...
    assert w1.admit("y", 0) is not None          # ...in both rows, and one limit
    t.close()


def test_restarted_worker_row_is_reset_and_layout_checked(table_name):
    t, clock, (w0, w1) = limiters(table_name, 2, {"a": Limit(rpm=60)})
    assert w0.admit("a", 0) is None and w1.admit("a", 0) is not None
    t.reset_row(0)                               # the supervisor, before the successor starts
    fresh = SharedRateLimiter({"a": Limit(rpm=60)}, Limit(), 1.0, t, 0, clock=clock)
    assert w1.admit("a", 0) is None and fresh.admit("a", 0) is not None
    with pytest.raises(ValueError, match="reserved"):
        SharedRateLimiter({}, Limit(rpm=5), 1.0, t, 0, clock=clock)
    with pytest.raises(FileExistsError):
        RateTable.create(table_name, 2, 1)
    t.close()
    os.unlink(f"/dev/shm/{table_name}")
    with open(f"/dev/shm/{table_name}", "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a motor rate table"):
        RateTable.attach(table_name)

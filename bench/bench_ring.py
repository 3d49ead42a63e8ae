"""Benchmarks for motor._fast.ring.Ring across two processes.

Budget (issue 3): >= 5 M records/s for 64-byte records across two processes
(one producer process, one consumer process, each on its own core).

What is measured: the consumer (this process) times from telling the producer
process to start until it has popped N records of 64-byte payload (72 bytes in
the ring with the header). ``api=single`` uses one ``try_push`` / ``pop`` call per
record; ``api=batch`` uses ``push_many`` (64 records per call) and
``pop_many(256)``. Ring capacity 1 MiB. ``extra_info["records_per_s"]`` is N / median.

Run::

    .venv/bin/python -m pytest bench/bench_ring.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
import multiprocessing
import os
import runpy
import uuid

import pytest

from motor._fast.ring import RECORD_USER, Ring

pytestmark = pytest.mark.fast_core

N = 200_000
PAYLOAD = 64
CAPACITY = 1 << 20
HERE = os.path.abspath(__file__)


def _producer_loop(name, conn):
    """Child process: on ("run", n, api) push n records, then report done."""
    r = Ring.attach(name)
    payload = bytes(range(PAYLOAD))
    batch = [payload] * 64
    try_push = r.try_push
    push_many = r.push_many
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, n, api = cmd
        if api == "single":
            for _ in range(n):
                while not try_push(RECORD_USER, payload):
                    pass
        else:
            left = n
            while left:
                k = push_many(RECORD_USER, batch if left >= 64 else batch[:left])
                left -= k
        conn.send("done")
    r.close()


@pytest.fixture(scope="module")
def pair():
    name = f"motor-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ring = Ring.create(name, CAPACITY)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=runpy.run_path, args=(HERE,), kwargs=dict(
        init_globals=dict(RING_NAME=name, CONN=child), run_name="__ring_producer__"))
    proc.start()
    yield ring, parent
    parent.send(("stop",))
    proc.join(10)
    ring.unlink()
    ring.close()


def _consume_single(ring, conn, n):
    conn.send(("run", n, "single"))
    pop = ring.pop
    got = 0
    while got < n:
        if pop() is not None:
            got += 1
    assert conn.recv() == "done"


def _consume_batch(ring, conn, n):
    conn.send(("run", n, "batch"))
    pop_many = ring.pop_many
    got = 0
    while got < n:
        got += len(pop_many(256))
    assert conn.recv() == "done"


@pytest.mark.parametrize("api", ["single", "batch"])
def test_two_process_throughput(benchmark, rate, pair, api):
    benchmark.group = "ring.two_process"
    benchmark.name = f"ring[records={N},payload_bytes={PAYLOAD},capacity=1MiB,api={api}]"
    ring, conn = pair
    fn = _consume_single if api == "single" else _consume_batch
    benchmark.pedantic(fn, (ring, conn, N), rounds=7, iterations=1, warmup_rounds=1)
    rate("records_per_s", N)
    assert ring.used_bytes == 0 and ring.overflows == 0


def test_single_process_push_pop(benchmark):
    """One process, push then pop of one 64-byte record (call overhead, no sharing)."""
    benchmark.group = "ring.one_process"
    benchmark.name = f"ring[payload_bytes={PAYLOAD},push+pop]"
    name = f"motor-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ring = Ring.create(name, CAPACITY)
    payload = bytes(PAYLOAD)
    try:
        def one():
            ring.push(RECORD_USER, payload)
            return ring.pop()
        benchmark(one)
    finally:
        ring.unlink()
        ring.close()


if __name__ == "__ring_producer__":
    _producer_loop(RING_NAME, CONN)  # noqa: F821 (injected by runpy)

"""motor._fast.ring.Ring: framing, wrap, full/empty, overflow markers, compiled vs
reference on random sequences, and two real processes (lagging consumer, producer
that fills the ring)."""
from __future__ import annotations

import multiprocessing
import os
import runpy
import struct
import time
import uuid
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast import ring
from motor._fast.ring import Ring
from . import reference as ref

USER = ring.RECORD_USER


def fresh_name() -> str:
    return f"motor-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class _RefRing(ref.Ring):
    """Reference ring with the handle API used by the behaviour tests."""

    def close(self):
        pass


@pytest.fixture(params=["compiled", "reference"])
def make_ring(request):
    """Yields a factory ``make_ring(capacity)`` for the implementation under test."""
    made = []

    def factory(capacity):
        if request.param == "reference":
            return _RefRing(capacity)
        r = Ring.create(fresh_name(), capacity)
        made.append(r)
        return r

    yield factory
    for r in made:
        r.unlink()
        r.close()


def test_constants_are_pinned():
    assert (ring.RECORD_PAD, ring.RECORD_OVERFLOW, ring.RECORD_USER) == (0, 1, 16)
    assert ring.HEADER_BYTES == 512


def test_push_pop_peek_in_order(make_ring):
    r = make_ring(1024)
    assert r.pop() is None and r.peek() is None
    assert r.push(USER, b"one")
    assert r.push(USER + 1, bytearray(b"two!"))
    assert r.push(USER + 2, memoryview(b""))
    assert r.used_bytes == 16 + 16 + 8
    assert r.peek() == (USER, b"one")
    assert r.pop() == (USER, b"one")
    assert r.pop() == (USER + 1, b"two!")
    assert r.pop() == (USER + 2, b"")
    assert r.pop() is None
    assert r.used_bytes == 0


def test_wraparound_inserts_a_pad_and_keeps_records_whole(make_ring):
    r = make_ring(128)
    for i in range(40):
        payload = bytes([i]) * (i % 41)
        assert r.push(USER, payload), i
        assert r.pop() == (USER, payload)
    assert r.used_bytes == 0
    if isinstance(r, Ring):
        assert r._debug_pads > 0
        assert (r._debug_checks > 0) if ring.DEBUG else (r._debug_checks == 0)


def test_full_ring_drops_counts_and_marks_the_gap(make_ring):
    r = make_ring(256)
    pushed = 0
    while r.push(USER, struct.pack("<Q", pushed) + b"x" * 24):   # 40-byte records
        pushed += 1
    assert pushed == 6 and r.overflows == 1 and r.pending_drops == 1
    assert not r.push(USER, b"lost too")
    assert r.overflows == 2
    first = [r.pop() for _ in range(2)]
    assert [struct.unpack_from("<Q", p)[0] for _, p in first] == [0, 1]
    assert r.push(USER, b"after the gap")
    assert r.pending_drops == 0
    rest = r.pop_many(100)
    assert [struct.unpack_from("<Q", p)[0] for _, p in rest[:4]] == [2, 3, 4, 5]
    assert rest[4] == (ring.RECORD_OVERFLOW, struct.pack("<Q", 2))
    assert rest[5] == (USER, b"after the gap")
    assert r.overflows == 2


def test_try_push_and_push_many_apply_backpressure_without_dropping(make_ring):
    r = make_ring(256)
    assert r.push_many(USER, [b"a" * 32] * 10) == 6
    assert r.try_push(USER, b"b")           # 16 bytes still fit
    assert not r.try_push(USER, b"b" * 9)
    assert r.overflows == 0 and r.pending_drops == 0
    assert len(r.pop_many(2)) == 2
    assert r.try_push(USER, b"b" * 9)
    assert [len(p) for _, p in r.pop_many()] == [32] * 4 + [1, 9]


def test_bad_arguments(make_ring):
    r = make_ring(256)
    with pytest.raises(ValueError, match="record_type"):
        r.push(ring.RECORD_OVERFLOW, b"x")
    with pytest.raises(ValueError, match="record_type"):
        r.push(2**32, b"x")
    with pytest.raises(ValueError, match="payload"):
        r.push(USER, b"x" * 121)      # 8 + 128 > 256 / 2
    assert r.push(USER, b"x" * 120)
    with pytest.raises(ValueError, match="capacity"):
        make_ring(100)
    with pytest.raises(ValueError, match="capacity"):
        make_ring(32)


def test_compiled_handle_errors_and_lifecycle():
    name = fresh_name()
    with pytest.raises(TypeError, match="Ring.create"):
        Ring()
    with pytest.raises(FileNotFoundError):
        Ring.attach(name)
    with pytest.raises(ValueError, match="name"):
        Ring.create("a/b", 1024)
    r = Ring.create(name, 1024)
    try:
        assert r.owner and r.capacity == 1024 and r.name == name
        with pytest.raises(FileExistsError):
            Ring.create(name, 1024)
        with pytest.raises(TypeError):
            r.push(USER, "not bytes")
        with Ring.attach(name) as a:
            assert not a.owner
            assert r.push(USER, b"hello")
            buf = bytearray(3)
            with pytest.raises(ValueError, match="buffer"):
                a.pop_into(buf)
            buf = bytearray(16)
            assert a.pop_into(buf) == (USER, 5)
            assert bytes(buf[:5]) == b"hello"
            assert a.pop_into(buf) is None
        assert a.closed
        with pytest.raises(ValueError, match="closed"):
            a.pop()
    finally:
        r.unlink()
        r.close()
    with pytest.raises(FileNotFoundError):
        r.unlink()


def test_attach_rejects_a_segment_that_is_not_a_ring():
    from multiprocessing import shared_memory
    name = fresh_name()
    shm = shared_memory.SharedMemory(name=name, create=True, size=4096)
    try:
        with pytest.raises(ValueError, match="not a motor ring"):
            Ring.attach(name)
    finally:
        shm.close()
        shm.unlink()


def test_shared_counters_are_visible_through_a_second_mapping():
    name = fresh_name()
    r = Ring.create(name, 256)
    try:
        with Ring.attach(name) as a:
            while r.push(USER, b"y" * 56):
                pass
            assert a.overflows == 1
            assert a.used_bytes == r.used_bytes == 256      # 4 records of 8 + 56
            assert a.tail == 256 and a.head == 0
            assert len(a.pop_many()) == 4
            assert r.head == 256 and r.free_bytes == 256
    finally:
        r.unlink()
        r.close()


# ------------------------------------------------------------ hypothesis

ops = st.lists(st.one_of(
    st.tuples(st.sampled_from(["push", "try_push"]), st.integers(USER, USER + 3),
              st.integers(0, 60)),
    st.tuples(st.just("push_many"), st.integers(USER, USER + 3),
              st.lists(st.integers(0, 60), max_size=5)),
    st.tuples(st.sampled_from(["pop", "peek"])),
    st.tuples(st.just("pop_many"), st.integers(0, 6)),
), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=ops, capacity=st.sampled_from([128, 256, 512]))
def test_random_sequences_agree_with_the_reference(ops, capacity):
    name = fresh_name()
    c = Ring.create(name, capacity)
    try:
        r = ref.Ring(capacity)
        counter = 0

        def outcome(fn, *args):
            try:
                return fn(*args)
            except ValueError as exc:   # oversized payload: same error, nothing written
                return ("ValueError", "payload" in str(exc))

        for op in ops:
            kind = op[0]
            if kind in ("push", "try_push"):
                counter += 1
                payload = bytes([counter % 256]) * op[2]
                got = outcome(getattr(c, kind), op[1], payload)
                want = outcome(getattr(r, kind), op[1], payload)
            elif kind == "push_many":
                payloads = [bytes([(counter + i) % 256]) * n for i, n in enumerate(op[2])]
                counter += len(payloads)
                got = outcome(c.push_many, op[1], payloads)
                want = outcome(r.push_many, op[1], payloads)
            elif kind == "pop_many":
                got, want = c.pop_many(op[1]), r.pop_many(op[1])
            else:
                got, want = getattr(c, kind)(), getattr(r, kind)()
            assert got == want, op
            assert (c.used_bytes, c.overflows, c.pending_drops, c.head, c.tail) == \
                (r.used_bytes, r.overflows, r.pending_drops, r.head, r.tail), op
        assert c.pop_many(10_000) == r.pop_many(10_000)
    finally:
        c.unlink()
        c.close()


# ------------------------------------------------------------ two processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_worker.py")


def _check(payload: bytes) -> int:
    seq, crc = struct.unpack_from("<QI", payload)
    assert zlib.crc32(payload[12:]) == crc, f"corrupt record {seq}"
    return seq


def _run_pair(n, lossless, lag_s, capacity, seed):
    print(f"seed {seed}")
    name = fresh_name()
    c = Ring.create(name, capacity)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    proc = ctx.Process(target=runpy.run_path, args=(WORKER,), kwargs=dict(
        init_globals=dict(NAME=name, N=n, LOSSLESS=lossless, START=start, SEED=seed),
        run_name="__ring_worker__"))
    proc.start()
    got, dropped = [], 0
    try:
        start.set()
        if lag_s:
            time.sleep(lag_s)               # the consumer lags: the ring fills up
        deadline = time.monotonic() + 60
        done = False
        while not done:
            assert time.monotonic() < deadline, "consumer timed out"
            batch = c.pop_many(256)
            if not batch:
                assert proc.exitcode in (None, 0), f"producer died: {proc.exitcode}"
                time.sleep(0.0002)
            for rtype, payload in batch:
                if rtype == USER:
                    got.append(_check(payload))
                elif rtype == ring.RECORD_OVERFLOW:
                    gap = struct.unpack("<Q", payload)[0]
                    dropped += gap
                    got.append(-gap)        # gap marker: -(records dropped here)
                else:
                    assert (rtype, payload) == (USER + 1, b"end")
                    got.append("end")
                    done = True
        proc.join(30)
        assert proc.exitcode == 0
        overflows = c.overflows
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        c.unlink()
        c.close()
    return got, dropped, overflows


def test_two_processes_lossless_with_wraparound():
    got, dropped, overflows = _run_pair(20_000, True, 0.0, 4096, seed=11)
    assert got == list(range(20_000)) + ["end"]
    assert dropped == overflows == 0


def test_two_processes_lagging_consumer_sees_every_drop_and_no_corruption():
    n = 20_000
    got, dropped, overflows = _run_pair(n, False, 0.3, 4096, seed=12)
    assert got[-1] == "end"
    seqs = [s for s in got[:-1] if s >= 0]
    assert dropped == overflows > 0                  # overflow reported on both sides
    assert len(seqs) + dropped == n                  # nothing lost silently
    # records arrive in order, and each gap marker sits exactly where records are
    # missing and counts them
    expect_next = 0
    for item in got[:-1] + [n]:
        if item < 0:
            expect_next += -item
        else:
            assert item == expect_next
            expect_next = item + 1

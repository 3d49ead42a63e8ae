"""The shared-memory load table: one writer per row, column sums, slot generations,
row reset, engine figures under a seqlock; every test runs with the compiled cells
(motor._fast.loadcell) and with the pure-Python reference, which must agree."""
from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor.config.schema import Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator import loadtable
from motor.coordinator.loadtable import LoadTable, load_columns
from motor.http.client import Client

_COMPILED = loadtable._loadcell


@contextlib.contextmanager
def _impl(name: str):
    """Tables made inside use the compiled cells ("compiled") or the Python reference."""
    saved = loadtable._loadcell
    loadtable._loadcell = _COMPILED if name == "compiled" else None
    try:
        yield
    finally:
        loadtable._loadcell = saved


IMPLS = ["python"] + (["compiled"] if _COMPILED is not None else [])


@pytest.fixture(params=IMPLS, autouse=True)
def impl(request):
    with _impl(request.param):
        yield request.param


@pytest.fixture
def table(impl):
    t = LoadTable.create(f"motor-test-lt-{uuid.uuid4().hex[:12]}", n_workers=3, n_slots=8)
    try:
        yield t
    finally:
        t.close()
        t.unlink()


def test_create_attach_and_unlink(table):
    other = LoadTable.attach(table.name)
    try:
        assert (other.n_workers, other.n_slots) == (3, 8)
        table.cell(1, 2, 1).acquire(10, 4, 6)
        assert other.totals(2, 1) == (1, 10, 4, 6)  # same memory, another mapping
    finally:
        other.close()
    with pytest.raises(FileExistsError):
        LoadTable.create(table.name, 1, 1)
    with pytest.raises(ValueError, match="without '/'"):
        LoadTable.attach("a/b")


def test_rows_sum_and_releases_return_to_zero(table):
    cells = [table.cell(w, 5, 1) for w in range(3)]
    for w, c in enumerate(cells):
        for _ in range(w + 1):
            c.acquire(100, 30, 70)
    assert table.totals(5, 1) == (6, 600, 180, 420)
    assert cells[2].mine() == (3, 300, 90, 210)
    cols = table.columns(np.array([5, 4]), np.array([1, 1], np.uint64))
    assert cols.tolist() == [[6, 600, 180, 420], [0, 0, 0, 0]]
    for w, c in enumerate(cells):
        for _ in range(w + 1):
            c.release(100, 30, 70)
    assert table.totals(5, 1) == (0, 0, 0, 0)


def test_prefill_done_moves_only_the_prefill_column(table):
    a, b = table.cell(0, 6, 1), table.cell(2, 6, 1)
    a.acquire(100, 30, 70)
    b.acquire(50, 20, 30)
    a.prefill_done(30)                      # a's first token: its prefill is over
    assert table.totals(6, 1) == (2, 150, 20, 100)
    assert a.mine() == (1, 100, 0, 70)
    a.release(100, 0, 70)                   # released with the prefill still counted: 0
    b.release(50, 20, 30)                   # b ended before its first token (failed)
    assert table.totals(6, 1) == (0, 0, 0, 0)


def test_prefill_done_after_reuse_or_reset_does_nothing(table):
    old = table.cell(1, 2, 1)
    old.acquire(10, 8, 2)
    g = table.retire(2)
    new = table.cell(1, 2, g)
    new.acquire(5, 5, 0)
    old.prefill_done(8)                     # the old instance's request: not on the new one
    assert table.totals(2, g) == (1, 5, 5, 0)
    table.reset_row(1)
    new.prefill_done(5)                     # a dead worker's late first token: ignored
    assert table.totals(2, g) == (0, 0, 0, 0)


def test_recycled_slot_never_credits_the_old_instance(table):
    old = table.cell(0, 3, table.slot_gen(3))
    old.acquire(50, 10, 40)
    g = table.retire(3)                    # the instance left; the feed reuses the slot
    assert g == 2
    assert table.totals(3, g) == (0, 0, 0, 0)   # old counts do not count for the new one
    new = table.cell(0, 3, g)
    new.acquire(7, 7, 0)
    old.release(50, 10, 40)                # the old request ends after the reuse: no effect
    assert table.totals(3, g) == (1, 7, 7, 0)
    new.release(7, 7, 0)
    assert table.totals(3, g) == (0, 0, 0, 0)


def test_reset_row_clears_a_dead_workers_load(table):
    dead, alive = table.cell(1, 0, 1), table.cell(2, 0, 1)
    dead.acquire(10, 0, 10)
    dead.acquire(10, 0, 10)
    alive.acquire(5, 0, 5)
    table.reset_row(1)
    assert table.totals(0, 1) == (1, 5, 0, 5)
    dead.release(10, 0, 10)                # a late release of the dead row: ignored
    assert table.totals(0, 1) == (1, 5, 0, 5)


def test_engine_figures_seqlock(table):
    assert table.read_engine(4) == (0.0, 0.0, 0.0, 0.0)
    table.write_engine(4, 3, 5, 0.25, 1234.5)
    assert table.read_engine(4) == (3.0, 5.0, 0.25, 1234.5)
    assert int(table.eng_seq[4]) % 2 == 0
    table.retire(4)
    assert table.read_engine(4) == (0.0, 0.0, 0.0, 0.0)


def test_endpoint_state_and_policies_read_column_sums(table):
    client = Client()
    try:
        a = EndpointState("a", "m", Role.UNION, "127.0.0.1", 1, 0, client.pool("127.0.0.1", 1))
        b = EndpointState("b", "m", Role.UNION, "127.0.0.1", 2, 0, client.pool("127.0.0.1", 2))
        a.shared, b.shared = table.cell(0, 0, 1), table.cell(0, 1, 1)
        table.cell(1, 1, 1).acquire(1000, 600, 400)  # another worker's load on b
        a.acquire(10, 4, 6)
        prefill, decode, queue = load_columns([a, b])
        assert prefill.tolist() == [4, 600] and decode.tolist() == [6, 400]
        assert queue.tolist() == [1, 1]
        assert all(x.flags.c_contiguous for x in (prefill, decode, queue))  # _fast.scoring
        from motor.coordinator.policy.base import RequestInfo
        from motor.coordinator.policy.least_load import LeastLoad
        assert LeastLoad().pick([a, b], RequestInfo("m", 1, 1)) is a
        a.prefill_done(4)
        assert a.inflight == 1 and a.inflight_prefill_tokens == 0
        assert a.shared.totals() == (1, 10, 0, 6)
        assert load_columns([a, b])[0].tolist() == [0, 600]
        a.release(10, 0, 6)
        assert a.inflight == 0 and a.shared.totals() == (0, 0, 0, 0)
        assert (a.inflight_tokens, a.inflight_prefill_tokens, a.inflight_decode_tokens) == (0, 0, 0)
        a.shared = b.shared = None          # one worker: the plain counters
        b.acquire(3, 1, 2)
        assert [x.tolist() for x in load_columns([a, b])] == [[0, 1], [0, 2], [0, 1]]
        b.prefill_done(1)
        assert [x.tolist() for x in load_columns([a, b])] == [[0, 0], [0, 2], [0, 1]]
        b.release(3, 0, 2)
        assert (b.inflight, b.inflight_tokens, b.inflight_prefill_tokens,
                b.inflight_decode_tokens) == (0, 0, 0, 0)
    finally:
        client.close()


# -- property: any mix of completed / failed / cancelled requests, first tokens (prefill
# released early), slot reuse and worker restarts leaves every live column at exactly 0
# once every request has ended ---------------------------------------------------------
_event = st.tuples(st.sampled_from(["start", "end", "first", "retire", "restart"]),
                   st.integers(0, 2), st.integers(0, 3), st.integers(0, 5000),
                   st.integers(0, 5000))


@settings(max_examples=150, deadline=None)
@given(st.lists(_event, max_size=120))
def test_counters_return_to_zero_property(events):
    for name in IMPLS:
        with _impl(name):
            _counters_return_to_zero(events)


def _counters_return_to_zero(events):
    t = LoadTable.create(f"motor-test-lt-{uuid.uuid4().hex[:12]}", n_workers=3, n_slots=4)
    try:
        live: list[list] = []                           # [cell, tokens, prefill left, decode]
        expect = np.zeros((4, 4), np.int64)            # what the live generation should hold
        owner: list[int] = []                           # worker of each live request
        for kind, w, slot, a, b in events:
            if kind == "start":
                cell = t.cell(w, slot, t.slot_gen(slot))
                cell.acquire(a + b, a, b)
                live.append([cell, a + b, a, b])
                owner.append(w)
                expect[slot] += (1, a + b, a, b)
            elif kind == "first" and live:
                # the request's first token: its prefill leaves, the request stays (once)
                i = (a * 5 + b) % len(live)
                cell, tok, p, d = live[i]
                counted = cell.gen == t.slot_gen(cell.slot) and \
                    int(t.row_gen[cell.worker, cell.slot]) == cell.gen
                if p:
                    cell.prefill_done(p)
                    live[i][2] = 0
                    if counted:
                        expect[cell.slot] -= (0, 0, p, 0)
            elif kind == "end" and live:
                # completed, failed or cancelled: the request path releases exactly once
                i = (a * 7 + b) % len(live)
                cell, tok, p, d = live.pop(i)
                owner.pop(i)
                counted = cell.gen == t.slot_gen(cell.slot) and \
                    int(t.row_gen[cell.worker, cell.slot]) == cell.gen
                cell.release(tok, p, d)
                if counted:
                    expect[cell.slot] -= (1, tok, p, d)
            elif kind == "retire":
                t.retire(slot)
                expect[slot] = 0
            elif kind == "restart":
                # the worker's live requests die with it (never released); its row is reset
                for i in [i for i, o in enumerate(owner) if o == w]:
                    cell = live[i][0]
                    if cell.gen == t.slot_gen(cell.slot) and \
                            int(t.row_gen[w, cell.slot]) == cell.gen:
                        expect[cell.slot] -= (1, *live[i][1:])
                t.reset_row(w)
                keep = [i for i, o in enumerate(owner) if o != w]
                live = [live[i] for i in keep]
                owner = [owner[i] for i in keep]
            for s in range(4):
                assert t.totals(s, t.slot_gen(s)) == tuple(expect[s].tolist())
        while live:
            cell, tok, p, d = live.pop()
            cell.release(tok, p, d)
        for s in range(4):
            assert t.totals(s, t.slot_gen(s)) == (0, 0, 0, 0)
    finally:
        t.close()
        t.unlink()
    assert not os.path.exists(f"/dev/shm/{t.name}")


@pytest.mark.skipif(_COMPILED is None, reason="motor._fast.loadcell is not built")
def test_compiled_and_reference_cells_share_the_words():
    """A compiled cell and a Python one over two mappings of one segment: each sees the
    other's counts (same layout), and the reference's generation rules hold for both."""
    with _impl("compiled"):
        t = LoadTable.create(f"motor-test-lt-{uuid.uuid4().hex[:12]}", n_workers=2, n_slots=3)
    try:
        with _impl("python"):
            ref = LoadTable.attach(t.name)
        try:
            c, p = t.cell(0, 2, 1), ref.cell(1, 2, 1)
            assert type(c).__module__ == "motor._fast.loadcell"
            assert type(p) is loadtable.LoadCell
            c.acquire(10, 4, 6)
            p.acquire(20, 8, 12)
            assert t.totals(2, 1) == ref.totals(2, 1) == (2, 30, 12, 18)
            assert c.totals() == p.totals() == (2, 30, 12, 18)
            c.prefill_done(4)
            assert p.totals() == (2, 30, 8, 18) and c.mine() == (1, 10, 0, 6)
            g = ref.retire(2)
            assert c.totals() == (2, 30, 8, 18)      # still counted for generation 1
            assert t.totals(2, g) == (0, 0, 0, 0)
            c.release(10, 0, 6)
            p.release(20, 8, 12)
            assert t.totals(2, 1) == (0, 0, 0, 0)
        finally:
            ref.close()
    finally:
        t.close()
        t.unlink()


@pytest.mark.skipif(_COMPILED is None, reason="motor._fast.loadcell is not built")
def test_compiled_cell_errors():
    with _impl("compiled"):
        t = LoadTable.create(f"motor-test-lt-{uuid.uuid4().hex[:12]}", n_workers=2, n_slots=3)
    try:
        for bad in ((2, 0, 1), (0, 3, 1), (0, 0, 0), (-1, 0, 1)):
            with pytest.raises(ValueError, match="out of range"):
                t.cell(*bad)
        c = t.cell(1, 1, 1)
        with pytest.raises(TypeError):
            c.acquire(1.5, 0, 0)                     # counts are integers (as the reference)
        with pytest.raises(IndexError):
            t.totals(3, 1)
        with pytest.raises(ValueError, match="does not fit"):
            _COMPILED.Mapping(bytearray(64), 2, 3, 64, 64)
    finally:
        t.close()
        t.unlink()
    with pytest.raises(ValueError, match="closed"):
        c.acquire(1, 0, 0)                           # unmapped: an error, never a write
    assert c.table._cmap.closed

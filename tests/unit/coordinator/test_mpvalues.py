"""The coordinator's multiprocess value class: the files it writes read back through
prometheus-client's multiprocess collector like the library's own, summed with another
process's, across file growth; installed only where no value of this process exists.
Every file test runs with the compiled update (motor._fast.metricvalue) and with the
Python reference. The one-process value (no lock) counts like the library's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from motor.coordinator import mpvalues
from motor.coordinator.mpvalues import fast_value_class

try:
    from motor._fast import metricvalue
except ImportError:  # pragma: no cover - the extension is not built
    metricvalue = None  # type: ignore[assignment]

COMPILED = [False] + ([True] if metricvalue is not None else [])


def _samples(d) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(d))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect() for s in m.samples}


@pytest.fixture(params=COMPILED, ids=lambda c: "compiled" if c else "python")
def fast(monkeypatch, tmp_path, request):
    """``values.ValueClass`` replaced by the fast class for pid 4242 in ``tmp_path``."""
    monkeypatch.setattr(values, "ValueClass",
                        fast_value_class(str(tmp_path), 4242, compiled=request.param))
    return tmp_path


def test_counter_gauge_histogram_read_back(fast):
    reg = CollectorRegistry()
    c = Counter("t_requests", "r", ["route"], registry=reg)
    g = Gauge("t_inflight", "i", ["ep"], registry=reg, multiprocess_mode="livesum")
    h = Histogram("t_e2e", "e", ["route"], buckets=(0.01, 0.1, 1.0), registry=reg)
    c.labels("chat").inc()
    c.labels("chat").inc(2)
    g.labels("a").inc()
    g.labels("a").inc()
    g.labels("a").dec()
    g.labels("b").set(7)
    for v in (0.005, 0.05, 0.5, 5.0):
        h.labels("chat").observe(v)
    assert c.labels("chat")._value.get() == 3
    s = _samples(fast)
    assert s[("t_requests_total", (("route", "chat"),))] == 3
    assert s[("t_inflight", (("ep", "a"),))] == 1
    assert s[("t_inflight", (("ep", "b"),))] == 7
    assert s[("t_e2e_count", (("route", "chat"),))] == 4
    assert s[("t_e2e_sum", (("route", "chat"),))] == pytest.approx(5.555)
    assert s[("t_e2e_bucket", (("le", "0.1"), ("route", "chat")))] == 2   # cumulative
    assert s[("t_e2e_bucket", (("le", "+Inf"), ("route", "chat")))] == 4
    assert sorted(p.name for p in fast.iterdir()) == ["counter_4242.db",
                                                      "gauge_livesum_4242.db",
                                                      "histogram_4242.db"]
    mark_process_dead(4242, str(fast))   # a dead worker's live gauges go, its counters stay
    s = _samples(fast)
    assert ("t_inflight", (("ep", "a"),)) not in s
    assert s[("t_requests_total", (("route", "chat"),))] == 3


def test_summed_with_a_library_value_of_another_process(fast):
    """Another process writing with prometheus-client's own class (its file has its pid):
    the collector sums both."""
    code = ("from prometheus_client import Counter, CollectorRegistry;"
            "Counter('t_requests', 'r', ['route'], registry=CollectorRegistry())"
            ".labels('chat').inc(5)")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={"PROMETHEUS_MULTIPROC_DIR": str(fast), "PATH": "/usr/bin:/bin"})
    Counter("t_requests", "r", ["route"], registry=CollectorRegistry()).labels("chat").inc(2)
    assert _samples(fast)[("t_requests_total", (("route", "chat"),))] == 7


def test_values_stay_right_when_the_file_grows(fast):
    """Keys added later grow the file and remap it: a value made before writes to the new
    mapping, at its offset."""
    reg = CollectorRegistry()
    c = Counter("t_grow", "g", ["k"], registry=reg)
    first = c.labels("first")
    first.inc()
    for i in range(12000):   # ~1.4 MB of keys: past the file's first 1 MiB
        c.labels(f"label-{i:05d}-" + "x" * 40).inc(i)
    first.inc()
    assert (fast / "counter_4242.db").stat().st_size > 1 << 20
    s = _samples(fast)
    assert s[("t_grow_total", (("k", "first"),))] == 2
    assert s[("t_grow_total", (("k", "label-11999-" + "x" * 40),))] == 11999


def test_install_only_before_the_first_value(monkeypatch, tmp_path):
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)   # restored afterwards
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert not mpvalues.install()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (tmp_path / f"counter_{os.getpid()}.db").write_bytes(b"")   # a value was made already
    assert not mpvalues.install()
    assert values.ValueClass.__name__ != "FastMmapedValue"
    (tmp_path / f"counter_{os.getpid()}.db").unlink()
    assert mpvalues.install()
    assert values.ValueClass.__name__ == "FastMmapedValue"


@pytest.mark.skipif(metricvalue is None, reason="motor._fast.metricvalue is not built")
def test_compiled_value_errors(tmp_path):
    v = metricvalue.MmapValue()
    with pytest.raises(ValueError, match="not bound"):
        v.inc(1)
    with pytest.raises(ValueError, match="multiple of 8"):
        v.bind(object(), 4, 0.0, 0.0)
    cls = fast_value_class(str(tmp_path), 4242, compiled=True)
    c = cls("counter", "t", "t_total", (), (), "h")
    c._file.close()                      # a closed mapping: an error, never a write
    with pytest.raises(ValueError):
        c.inc(1)


@pytest.mark.skipif(metricvalue is None, reason="motor._fast.metricvalue is not built")
def test_in_process_value_counts_like_the_library(monkeypatch):
    monkeypatch.setattr(values, "ValueClass", values.MutexValue)   # restored afterwards
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert mpvalues.install_in_process()
    assert values.ValueClass is metricvalue.LocalValue
    assert mpvalues.install_in_process()                         # idempotent
    reg = CollectorRegistry()
    c = Counter("t_requests", "r", ["route"], registry=reg)
    g = Gauge("t_inflight", "i", registry=reg)
    h = Histogram("t_e2e", "e", buckets=(0.01, 0.1), registry=reg)
    c.labels("chat").inc()
    c.labels("chat").inc(2, exemplar={"trace_id": "abc"})
    g.inc(3)
    g.dec()
    g.set(7.5)
    for v in (0.005, 0.05, 5.0):
        h.observe(v)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}
    assert got[("t_requests_total", (("route", "chat"),))] == 3
    assert got[("t_inflight", ())] == 7.5
    assert got[("t_e2e_bucket", (("le", "0.1"),))] == 2
    assert got[("t_e2e_count", ())] == 3
    assert got[("t_e2e_sum", ())] == pytest.approx(5.055)
    ex = [s.exemplar for m in reg.collect() for s in m.samples if s.name == "t_requests_total"]
    assert ex[0] is not None and ex[0].labels == {"trace_id": "abc"}
    monkeypatch.setattr(values, "ValueClass", values.MutexValue)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    assert not mpvalues.install_in_process()      # multiprocess mode: the files' class
    assert values.ValueClass is values.MutexValue


@pytest.mark.skipif(metricvalue is None, reason="motor._fast not built")
def test_compiled_observe_writes_what_the_librarys_observe_writes(monkeypatch, tmp_path):
    """``MmapBuckets`` (the multiprocess histogram child's ``observe`` from C) against the
    library's ``observe`` of the same values into another series: the same buckets and
    sums read back, a value equal to a bound in that bucket, NaN only in the sum."""
    monkeypatch.setattr(values, "ValueClass", fast_value_class(str(tmp_path), 4242,
                                                               compiled=True))
    reg = CollectorRegistry()
    h = Histogram("t_lat", "l", ["route"], buckets=(0.01, 0.1, 1.0), registry=reg)
    fast_child = metricvalue.MmapBuckets(h.labels("fast"))
    lib_child = h.labels("lib")
    for v in (0.0, 0.01, 0.0100001, 0.1, 0.5, 1.0, 7.0, -3.0, 1e300, float("inf")):
        fast_child.observe(v)
        lib_child.observe(v)
    s = _samples(tmp_path)
    for le in ("0.01", "0.1", "1.0", "+Inf"):
        assert s[("t_lat_bucket", (("le", le), ("route", "fast")))] == \
            s[("t_lat_bucket", (("le", le), ("route", "lib")))], le
    assert s[("t_lat_bucket", (("le", "0.01"), ("route", "fast")))] == 3   # -3, 0, 0.01
    assert s[("t_lat_count", (("route", "fast"),))] == 10
    assert s[("t_lat_sum", (("route", "fast"),))] == s[("t_lat_sum", (("route", "lib"),))]
    fast_child.observe(float("nan"))
    lib_child.observe(float("nan"))
    s = _samples(tmp_path)
    assert s[("t_lat_count", (("route", "fast"),))] == \
        s[("t_lat_count", (("route", "lib"),))] == 10


def test_compiled_observe_refuses_the_librarys_own_values(tmp_path):
    """A child whose values are not the compiled file values (no ``MmapValue``): refused,
    so ``MpHistogram.labels`` hands out the library's child instead."""
    if metricvalue is None:
        pytest.skip("motor._fast not built")
    h = Histogram("t_plain", "p", ["route"], buckets=(0.1,), registry=CollectorRegistry())
    with pytest.raises(TypeError, match="MmapValue"):
        metricvalue.MmapBuckets(h.labels("x"))


@pytest.mark.skipif(metricvalue is None, reason="motor._fast not built")
def test_compiled_gauge_count_writes_what_inc_and_dec_write(monkeypatch, tmp_path):
    """``MmapCount`` (an in-flight gauge's +-1 from C, ``metrics.gauge_counter``) against
    the library's ``inc`` / ``dec`` of another series: the same values read back; the
    library's own values get the child itself."""
    from motor.coordinator.metrics import gauge_counter
    monkeypatch.setattr(values, "ValueClass", fast_value_class(str(tmp_path), 4242,
                                                               compiled=True))
    reg = CollectorRegistry()
    g = Gauge("t_inflight", "i", ["ep"], registry=reg, multiprocess_mode="livesum")
    fast_g, lib_g = gauge_counter(g.labels("fast")), g.labels("lib")
    assert isinstance(fast_g, metricvalue.MmapCount)
    for op in ("inc", "inc", "dec", "inc", "dec", "dec", "dec"):
        getattr(fast_g, op)()
        getattr(lib_g, op)()
    s = _samples(tmp_path)
    assert s[("t_inflight", (("ep", "fast"),))] == s[("t_inflight", (("ep", "lib"),))] == -1
    monkeypatch.undo()
    plain = Gauge("t_plain", "p", ["ep"], registry=CollectorRegistry()).labels("x")
    assert gauge_counter(plain) is plain


@pytest.mark.skipif(metricvalue is None, reason="motor._fast not built")
def test_an_instance_that_comes_back_keeps_counting_in_one_series(monkeypatch, tmp_path):
    """Several workers: an instance leaves (``forget_instance``) while a request still
    observes through its old timing, and comes back (a new timing): both write one series,
    so its count is every observation (a child made again would start from the file's value
    and overwrite the old one's writes)."""
    from motor.config.schema import Role
    from motor.coordinator import metrics
    monkeypatch.setattr(values, "ValueClass", fast_value_class(str(tmp_path), 4242,
                                                               compiled=True))
    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)
    for name in ("INSTANCE_TTFT", "INSTANCE_TPOT"):
        monkeypatch.setattr(metrics, name, metrics.MpHistogram(Histogram(
            f"t_{name.lower()}", "x", ["instance", "role"], buckets=(0.1, 1.0), registry=reg)))
    monkeypatch.setattr(metrics, "_TIMINGS", {})
    old = metrics.instance_timing("i1", Role.UNION)
    old.ttft.observe(0.05)
    metrics.forget_instance("i1")
    new = metrics.instance_timing("i1", Role.UNION)
    new.ttft.observe(0.05)
    old.ttft.observe(0.05)          # a request of the old instance ends late
    new.ttft.observe(0.5)
    s = _samples(tmp_path)
    key = (("instance", "i1"), ("role", "union"))
    assert s[("t_instance_ttft_count", key)] == 4
    assert s[("t_instance_ttft_bucket", (("instance", "i1"), ("le", "0.1"), ("role", "union")))] == 3

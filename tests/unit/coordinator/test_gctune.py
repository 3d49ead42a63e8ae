"""``coordinator.gc``: a worker process freezes what startup made and raises the young
generation's threshold; a coordinator run inside another program leaves its collector alone."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest

from motor.config.schema import ClusterConfig, GcConfig
from tests.support.gateway import serve_until_listening
from tests.support.procs import free_ports, spawn, stop, wait_http

PROBE = """
import gc, json, sys, weakref
from motor.config.schema import GcConfig
from motor.coordinator.gctune import tune
class Cycle:
    pass
gc.disable()    # the cycle stays garbage until tune() runs
c = Cycle()
c.me = c
ref = weakref.ref(c)
del c
before = gc.get_threshold()
out = tune(GcConfig.model_validate(json.loads(sys.argv[1])))
print(json.dumps({"before": before, "returned": out, "now": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "garbage_left": ref() is not None}))
"""


def probe(cfg: dict[str, object]) -> dict[str, list[int] | int]:
    """tune(cfg) in a fresh interpreter: thresholds before and after, objects frozen."""
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cfg)], capture_output=True,
                       text=True, timeout=60, check=True)
    return json.loads(r.stdout)


def test_defaults_freeze_and_raise_the_young_threshold():
    out = probe({})
    before = out["before"]
    assert isinstance(before, list) and before[0] < 10000      # (700 on CPython 3.11-3.13)
    # the young generation's threshold raised, the older generations' kept
    assert out["now"] == out["returned"] == [GcConfig().young_threshold, *before[1:]] \
        == [10000, *before[1:]]
    assert out["frozen"] > 1000     # the interpreter's and motor's modules at least
    assert out["garbage_left"] is False     # collected before the freeze, not frozen


def test_zero_threshold_and_no_freeze_leave_the_collector_as_it_was():
    out = probe({"freeze": False, "young_threshold": 0})
    assert out["now"] == out["before"]
    assert out["frozen"] == 0
    assert out["garbage_left"] is True      # nothing collected either


@pytest.mark.parametrize("value", [-1, 1_000_001, "many"])
def test_bad_threshold_is_a_config_error(value):
    # above 1000000 (above a C int, it was gc.set_threshold's OverflowError in every worker)
    with pytest.raises(ValueError, match=r"coordinator\.gc\.young_threshold"):
        ClusterConfig.model_validate({"coordinator": {"gc": {"young_threshold": value}}})


def test_serve_inside_another_program_leaves_its_collector_alone():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    cfg = ClusterConfig.model_validate({"coordinator": {"port": free_ports(1)[0],
                                                        "gc": {"young_threshold": 4321}}})
    serve_until_listening(cfg, ["http://127.0.0.1:9"])
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_processes_apply_it(tmp_path, workers):
    gw, = free_ports(1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("coordinator: {gc: {young_threshold: 4321}}\n")
    log = tmp_path / "coord.log"
    p = spawn(["--log-level", "debug", "coordinator", "-c", str(cfg), "--port", str(gw),
               "--workers", str(workers), "--backend", "http://127.0.0.1:9"], str(log))
    try:
        wait_http(f"http://127.0.0.1:{gw}/liveness")
        lines: list[str] = []
        for _ in range(300):     # 30 s: the second worker may start well after the first
            lines = [ln for ln in log.read_text().splitlines() if "gc: thresholds" in ln]
            if len(lines) == workers:
                break
            time.sleep(0.1)
        assert len(lines) == workers, log.read_text()
        for ln in lines:
            assert "thresholds (4321, 10, 10)" in ln
            frozen = int(ln.split("thresholds (4321, 10, 10), ")[1].split()[0])
            assert frozen > 1000
        if workers == 1:    # tuned before it listens (its one full collection delays nothing)
            text = log.read_text().splitlines()
            tuned = next(i for i, ln in enumerate(text) if "gc: thresholds" in ln)
            listening = next(i for i, ln in enumerate(text) if " listening on " in ln)
            assert tuned < listening, text
    finally:
        stop(p)

"""npu-smi parsing (recorded public outputs in tests/fixtures/npu_smi/) and NpuMonitor with a fake
npu-smi on PATH: sampling, AI-core query per device, missing / hung / failing command."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from motor.config.schema import NpuConfig
from motor.node_manager.npu import (NpuMonitor, parse_info, parse_usages, parse_watch,
                                    visible_devices)

from .helpers import run_uvloop

FIX = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "fixtures", "npu_smi"))


def fixture(name: str) -> str:
    with open(os.path.join(FIX, name)) as f:
        return f.read()


def test_parse_info_910b3() -> None:
    chips = parse_info(fixture("info_910b3_25.3.rc1.txt"))
    assert [(c.npu, c.chip, c.device, c.name, c.health) for c in chips] == [
        (0, 0, 0, "910B3", "OK"), (1, 0, 1, "910B3", "OK"), (7, 0, 2, "910B3", "OK")]
    assert [(c.power_w, c.temp_c, c.aicore_pct) for c in chips] == [
        (94.3, 53, 0), (100.1, 53, 0), (91.5, 54, 0)]
    assert [(c.hbm_used_mb, c.hbm_total_mb) for c in chips] == [
        (4487, 65536), (4483, 65536), (4482, 65536)]
    assert [(c.memory_used_mb, c.memory_total_mb) for c in chips] == [(0, 0)] * 3
    assert chips[0].bus_id == "0000:C1:00.0" and chips[2].bus_id == "0000:42:00.0"
    assert all(c.healthy for c in chips)


def test_parse_info_310p_duo_device_column_no_hbm() -> None:
    chips = parse_info(fixture("info_310p3_duo_25.2.0.txt"))
    assert [(c.npu, c.chip, c.device) for c in chips] == [(2, 0, 0), (2, 1, 1)]
    assert [(c.power_w, c.temp_c) for c in chips] == [(None, 45), (None, 43)]  # Power NA
    assert [(c.memory_used_mb, c.memory_total_mb) for c in chips] == [(1529, 44280), (1412, 43693)]
    assert all(c.hbm_used_mb is None and c.hbm_total_mb is None for c in chips)


def test_parse_info_a3_phy_id_wide_layout() -> None:
    chips = parse_info(fixture("info_a3_ascend910_26.0.rc2.txt"))
    assert [(c.npu, c.chip, c.device, c.name) for c in chips] == [
        (0, 0, 0, "Ascend910"), (0, 1, 1, "Ascend910")]
    assert [(c.power_w, c.temp_c) for c in chips] == [(162.6, 34), (None, 34)]  # 2nd die: "-"
    assert [(c.hbm_used_mb, c.hbm_total_mb) for c in chips] == [(3419, 65536), (2874, 65536)]


def test_parse_info_garbage_and_unhealthy() -> None:
    assert parse_info("") == []
    assert parse_info("npu-smi: command failed\n") == []
    text = fixture("info_910b3_25.3.rc1.txt").replace(
        "| 1     910B3               | OK     ", "| 1     910B3               | Alarm  ")
    chips = parse_info(text)
    assert [c.health for c in chips] == ["OK", "Alarm", "OK"]
    assert [c.healthy for c in chips] == [True, False, True]


def test_parse_usages_and_watch() -> None:
    (u,) = parse_usages(fixture("usages_910b_25.5.1.txt"))
    assert (u.npu, u.chip, u.aicore_pct, u.hbm_usage_pct, u.hbm_capacity_mb) == (0, 0, 0, 5, 65536)
    assert u.raw["Ctrlcpu Usage Rate(%)"] == "6"
    # a two-chip card repeats the block; each ends with Chip ID
    two = fixture("usages_910b_25.5.1.txt").replace("Chip ID                        : 0",
                                                    "Chip ID                        : 0\n"
                                                    "        Aicore Usage Rate(%)           : 42\n"
                                                    "        Chip ID                        : 1")
    assert [(x.chip, x.aicore_pct) for x in parse_usages(two)] == [(0, 0), (1, 42)]
    rows = parse_watch(fixture("watch_910b.txt"))
    assert [(r["npu"], r["chip"], r["power_w"], r["temp_c"], r["aicore_pct"], r["memory_pct"])
            for r in rows] == [(2, 0, 90.1, 34, 0, 5), (2, 0, 90.2, 34, 0, 5)]


def test_visible_devices() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"ASCEND_RT_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_devices({"ASCEND_RT_VISIBLE_DEVICES": ""}) == []


def test_monitor_with_fake_npu_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", FIX + os.pathsep + os.environ["PATH"])
    log = tmp_path / "calls"
    monkeypatch.setenv("FAKE_NPU_SMI_LOG", str(log))
    monkeypatch.setenv("FAKE_NPU_SMI_AICORE", "64")

    async def go() -> None:
        m = NpuMonitor(NpuConfig(timeout_s=5))
        assert m.enabled and m.smi == os.path.join(FIX, "npu-smi")
        chips = await m.sample_info()
        assert [c.npu for c in chips] == [0, 1, 7] and m.chips == chips
        assert await m.aicore_pct([2]) == 64          # device 2 = card 7
        assert log.read_text().splitlines() == ["info", "info -t usages -i 7"]
        assert await m.aicore_pct([2]) == 64          # within min_query_interval_s: cached
        assert log.read_text().count("usages") == 1
        assert await m.aicore_pct([5]) is None        # no such device
        assert await m.aicore_pct(None) == 64         # all cards
        assert m.snapshot()[2]["npu"] == 7
    run_uvloop(go())


def _script(d: Path, body: str) -> None:
    p = d / "npu-smi"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_monitor_missing_hung_and_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))

    async def go() -> None:
        m = NpuMonitor()
        assert not m.enabled
        m.start()
        m.announce()
        assert await m.sample_info() == [] and await m.aicore_pct() is None
        await m.stop()
        off = [r for r in caplog.records if "NPU sampling off" in r.getMessage()]
        assert len(off) == 1  # said once
        assert not NpuMonitor(NpuConfig(enabled=False, smi_path="/bin/sh")).enabled

        hung = tmp_path / "hung"
        hung.mkdir()
        _script(hung, "exec /bin/sleep 30")
        m = NpuMonitor(NpuConfig(smi_path=str(hung / "npu-smi"), timeout_s=0.3))
        assert m.enabled
        assert await m.sample_info() == []
        assert m.last_error is not None and "0.3 s" in m.last_error
        assert await m.aicore_pct() is None

        bad = tmp_path / "bad"
        bad.mkdir()
        _script(bad, "echo 'dcmi module initialize failed. ret is -8005' >&2; exit 2")
        m = NpuMonitor(NpuConfig(smi_path=str(bad / "npu-smi")))
        assert await m.sample_info() == []
        assert "status 2" in (m.last_error or "") and "-8005" in (m.last_error or "")
        assert m.errors == 1
    run_uvloop(go())

"""Virtual inference against a real ``motor sim`` process that hangs (health still 200).

* no npu-smi: the hang -> ``failures`` failed rounds in a row -> the instance is reported
  unhealthy (process untouched) -> fault cleared -> ready again;
* a fake npu-smi reporting high AI-core use: the same hang is not counted (busy != dead);
* an npu-smi slower than the round: the round waits for its first look.
"""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor.config.schema import NodeConfig
from motor.http import Client
from motor.node_manager.agent import NodeAgent
from motor.node_manager.supervisor import ProcState

from .helpers import await_until, free_ports, run_uvloop

FAKE_SMI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fixtures",
                            "npu_smi")
FAILURES = 3


def node_cfg(tmp: Path, port: int, dp_size: int = 1) -> NodeConfig:
    return NodeConfig(name="n1", log_dir=str(tmp / "logs"), npu={"interval_s": 0.2}, engines=[dict(
        name="sim", kind="sim", model="m", base_port=port, dp_size=dp_size,
        health_interval_s=0.05, stop_timeout_s=5, startup_timeout_s=60,
        virtual_inference={"enabled": True, "warmup_s": 0, "interval_s": 0.1, "timeout_s": 0.3,
                           "failures": FAILURES, "npu_busy_pct": 50,
                           "npu_sample_interval_s": 0.05, "npu_min_window_s": 0.1})])


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def set_fault(port: int, mode: str) -> None:
    c = Client()
    try:
        st, _ = await c.post_json_bytes("127.0.0.1", port, "/admin/fault",
                                        orjson.dumps({"mode": mode}), 5)
        assert st == 200
    finally:
        c.close()


def test_hang_makes_instance_unhealthy_without_npu_smi(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.path.dirname(os.path.realpath(sys.executable)) + ":/bin:/usr/bin")

    async def go() -> None:
        port = free_ports(2)
        agent = NodeAgent(node_cfg(tmp_path, port, dp_size=2), "http://127.0.0.1:9",
                          heartbeat_interval_s=0.2)
        await agent.start()
        try:
            assert not agent.npu.enabled
            inst = agent.instances[0]
            rank0, rank1 = inst.processes
            assert rank0.virtual_inference_on and not rank1.virtual_inference_on
            await await_until(lambda: inst.healthy, 60, "ready")
            vi = rank0.vi
            assert vi is not None and rank1.vi is None
            await await_until(lambda: vi.ok_rounds >= 2, 30, "good rounds")
            pid = rank0.pid
            await set_fault(port, "hang")
            await await_until(lambda: vi.unhealthy, 30, "virtual inference unhealthy")
            assert vi.failures >= FAILURES and vi.busy_rounds == 0
            assert rank0.state is ProcState.UNHEALTHY
            assert "virtual inference failing" in (rank0.reason or "")
            assert rank0.http_healthy  # /health still answers
            hb = agent.heartbeat()
            assert hb.health == {"n1/sim/0": False}
            eh = hb.engines["n1/sim/0"]
            assert eh.state == "unhealthy" and eh.http_healthy
            assert eh.virtual_inference is not None and eh.virtual_inference.state == "unhealthy"
            assert hb.npu == []
            assert rank0.pid == pid and rank0.restarts == 0  # nothing killed
            await set_fault(port, "none")
            await await_until(lambda: inst.healthy, 30, "ready again")
            assert not vi.unhealthy and vi.failures == 0 and rank0.pid == pid
        finally:
            await agent.stop()
    run_uvloop(go())


def test_hang_on_busy_npu_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.path.realpath(FAKE_SMI_DIR) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_NPU_SMI_AICORE", "87")
    calls = tmp_path / "smi-calls.txt"
    monkeypatch.setenv("FAKE_NPU_SMI_LOG", str(calls))

    async def go() -> None:
        port = free_ports()
        agent = NodeAgent(node_cfg(tmp_path, port), "http://127.0.0.1:9", heartbeat_interval_s=0.2,
                          mgmt_port=0)
        await agent.start()
        c = Client()
        try:
            assert agent.npu.enabled
            inst = agent.instances[0]
            p = inst.processes[0]
            await await_until(lambda: inst.healthy and p.vi is not None and p.vi.ok_rounds >= 1,
                              60, "ready")
            vi = p.vi
            assert vi is not None
            await set_fault(port, "hang")
            await await_until(lambda: vi.busy_rounds >= FAILURES + 2, 30, "busy rounds")
            assert vi.failures == 0 and not vi.unhealthy and vi.failed_rounds == 0
            assert vi.last_aicore_pct == 87
            assert inst.healthy and p.state is ProcState.READY
            hb = agent.heartbeat()
            assert hb.health == {"n1/sim/0": True}
            assert [(ch.npu, ch.device, ch.hbm_used_mb) for ch in hb.npu] == [
                (0, 0, 4487), (1, 1, 4483), (7, 2, 4482)]
            assert "info -t usages -i 0" in calls.read_text()  # sim has no device env: all cards
            st, body = await c.get_json_bytes("127.0.0.1", agent.mgmt_port or 0, "/metrics", 5)
            assert st == 200
            m = metrics(body.decode())
            chip0 = (("chip", "0"), ("device", "0"), ("name", "910B3"), ("npu", "0"))
            assert m[("motor_npu_hbm_used_bytes", chip0)] == 4487 * 1024 * 1024
            assert m[("motor_npu_hbm_total_bytes", chip0)] == 65536 * 1024 * 1024
            assert m[("motor_npu_power_watts", chip0)] == 94.3
            assert m[("motor_npu_healthy", chip0)] == 1
            chip7 = (("chip", "0"), ("device", "2"), ("name", "910B3"), ("npu", "7"))
            assert m[("motor_npu_temperature_celsius", chip7)] == 54
            assert m[("motor_npu_up", ())] == 1
            busy = m[("motor_node_virtual_inference_rounds", (
                ("instance", "n1/sim/0"), ("process", "n1-sim-0"), ("result", "busy")))]
            assert busy >= FAILURES + 2
            # the busy NPU goes idle while the engine still hangs: now the rounds count
            os.environ["FAKE_NPU_SMI_AICORE"] = "0"
            await await_until(lambda: vi.unhealthy, 30, "unhealthy once idle")
            assert not inst.healthy
            await set_fault(port, "none")
        finally:
            c.close()
            await agent.stop()
    run_uvloop(go())


def test_defaults_per_kind_and_request_body() -> None:
    from motor.config.schema import EngineConfig, Role, VirtualInferenceConfig
    from motor.node_manager.health import VirtualInference
    on = {k: EngineConfig(name="e", model="m", kind=k).virtual_inference_on
          for k in ("vllm", "sglang", "sim")}
    assert on == {"vllm": True, "sglang": False, "sim": False}
    assert not EngineConfig(name="e", model="m", kind="vllm",
                            virtual_inference={"enabled": False}).virtual_inference_on
    cfg = VirtualInferenceConfig()
    assert (cfg.warmup_s, cfg.interval_s, cfg.timeout_s, cfg.failures, cfg.npu_busy_pct) == (
        180, 5, 5, 6, 3)
    c = Client()
    try:
        union = VirtualInference(c, "127.0.0.1", 1, "m", cfg)
        assert orjson.loads(union.body) == {"model": "m", "prompt": "1", "max_tokens": 1,
                                            "temperature": 0, "stream": False}
        dec = VirtualInference(c, "127.0.0.1", 1, "m", cfg, role=Role.DECODE)
        assert orjson.loads(dec.body)["kv_transfer_params"] == {"do_virtual": True}
    finally:
        c.close()


@pytest.mark.parametrize("reading, counted", [(87.0, False), (None, True)])
def test_a_failed_round_waits_for_a_slow_first_look_at_the_npu(reading: float | None,
                                                              counted: bool) -> None:
    """npu-smi slower than the round's window (a loaded node): the failed request's round
    waits for the sampler's first look instead of counting the failure without NPU data; a
    look that finds nothing still counts it."""
    from motor.config.schema import VirtualInferenceConfig
    from motor.node_manager.health import VirtualInference

    async def go() -> None:
        looks = 0

        async def slow_aicore() -> float | None:
            nonlocal looks
            await asyncio.sleep(0.8)          # well past npu_min_window_s + a sample period
            looks += 1
            return reading

        cfg = VirtualInferenceConfig(enabled=True, timeout_s=0.3, failures=3,
                                     npu_busy_pct=50, npu_sample_interval_s=0.05,
                                     npu_min_window_s=0.1)
        c = Client()
        try:
            # nothing listens there: the request fails at once
            vi = VirtualInference(c, "127.0.0.1", free_ports(), "m", cfg, aicore=slow_aicore)
            assert await vi.round() is counted
            assert looks == 1
            assert (vi.busy_rounds, vi.failures) == ((0, 1) if counted else (1, 0))
            assert vi.last_aicore_pct == reading
        finally:
            c.close()
    run_uvloop(go())

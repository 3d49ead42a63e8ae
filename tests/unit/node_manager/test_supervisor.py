"""Engine supervision with a tiny fake engine: restart, give-up, SIGTERM->SIGKILL, no orphans."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from motor.config.schema import EngineConfig
from motor.http import Client
from motor.node_manager.engines import ProcessSpec
from motor.node_manager.engines.sim import SimBackend
from motor.node_manager.health import HealthProbe
from motor.node_manager.supervisor import (EngineProcess, ProcState, backoff_delay, group_alive,
                                           port_in_use, process_alive, rotate_log)
from motor.protocol.instances import Endpoint

from .helpers import (FAKE_LAUNCHER, aread_pid, await_until, free_ports, pid_alive,
                      run_uvloop)


def make(tmp: Path, extra: list[str] | None = None, **kw: Any) -> tuple[EngineProcess, Client]:
    port = free_ports()
    restart = kw.pop("restart", {})
    eng = EngineConfig(name="e", kind="sim", model="m", base_port=port, launcher=FAKE_LAUNCHER,
                       health_interval_s=0.05, health_timeout_s=1.0, stop_timeout_s=kw.pop(
                           "stop_timeout_s", 5.0),
                       restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.2, **restart}, **kw)
    argv = SimBackend().argv(eng, 0, 0) + (extra or [])
    spec = ProcessSpec(name="n-e-0", argv=argv, env={},
                       endpoint=Endpoint(host="127.0.0.1", port=port))
    client = Client()
    return EngineProcess(spec, eng, str(tmp), client), client


def test_backoff_delay() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_rotate_log(tmp_path: Path) -> None:
    p = str(tmp_path / "x.log")
    assert not rotate_log(p, 10)  # missing file
    for i in range(5):
        with open(p, "w") as f:
            f.write(str(i) * 20)
        assert rotate_log(p, 10, backups=3)
    assert not os.path.exists(p)
    assert [open(f"{p}.{i}").read()[0] for i in (1, 2, 3)] == ["4", "3", "2"]
    assert not os.path.exists(f"{p}.4")


def test_starts_healthy_and_stops(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path)
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        pid = ep.pid
        assert pid is not None and pid_alive(pid)
        await ep.stop()
        assert ep.state is ProcState.STOPPED
        assert not pid_alive(pid)
        assert "==== motor: starting n-e-0" in open(ep.log_path).read()
        client.close()
    run_uvloop(go())


def test_crash_restarts_then_gives_up(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path, ["--exit-after", "0.2"],
                          restart={"max_restarts": 2, "window_s": 300})
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, 30, "give up")
        assert ep.restarts == 2
        assert ep.last_exit == 3
        assert "giving up after 2 restart(s)" in (ep.reason or "")
        assert open(ep.log_path).read().count("==== motor: starting") == 3
        assert ep.pid is None
        await ep.stop()
        assert ep.state is ProcState.FAILED
        client.close()
    run_uvloop(go())


def test_kill9_restarts_and_becomes_ready(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path)
        seen: list[ProcState] = []
        ep.on_change = lambda: seen.append(ep.state)
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        pid = ep.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await await_until(lambda: ep.restarts == 1 and ep.state is ProcState.READY, 20,
                          "restart and ready")
        assert ep.pid != pid
        assert ProcState.BACKOFF in seen
        assert ep.last_exit == -signal.SIGKILL
        await ep.stop()
        client.close()
    run_uvloop(go())


def test_policy_never_and_on_failure(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path, ["--exit-after", "0.1"], restart={"policy": "never"})
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, what="failed")
        assert ep.restarts == 0 and "restart policy never" in (ep.reason or "")
        await ep.stop()
        client.close()
        ep, client = make(tmp_path, ["--exit-after", "0.1", "--exit-status", "0"],
                          restart={"policy": "on-failure"})
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, what="failed")
        assert ep.restarts == 0 and ep.last_exit == 0
        await ep.stop()
        client.close()
    run_uvloop(go())


def test_startup_timeout(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path, ["--healthy-after", "1000"], startup_timeout_s=0.3,
                          restart={"max_restarts": 0})
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, what="failed")
        assert "startup_timeout_s" in (ep.reason or "")
        await ep.stop()
        client.close()
    run_uvloop(go())


def test_startup_timeout_is_a_failure_for_on_failure_even_with_exit_0(tmp_path: Path) -> None:
    """An engine that never gets healthy and exits 0 on SIGTERM is still restarted (on-failure)."""
    async def go() -> None:
        ep, client = make(tmp_path, ["--healthy-after", "1000", "--sigterm-exit-status", "0"],
                          startup_timeout_s=0.3,
                          restart={"policy": "on-failure", "max_restarts": 1})
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, 30, "failed")
        assert ep.restarts == 1 and ep.last_exit == 0
        assert "giving up after 1 restart(s)" in (ep.reason or "")
        await ep.stop()
        client.close()
    run_uvloop(go())


def test_sigterm_ignored_escalates_to_sigkill_no_orphans(tmp_path: Path) -> None:
    async def go() -> None:
        child_file = str(tmp_path / "child.pid")
        ep, client = make(tmp_path, ["--ignore-sigterm", "--child-pid-file", child_file],
                          stop_timeout_s=0.3)
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        pid = ep.pid
        child = await aread_pid(child_file)
        assert pid is not None and pid_alive(child)
        await ep.stop()
        assert not pid_alive(pid) and not pid_alive(child)
        assert not group_alive(pid)
        client.close()
    run_uvloop(go())


def test_engine_exits_on_sigterm_but_its_child_does_not(tmp_path: Path) -> None:
    async def go() -> None:
        child_file = str(tmp_path / "child.pid")
        ep, client = make(tmp_path, ["--child-pid-file", child_file], stop_timeout_s=0.3)
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        child = await aread_pid(child_file)
        await ep.stop()
        assert not pid_alive(child)
        client.close()
    run_uvloop(go())


def test_crash_leftover_children_are_killed_before_restart(tmp_path: Path) -> None:
    async def go() -> None:
        child_file = str(tmp_path / "child.pid")
        ep, client = make(tmp_path, ["--child-pid-file", child_file], stop_timeout_s=0.3)
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        child = await aread_pid(child_file)
        os.remove(child_file)
        os.kill(ep.pid or 0, signal.SIGKILL)
        await await_until(lambda: ep.restarts == 1 and ep.state is ProcState.READY,
                          what="restarted and ready")
        assert not pid_alive(child)
        child2 = await aread_pid(child_file)
        await ep.stop()
        assert not pid_alive(child2)
        client.close()
    run_uvloop(go())


class _Foreign:
    """Someone else's HTTP server on a port: answers 200 to everything, counts the requests."""

    def __init__(self) -> None:
        from motor.http import HttpServer
        self.requests = 0

        async def handle(req: Any, resp: Any) -> None:
            self.requests += 1
            resp.send(200, b'{"foreign": true}')
        self.http = HttpServer(handle)

    async def listen(self, port: int) -> None:
        await self.http.listen("127.0.0.1", port)

    async def close(self) -> None:
        await self.http.shutdown(drain_timeout_s=0.1)


def test_port_in_use(tmp_path: Path) -> None:
    async def go() -> None:
        port = free_ports()
        assert not port_in_use("127.0.0.1", port)
        foreign = _Foreign()
        await foreign.listen(port)
        assert port_in_use("127.0.0.1", port)
        assert port_in_use("0.0.0.0", port)  # a wildcard bind conflicts too
        await foreign.close()
        assert not port_in_use("127.0.0.1", port)
    run_uvloop(go())


def test_busy_port_not_launched_reported_then_starts_when_freed(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path)
        port = ep.spec.endpoint.port
        foreign = _Foreign()
        await foreign.listen(port)
        ep.start()
        await await_until(lambda: ep.state is ProcState.PORT_BUSY, what="port busy")
        assert ep.port_busy and not ep.healthy and not ep.failed
        assert f"port {port} on 127.0.0.1 is already in use by another process" in (ep.reason or "")
        # a few more checks with the backoff: still not launched, nothing probed the foreign server
        await asyncio.sleep(0.3)
        assert ep.state is ProcState.PORT_BUSY
        assert ep.proc is None and ep.pid is None and ep.probe is None
        assert not os.path.exists(ep.log_path)
        assert foreign.requests == 0
        assert ep.restarts == 0
        await foreign.close()
        await await_until(lambda: ep.state is ProcState.READY, what="ready once the port is free")
        assert ep.pid is not None and ep.restarts == 0 and foreign.requests == 0
        await ep.stop()
        assert ep.state is ProcState.STOPPED
        client.close()
    run_uvloop(go())


def test_busy_port_before_a_restart(tmp_path: Path) -> None:
    """The port is checked again before each restart: a crash + a squatter = not relaunched."""
    async def go() -> None:
        ep, client = make(tmp_path, restart={"backoff_initial_s": 0.3, "backoff_max_s": 0.3})
        port = ep.spec.endpoint.port
        ep.start()
        await await_until(lambda: ep.state is ProcState.READY, what="ready")
        pid = ep.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await await_until(lambda: ep.state is ProcState.BACKOFF, what="backoff")
        foreign = _Foreign()
        await foreign.listen(port)  # someone takes the port while the engine is down
        await await_until(lambda: ep.state is ProcState.PORT_BUSY, what="port busy")
        assert ep.pid is None and foreign.requests == 0
        await foreign.close()
        await await_until(lambda: ep.state is ProcState.READY, what="ready again")
        assert ep.pid != pid
        await ep.stop()
        client.close()
    run_uvloop(go())


def test_stop_while_port_busy(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = make(tmp_path)
        foreign = _Foreign()
        await foreign.listen(ep.spec.endpoint.port)
        ep.start()
        await await_until(lambda: ep.state is ProcState.PORT_BUSY, what="port busy")
        await ep.stop()
        assert ep.state is ProcState.STOPPED and ep.proc is None
        await foreign.close()
        client.close()
    run_uvloop(go())


def test_health_probe_ignores_answers_while_the_engine_is_not_alive() -> None:
    async def go() -> None:
        port = free_ports()
        foreign = _Foreign()
        await foreign.listen(port)
        client = Client()
        calls = 0
        alive = False

        def is_alive() -> bool:
            nonlocal calls
            calls += 1
            return alive
        probe = HealthProbe(client, "127.0.0.1", port, interval_s=0.01, alive=is_alive)
        task = asyncio.create_task(probe.run())
        await await_until(lambda: calls >= 5, what="probes")
        assert foreign.requests >= 5
        assert not probe.healthy and not probe.ever_healthy
        alive = True
        await await_until(lambda: probe.healthy, what="healthy while alive")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        client.close()
        await foreign.close()
    run_uvloop(go())


def test_process_alive() -> None:
    async def go() -> None:
        proc = await asyncio.create_subprocess_exec("sleep", "30")
        assert process_alive(proc)
        proc.kill()
        await proc.wait()
        assert not process_alive(proc)
    run_uvloop(go())


def _make_argv(tmp: Path, argv: list[str], **kw: Any) -> tuple[EngineProcess, Client]:
    port = free_ports()
    eng = EngineConfig(name="e", kind="sim", model="m", base_port=port, health_interval_s=0.05,
                       restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.1})
    spec = ProcessSpec(name="n-e-0", argv=argv, env={},
                       endpoint=Endpoint(host="127.0.0.1", port=port))
    client = Client()
    return EngineProcess(spec, eng, str(tmp), client, **kw), client


def test_failed_starts_log_the_engines_last_lines_and_give_up_after_start_attempts(
        tmp_path: Path, caplog: Any) -> None:
    """An engine that dies before it is healthy: the node manager's log says its exit status
    and quotes what it wrote; after start_attempts such starts in a row it is failed."""
    script = "import sys; print('usage: engine [--x N]'); print('engine: error: bad --x'); " \
             "sys.exit(2)"

    async def go() -> None:
        ep, client = _make_argv(tmp_path, [sys.executable, "-c", script], start_attempts=2)
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, 30, "give up")
        assert ep.restarts == 1 and ep.last_exit == 2
        assert "exited with status 2 during start-up; giving up after 2 failed start(s) in a " \
               "row (never healthy); its log: " + ep.log_path == ep.reason
        await ep.stop()
        client.close()
    caplog.set_level("INFO", logger="motor.node_manager.supervisor")
    run_uvloop(go())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    first = next(m for m in errors if "failed start 1 in a row" in m)
    assert "engine n-e-0 (instance n-e-0) exited with status 2 during start-up" in first
    # this run's lines only (the log holds both runs), quoted
    assert first.endswith(":\n  | usage: engine [--x N]\n  | engine: error: bad --x")


def test_a_missing_launcher_fails_at_once_naming_the_file_and_the_field(tmp_path: Path) -> None:
    async def go() -> None:
        ep, client = _make_argv(tmp_path, ["/no/such/binary", "--port", "1"],
                                launcher_field="engines[0].launcher of node n")
        ep.start()
        await await_until(lambda: ep.state is ProcState.FAILED, 10, "failed")
        assert ep.restarts == 0
        assert ep.reason == ("could not be started: cannot execute '/no/such/binary' "
                             "(engines[0].launcher of node n): No such file or directory; "
                             "not retried")
        await ep.stop()
        assert ep.state is ProcState.FAILED
        client.close()
    run_uvloop(go())


def test_engine_log_header_shows_device_and_thread_env_but_never_secrets():
    from motor.node_manager.supervisor import _shown_env
    shown = _shown_env({"ASCEND_RT_VISIBLE_DEVICES": "4,5", "HCCL_IF_IP": "10.0.0.5",
                        "OMP_NUM_THREADS": "10", "VLLM_API_KEY": "sk-secret",
                        "HF_TOKEN": "hf-secret", "PATH": "/usr/bin"})
    assert shown == "ASCEND_RT_VISIBLE_DEVICES=4,5 HCCL_IF_IP=10.0.0.5 OMP_NUM_THREADS=10"

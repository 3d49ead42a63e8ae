"""Engine process supervision: process groups, log files, restarts with backoff, graceful stop.

Each engine process runs in its own session / process group (``start_new_session=True``),
stdout and stderr appended to ``<log_dir>/<name>.log`` (rotated by size when the engine
(re)starts). On Linux the engine also gets ``PR_SET_PDEATHSIG=SIGKILL``, so a node manager
killed with SIGKILL does not leave the engine's leader process behind.

Restart policy (``EngineConfig.restart``): ``always`` restarts every exit, ``on-failure``
every non-zero exit, ``never`` none. The n-th consecutive restart waits
``min(backoff_initial_s * 2**(n-1), backoff_max_s)``; the count starts over once the engine
was healthy. An engine that is not healthy within ``startup_timeout_s`` is stopped and counts
as a failed start. After ``max_restarts`` restarts within ``window_s`` the supervisor gives
up: the process is ``failed`` (reported unhealthy to the controller, error in the log).

Failed starts: an engine that ends before it was ever healthy (exits, or is stopped at
``startup_timeout_s``) gets an error in the node manager's log with its exit status and the
last lines of its own log for that run, so a bad flag or a missing model is visible where the
node manager logs. ``start_attempts`` (``motor up`` sets it through the node manager's
``MOTOR_ENGINE_START_ATTEMPTS``): that many failed starts in a row of an engine that was never
healthy -> ``failed`` at once, without waiting for ``max_restarts`` (``None``: the restart
policy alone decides). An engine whose launcher cannot be executed at all (no such file, not
executable) is ``failed`` at once, naming the file and the config field: retrying would not
make the file appear.

Ports: before each (re)start the engine's port on its host must be free (a test bind with
``SO_REUSEADDR``). When another process listens there, the engine is not launched (it would
die with EADDRINUSE while ``/health`` reached the foreign server): the process is
``port_busy`` (reported unhealthy and in ``failed``, with the reason, error in the log once)
and the port is checked again with the restart backoff, so the engine starts once the port is
freed. Such checks are not restarts (no ``max_restarts``, no restart policy: nothing ran).
A ``/health`` answer counts only while the launched engine process is alive.

Stopping (and cleaning up after an engine that exited by itself): SIGTERM to the group ->
wait up to ``stop_timeout_s`` for the leader to exit and the group to be empty -> SIGKILL
to the group.

Parts of an instance spanning nodes (``restart_on_exit=False``): an exit is not restarted
here (the process is ``failed`` with the reason; the controller restarts the whole instance,
every node's part together, and the node manager starts it again with ``start(fresh=True)``).
A headless part (``ProcessSpec.endpoint`` None: no API port) has no port check and no health
probe: it is ``ready`` while it runs.

HTTPS (``engines[].tls``, an endpoint with scheme ``https``): every probe of the engine
(``/health``, virtual inference, the drain's ``/metrics``) is TLS, the engine's certificate
checked against ``tls.ca_file`` (else the system's CAs) and the endpoint's host name, with
``tls.client_cert_file`` presented when set (:func:`probe_client`); a certificate that does
not verify is a failed probe (the engine never turns healthy, the reason says why).

Health: a :class:`~motor.node_manager.health.HealthProbe` per process start; for DP rank 0 of
an engine with virtual inference on, a :class:`~motor.node_manager.health.VirtualInference`
starts at the first healthy ``/health``. The process is ``ready`` while ``/health`` is healthy
and virtual inference is not unhealthy; a failing virtual inference makes it ``unhealthy``
(reported to the controller) but never stops or restarts it.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from motor.aio import cancel_and_wait
from motor.config.schema import EngineConfig, RestartPolicy
from motor.http import Client
from motor.node_manager.engines import ProcessSpec, full_env, probe_tls_context
from motor.node_manager.health import AicoreFn, HealthProbe, VirtualInference
from motor.node_manager.npu import NpuMonitor, visible_devices
from motor.procs import (backoff_delay, describe_exit, die_with_parent, group_alive,
                         tail_lines)

logger = logging.getLogger(__name__)

LOG_MAX_BYTES = 64 * 1024 * 1024
LOG_BACKUPS = 3
#: lines of an engine's own log quoted in the node manager's log when a start fails
TAIL_LINES = 20
#: spawn errors that another try cannot fix (the launcher's file is missing / not executable)
_PERMANENT_SPAWN_ERRORS = (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR,
                           errno.EISDIR)


class ProcState(str, enum.Enum):
    STARTING = "starting"   #: process running, not healthy yet
    READY = "ready"         #: process running and healthy
    UNHEALTHY = "unhealthy" #: was healthy, health probes fail now
    BACKOFF = "backoff"     #: exited; waiting to restart
    FAILED = "failed"       #: gave up (restart limit, policy), nothing runs
    PORT_BUSY = "port_busy" #: not launched: another process listens on the engine's port
    STOPPED = "stopped"     #: stopped by the node manager


# ---------------------------------------------------------------- process groups
def port_in_use(host: str, port: int) -> bool:
    """Whether another socket already listens on ``host:port``.

    Binds a test socket with ``SO_REUSEADDR`` (so connections in TIME_WAIT do not count) on
    every address ``host`` resolves to and closes it at once; ``EADDRINUSE`` on any of them
    = in use. Other errors (a name that does not resolve, an address that is not local, ...)
    are not "in use": the engine meets them itself.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, OverflowError):
        return False
    for family, type_, proto, _, addr in infos:
        try:
            s = socket.socket(family, type_, proto)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
        finally:
            s.close()
    return False


def port_busy_message(host: str, port: int) -> str:
    return f"port {port} on {host} is already in use by another process"


_HAVE_PROC = os.path.exists("/proc/self/stat")


def process_alive(proc: asyncio.subprocess.Process) -> bool:
    """Whether ``proc`` is running (not exited, not a zombie waiting to be reaped)."""
    if proc.returncode is not None:
        return False
    if not _HAVE_PROC:
        return True
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    rest = stat[stat.rfind(b")") + 2:].split()
    return not rest or rest[0] != b"Z"


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def terminate_group(proc: asyncio.subprocess.Process, timeout_s: float, name: str = "",
                          poll_s: float = 0.05) -> int | None:
    """SIGTERM the process group of ``proc`` -> ``timeout_s`` -> SIGKILL; returns the exit status.

    Works when the leader already exited (leftover children of the group are cleaned up).
    """
    pgid = proc.pid  # leader of its own session: pgid == pid
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    signal_group(pgid, signal.SIGTERM)
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            pass
    while group_alive(pgid) and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    if proc.returncode is None or group_alive(pgid):
        logger.warning("engine %s did not stop within %g s after SIGTERM: SIGKILL to its "
                       "process group", name or pgid, timeout_s)
        signal_group(pgid, signal.SIGKILL)
    rc = await proc.wait()
    # the group's last members may need a moment to die after SIGKILL
    end = loop.time() + 5.0
    while group_alive(pgid) and loop.time() < end:
        await asyncio.sleep(poll_s)
    return rc


# an engine gets SIGKILL when its node manager dies (it is in its own session, so a
# signal to the node manager's group does not reach it)
_PDEATHSIG = die_with_parent(signal.SIGKILL)


def rotate_log(path: str, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> bool:
    """Rotate ``path`` -> ``path.1`` ... ``path.<backups>`` when larger than ``max_bytes``."""
    try:
        if os.path.getsize(path) <= max_bytes:
            return False
    except OSError:
        return False
    for i in range(backups - 1, 0, -1):
        src = f"{path}.{i}"
        if os.path.exists(src):
            os.replace(src, f"{path}.{i + 1}")
    os.replace(path, f"{path}.1")
    return True


def probe_client(spec: ProcessSpec, engine: EngineConfig, shared: Client) -> Client:
    """The client that probes ``spec``'s engine: ``shared`` (plain HTTP) unless its endpoint
    is HTTPS; then one of its own with the group's probe context
    (:func:`~motor.node_manager.engines.probe_tls_context`), HTTPS to that endpoint.

    Raises
    ------
    ConfigError
        a file of ``engine.tls`` that is missing or does not load (:func:`plan_node` checked
        them already).
    """
    ep = spec.endpoint
    if ep is None or not ep.https:
        return shared
    ctx = probe_tls_context(engine, f"engines[{engine.name}]")
    if ctx is None:
        raise ValueError(f"endpoint {ep.url} of {spec.name}: expected engines[{engine.name}]"
                         f".tls for an https endpoint, got none")
    own = Client(connect_timeout_s=shared.connect_timeout_s, tls=ctx)
    own.use_tls(ep.host, ep.port)
    return own


class EngineProcess:
    """Supervises one engine process (start, health, restart policy, stop).

    Parameters
    ----------
    spec : ProcessSpec
        argv / env / endpoint / log name.
    engine : EngineConfig
        restart policy, stop / startup timeouts, health interval / timeout.
    log_dir : str
    client : motor.http.Client
        used for health probes.
    on_change : callable
        called (no argument) whenever :attr:`state` or health changes.
    instance : str
        the instance id (``<node>/<engine>/<i>``) for log messages; default the
        ``MOTOR_INSTANCE_ID`` of the process's env, else its name.
    start_attempts : int or None
        failed starts in a row, before the engine was ever healthy, after which it is
        ``failed`` at once (``None``: only the restart policy decides).
    launcher_field : str or None
        the config field of the engine's launcher, named when it cannot be executed
        (e.g. ``engines[0].launcher of node n0``).
    restart_on_exit : bool
        False for a part of an instance spanning nodes: an exit makes it ``failed`` at once
        (no restart policy, no backoff here).
    """

    def __init__(self, spec: ProcessSpec, engine: EngineConfig, log_dir: str, client: Client,
                 on_change: Callable[[], None] | None = None,
                 log_max_bytes: int = LOG_MAX_BYTES, clock: Callable[[], float] = time.monotonic,
                 npu: NpuMonitor | None = None, instance: str | None = None,
                 start_attempts: int | None = None, launcher_field: str | None = None,
                 restart_on_exit: bool = True) -> None:
        self.spec = spec
        #: False: an exit ends supervision (``failed``); the instance restarts as a whole
        self.restart_on_exit = restart_on_exit
        self.start_attempts = start_attempts
        self.launcher_field = launcher_field or "launcher"
        #: byte offset in the log file where the current run's output starts
        self._log_offset = 0
        #: the launcher could not be executed (no retry helps)
        self._spawn_failed_for_good = False
        self.ever_healthy = False
        self.instance = instance or spec.env.get("MOTOR_INSTANCE_ID") or spec.name
        self.engine = engine
        #: what probes the engine (health, virtual inference, /metrics): ``client``, or over
        #: HTTPS a client of its own (:func:`probe_client`)
        self.client = probe_client(spec, engine, client)
        self.on_change = on_change
        self.log_path = os.path.join(log_dir, f"{spec.name}.log")
        self.log_max_bytes = log_max_bytes
        self.clock = clock
        self.state = ProcState.STOPPED
        self.reason: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.probe: HealthProbe | None = None
        self.npu = npu
        #: virtual inference of the current run (DP rank 0 of an engine with it on), else None
        self.vi: VirtualInference | None = None
        self._vi_task: asyncio.Task[None] | None = None
        self._start_timed_out = False
        self.restarts = 0
        self.last_exit: int | None = None
        #: an engine run ended other than by a stop request (crash, exit, start-up timeout,
        #: could not be spawned): its log is worth keeping
        self.had_failure = False
        self._restart_times: collections.deque[float] = collections.deque()
        self._stop = asyncio.Event()
        self._stop_reason = "stopped by the node manager"
        self._task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- views
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        p = self.proc
        return p.pid if p is not None and p.returncode is None else None

    @property
    def healthy(self) -> bool:
        return self.state is ProcState.READY

    @property
    def failed(self) -> bool:
        return self.state is ProcState.FAILED

    @property
    def port_busy(self) -> bool:
        return self.state is ProcState.PORT_BUSY

    @property
    def http_healthy(self) -> bool:
        p = self.probe
        if self.spec.endpoint is None:
            return self.pid is not None   # headless: nothing to probe
        return self.pid is not None and p is not None and p.healthy

    @property
    def virtual_inference_on(self) -> bool:
        ep = self.spec.endpoint
        return self.engine.virtual_inference_on and ep is not None and ep.dp_rank == 0

    def status(self) -> dict[str, object]:
        ep = self.spec.endpoint
        return {"name": self.name, "state": self.state.value, "pid": self.pid,
                "port": ep.port if ep is not None else None, "restarts": self.restarts,
                "last_exit": self.last_exit, "reason": self.reason, "log": self.log_path,
                "virtual_inference": self.vi.status() if self.vi is not None else None}

    # ------------------------------------------------------------- lifecycle
    @property
    def supervised(self) -> bool:
        """Supervision runs (the engine runs, starts, or waits to restart); False once stopped
        or given up on (``failed``)."""
        return self._task is not None and not self._task.done()

    def start(self, fresh: bool = False) -> None:
        """Start supervising (returns at once); no-op while supervision runs.

        ``fresh`` (an operator's start): the restart history is forgotten, so an engine the
        supervisor gave up on (``failed``) gets the whole ``max_restarts`` budget again and a
        launcher that could not be executed is tried again.
        """
        if self.supervised:
            return
        if fresh:
            self._restart_times.clear()
            self._spawn_failed_for_good = False
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name=f"engine {self.name}")

    async def stop(self, reason: str = "stopped by the node manager") -> None:
        """Stop the engine (SIGTERM -> stop_timeout_s -> SIGKILL of its group) and supervision;
        the process is then ``stopped`` with ``reason``."""
        self._stop_reason = reason
        self._stop.set()
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None

    def _set(self, state: ProcState, reason: str | None = None) -> None:
        if state is self.state and reason == self.reason:
            return
        self.state = state
        self.reason = reason
        if self.on_change is not None:
            self.on_change()

    def _on_health(self, healthy: bool) -> None:
        if healthy and self.vi is not None and self._vi_task is None:
            self._vi_task = asyncio.create_task(self.vi.run(), name=f"virtual inference {self.name}")
        self._refresh()

    def _refresh(self, _: object = None) -> None:
        """READY / UNHEALTHY from the /health probe and virtual inference (running states only)."""
        if self.state not in (ProcState.STARTING, ProcState.READY, ProcState.UNHEALTHY):
            return
        probe, vi = self.probe, self.vi
        if probe is None:
            return
        if probe.healthy and not (vi is not None and vi.unhealthy):
            self._set(ProcState.READY, None)
        elif probe.healthy and vi is not None:
            self._set(ProcState.UNHEALTHY, f"virtual inference failing ({vi.failures} rounds in "
                                           f"a row): {vi.last_error}")
        elif probe.ever_healthy:
            self._set(ProcState.UNHEALTHY, f"health probe failing: {probe.last_error}")

    def _make_vi(self) -> VirtualInference | None:
        if not self.virtual_inference_on:
            return None
        npu = self.npu
        aicore: AicoreFn | None = None
        if npu is not None and npu.enabled:
            devices = visible_devices(self.spec.env)

            async def npu_aicore() -> float | None:
                return await npu.aicore_pct(devices)
            aicore = npu_aicore
        ep = self.spec.endpoint
        assert ep is not None   # virtual_inference_on
        return VirtualInference(self.client, ep.host, ep.port, self.engine.model_name,
                                self.engine.virtual_inference, self.engine.role, aicore,
                                on_change=self._refresh, name=self.name)

    async def _spawn(self) -> asyncio.subprocess.Process:
        rotate_log(self.log_path, self.log_max_bytes)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            shown = _shown_env(self.spec.env)
            header = (f"\n==== motor: starting {self.name} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.spec.argv)}\n"
                      + (f"==== env: {shown}\n" if shown else ""))
            os.write(fd, header.encode())
            self._log_offset = os.lseek(fd, 0, os.SEEK_CUR)
            kwargs: dict[str, object] = {}
            if sys.platform.startswith("linux"):
                kwargs["preexec_fn"] = _PDEATHSIG
            return await asyncio.create_subprocess_exec(
                *self.spec.argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                env=full_env(self.spec.env), start_new_session=True, **kwargs)  # type: ignore[arg-type]
        finally:
            os.close(fd)

    def _spawn_error(self, e: OSError) -> str:
        """Why the engine could not be launched; a missing / non-executable launcher (no
        retry helps) marks the engine for giving up and names the file and the field."""
        exe = self.spec.argv[0] if self.spec.argv else "(empty argv)"
        if e.errno in _PERMANENT_SPAWN_ERRORS:
            self._spawn_failed_for_good = True
            return (f"could not be started: cannot execute {exe!r} ({self.launcher_field}): "
                    f"{e.strerror or e}")
        return f"could not be started: {exe!r}: {e}"

    def _log_failed_start(self, exit_reason: str, failed_starts: int) -> None:
        """An error with the exit status and the last lines the engine wrote in this run."""
        tail = tail_lines(self.log_path, TAIL_LINES, self._log_offset)
        quoted = "\n".join(f"  | {ln}" for ln in tail) if tail else "  | (nothing)"
        logger.error("engine %s (instance %s) %s during start-up (never healthy; failed start "
                     "%d in a row); last lines of its log %s:\n%s", self.name, self.instance,
                     exit_reason, failed_starts, self.log_path, quoted)

    async def _run(self) -> None:
        rcfg = self.engine.restart
        consecutive = 0
        failed_starts = 0   # in a row, ended before the engine was healthy
        stop_wait = asyncio.create_task(self._stop.wait())
        try:
            while not self._stop.is_set():
                if not await self._wait_for_port(stop_wait):
                    break  # stop requested while the port was busy
                exit_reason, rc, was_healthy = await self._run_once(stop_wait)
                if self._stop.is_set():
                    break
                self.had_failure = True
                self.last_exit = rc
                if was_healthy:
                    consecutive = 0
                    failed_starts = 0
                    self.ever_healthy = True
                else:
                    failed_starts += 1
                if self._spawn_failed_for_good:
                    logger.error("engine %s (instance %s) %s; not retrying", self.name,
                                 self.instance, exit_reason)
                    self._set(ProcState.FAILED, f"{exit_reason}; not retried")
                    break
                if not self.restart_on_exit:
                    logger.warning("engine %s (instance %s) %s; not restarted alone: the "
                                   "instance spanning nodes restarts as a whole (log: %s)",
                                   self.name, self.instance, exit_reason, self.log_path)
                    self._set(ProcState.FAILED, f"{exit_reason}; the instance restarts as a "
                                                f"whole")
                    break
                if not was_healthy:
                    self._log_failed_start(exit_reason, failed_starts)
                    if self.start_attempts is not None and not self.ever_healthy and \
                            failed_starts >= self.start_attempts:
                        msg = (f"{exit_reason} during start-up; giving up after {failed_starts} "
                               f"failed start(s) in a row (never healthy); its log: "
                               f"{self.log_path}")
                        logger.error("engine %s (instance %s) %s", self.name, self.instance, msg)
                        self._set(ProcState.FAILED, msg)
                        break
                # decide whether to restart
                # a start-up timeout is a failure even when the engine then exits 0 on SIGTERM
                clean = rc == 0 and not self._start_timed_out
                if rcfg.policy is RestartPolicy.NEVER or (
                        rcfg.policy is RestartPolicy.ON_FAILURE and clean):
                    logger.error("engine %s %s; restart policy %s: not restarting",
                                 self.name, exit_reason, rcfg.policy.value)
                    self._set(ProcState.FAILED, f"{exit_reason}; restart policy {rcfg.policy.value}")
                    break
                now = self.clock()
                while self._restart_times and now - self._restart_times[0] > rcfg.window_s:
                    self._restart_times.popleft()
                if len(self._restart_times) >= rcfg.max_restarts:
                    msg = (f"{exit_reason}; giving up after {len(self._restart_times)} restart(s) "
                           f"within {rcfg.window_s:g} s")
                    logger.error("engine %s %s (log: %s)", self.name, msg, self.log_path)
                    self._set(ProcState.FAILED, msg)
                    break
                consecutive += 1
                delay = backoff_delay(consecutive, rcfg.backoff_initial_s, rcfg.backoff_max_s)
                logger.warning("engine %s %s; restarting in %.2f s (log: %s)",
                               self.name, exit_reason, delay, self.log_path)
                self._set(ProcState.BACKOFF, f"{exit_reason}; restarting in {delay:.2f} s")
                try:
                    await asyncio.wait_for(asyncio.shield(stop_wait), delay)
                    break  # stop requested during backoff
                except TimeoutError:
                    pass
                self._restart_times.append(self.clock())
                self.restarts += 1
        finally:
            stop_wait.cancel()
            if self.state is not ProcState.FAILED or self._stop.is_set():
                self._set(ProcState.STOPPED, self._stop_reason
                          if self._stop.is_set() else self.reason)

    async def _wait_for_port(self, stop_wait: asyncio.Task[bool]) -> bool:
        """Return once the engine's port is free (True), or on a stop request (False).

        While another process listens there the engine is not launched: state ``port_busy``
        with the reason, an error in the log once, checks again with the restart backoff.
        """
        ep = self.spec.endpoint
        if ep is None:
            return not self._stop.is_set()   # headless: no port of its own
        rcfg = self.engine.restart
        checks = 0
        while port_in_use(ep.host, ep.port):
            checks += 1
            msg = port_busy_message(ep.host, ep.port)
            if checks == 1:
                logger.error("engine %s (instance %s): %s; not starting it (checking again with "
                             "backoff until the port is free)", self.name, self.instance, msg)
            self._set(ProcState.PORT_BUSY, f"{msg}; engine not started")
            delay = backoff_delay(checks, rcfg.backoff_initial_s, rcfg.backoff_max_s)
            try:
                await asyncio.wait_for(asyncio.shield(stop_wait), delay)
                return False
            except TimeoutError:
                pass
        if checks:
            logger.info("engine %s (instance %s): port %d on %s is free now: starting it",
                        self.name, self.instance, ep.port, ep.host)
        return not self._stop.is_set()

    async def _run_once(self, stop_wait: asyncio.Task[bool]) -> tuple[str, int | None, bool]:
        """Run the engine once; returns (why it ended, exit status, was it ever healthy)."""
        self._start_timed_out = False
        try:
            proc = await self._spawn()
        except OSError as e:
            return self._spawn_error(e), None, False
        self.proc = proc
        ep = self.spec.endpoint
        if ep is None or self.spec.health_path is None:
            return await self._run_headless(proc, stop_wait)
        logger.info("engine %s started: pid %d, port %d, log %s", self.name, proc.pid,
                    ep.port, self.log_path)
        self._set(ProcState.STARTING, "engine starting")
        probe = self.probe = HealthProbe(
            self.client, ep.host, ep.port, self.spec.health_path, self.engine.health_interval_s,
            self.engine.health_timeout_s, on_change=self._on_health, name=self.name,
            alive=lambda: process_alive(proc))
        self.vi = self._make_vi()
        self._vi_task = None
        probe_task = asyncio.create_task(probe.run())
        exit_wait = asyncio.create_task(proc.wait())
        started = self.clock()
        why = ""
        try:
            while True:
                timeout = None
                if not probe.ever_healthy:
                    timeout = max(0.0, started + self.engine.startup_timeout_s - self.clock())
                    timeout = min(timeout, 1.0)  # re-check ever_healthy now and then
                await asyncio.wait({exit_wait, stop_wait}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if stop_wait.done():
                    break
                if exit_wait.done():
                    why = f"exited with {describe_exit(proc.returncode)}"
                    break
                if not probe.ever_healthy and \
                        self.clock() - started >= self.engine.startup_timeout_s:
                    why = f"not healthy within startup_timeout_s={self.engine.startup_timeout_s:g} s"
                    self._start_timed_out = True
                    logger.error("engine %s %s: stopping it", self.name, why)
                    break
        finally:
            await cancel_and_wait(probe_task, self._vi_task)
            self._vi_task = None
            # stop request, startup timeout, or leftovers of an engine that exited by itself
            rc = await terminate_group(proc, self.engine.stop_timeout_s, self.name)
            if not exit_wait.done():
                exit_wait.cancel()
            self.client.discard(ep.host, ep.port)
        if self._stop.is_set():
            logger.info("engine %s stopped (status %s)", self.name, rc)
        return why, rc, probe.ever_healthy

    async def _run_headless(self, proc: asyncio.subprocess.Process,
                            stop_wait: asyncio.Task[bool]) -> tuple[str, int | None, bool]:
        """A process without an API port: ``ready`` while it runs, until it exits or a stop."""
        logger.info("engine %s started: pid %d, headless (no API port, not probed), log %s",
                    self.name, proc.pid, self.log_path)
        self.probe = None
        self.vi = None
        self._set(ProcState.READY, None)
        exit_wait = asyncio.create_task(proc.wait())
        why = ""
        try:
            await asyncio.wait({exit_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if exit_wait.done() and not stop_wait.done():
                why = f"exited with {describe_exit(proc.returncode)}"
        finally:
            rc = await terminate_group(proc, self.engine.stop_timeout_s, self.name)
            if not exit_wait.done():
                exit_wait.cancel()
        if self._stop.is_set():
            logger.info("engine %s stopped (status %s)", self.name, rc)
        return why, rc, True


#: env variables of an engine shown in its log header (devices, HCCL, threads, engine knobs)
_SHOWN_ENV_PREFIXES = ("ASCEND_", "CUDA_VISIBLE_DEVICES", "HCCL_", "OMP_", "VLLM_", "SGLANG_")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def _shown_env(env: dict[str, str]) -> str:
    """``NAME=value`` of the variables an operator checks when an engine misbehaves (which
    devices, which interface, how many threads), secrets never."""
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())
                    if k.startswith(_SHOWN_ENV_PREFIXES)
                    and not any(w in k.upper() for w in _SECRET_WORDS))

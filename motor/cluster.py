"""The local cluster of ``motor up`` and ``motor demo``: its child processes, started in
order, supervised, stopped in order (drain first).

Components: the controller, one node manager per node of the config (each starts and
supervises its node's engines) and the coordinator, each ``python -m motor <command>`` in its
own session / process group, told by the kernel to stop when this process dies
(``PR_SET_PDEATHSIG``). The config goes to them as a temporary JSON file.

**Start** (:meth:`Cluster.start`), one bound for all of it (``timeout_s``):

1. the controller, until ``GET /health`` answers 200;
2. the node managers, until each one's node is registered with the controller
   (``GET /v1/nodes``);
3. the coordinator, until ``/readiness`` counts every configured engine endpoint routable.

A component that exits meanwhile, an engine instance the node manager gave up on (the node
managers run with ``MOTOR_ENGINE_START_ATTEMPTS`` = :data:`ENGINE_START_ATTEMPTS`: an engine
that fails that many starts in a row without ever being healthy is given up on) or the end of
the bound raise :class:`StartError`, whose message names the component, its exit status or
what is missing, and the last :data:`TAIL_LINES` lines of the logs concerned.

**Supervision** (:meth:`Cluster.supervise`, called periodically once started): a component
that exits is started again after ``min(0.5 s * 2**(n-1), 10 s)`` (n = restarts in a row
since it was last ready again), each said on stderr; exit status 2 (a bad config or option:
another try ends the same) or more than :data:`RESTART_MAX` restarts of one component within
:data:`RESTART_WINDOW_S` seconds: it gives up, and the caller stops the cluster.

**Stop** (:meth:`Cluster.stop`), group by group, SIGTERM to each process group and SIGKILL
after the group's bound: the coordinator (bound ``coordinator.drain_timeout_s`` +
:data:`STOP_MARGIN_S`: it finishes the requests in flight while every engine still runs),
then the node managers (the longest ``stop_timeout_s`` of their engines + 7 s +
:data:`STOP_MARGIN_S`: they stop their engines and deregister), then the controller (:data:`STOP_MARGIN_S`). ``force()``
true at any point (a second Ctrl-C): SIGKILL to every group left at once.

**Logs**: with ``log_dir``, ``<log_dir>/<component>.log`` (engines' in ``<log_dir>/engines``),
the tails read from there; without, each component's output is piped through a reader
thread that echoes it on this process's stderr and keeps the last lines of its current run
in memory for the tails (engines' logs: the node manager's temporary directory, kept and
named in its log when an engine failed).
"""
from __future__ import annotations

import collections
import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import IO, Any

from motor.config import ClusterConfig
from motor.config.schema import EngineConfig
from motor.errors import ConfigError
from motor.procs import backoff_delay, describe_exit, die_with_parent, group_alive, tail_lines

#: restarts of one component within RESTART_WINDOW_S after which ``motor up`` gives up
RESTART_MAX = 10
RESTART_WINDOW_S = 300.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 10.0
#: lines of a component's log quoted when it fails
TAIL_LINES = 20
#: failed starts in a row of a never-healthy engine after which its node manager gives up
ENGINE_START_ATTEMPTS = 3
#: seconds beyond a component's own stop time before SIGKILL
STOP_MARGIN_S = 5.0
#: an exit status that another try would repeat (bad config, bad option)
_NO_RETRY_STATUS = 2

# each child gets its own session and SIGTERM when motor up dies
_PREEXEC = die_with_parent(signal.SIGTERM, new_session=True)
# lines of this process's stderr: the echo threads and the supervisor's messages
_OUT = threading.Lock()


def say(text: str) -> None:
    """One message on stderr, never interleaved with a component's echoed line."""
    with _OUT:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def quote(lines: Iterable[str]) -> str:
    """Log lines as they are quoted in messages: indented, ``  | line``."""
    out = "\n".join(f"  | {ln}" for ln in lines)
    return out or "  | (nothing)"


class StartError(Exception):
    """The cluster did not start; ``str()`` is the whole message for stderr (component,
    exit status or what is missing, log tails)."""


class Component:
    """One child process of the cluster (restarted in place by :meth:`Cluster.supervise`).

    Parameters
    ----------
    name : ``controller``, ``node-<name>`` or ``coordinator`` (also its log file's name)
    argv : the command after ``python -m motor --log-level LEVEL``
    ready : whether the component serves (probe after a restart)
    stop_bound_s : SIGTERM -> this long -> SIGKILL
    """

    def __init__(self, name: str, argv: list[str], ready: Callable[[], bool],
                 stop_bound_s: float) -> None:
        self.name = name
        self.argv = argv
        self.ready = ready
        self.stop_bound_s = stop_bound_s
        self.proc: subprocess.Popen[bytes] | None = None
        #: ``running`` (ready), ``restarting`` (started again, not ready yet), ``backoff``
        #: (exited, waiting to restart), ``stopped``
        self.state = "stopped"
        self.restart_at = 0.0
        self.restart_times: collections.deque[float] = collections.deque()
        self.in_a_row = 0
        self.log_path: str | None = None
        self._log_offset = 0
        self._ring: collections.deque[str] = collections.deque(maxlen=TAIL_LINES * 10)
        self._echo: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        """The leader runs, or its process group still has a member."""
        p = self.proc
        return p is not None and (p.poll() is None or group_alive(p.pid))

    def exit_status(self) -> int | None:
        p = self.proc
        return None if p is None else p.poll()

    def tail(self, n: int = TAIL_LINES) -> list[str]:
        """The last ``n`` lines of the current (or last) run's output."""
        if self.log_path is not None:
            return tail_lines(self.log_path, n, self._log_offset)
        if self._echo is not None and self.exit_status() is not None:
            self._echo.join(1.0)  # the last lines it wrote before it exited
        return [ln for ln in self._ring if ln.strip()][-n:]

    def where(self) -> str:
        return self.log_path or "its output above"

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


class Cluster:
    """Child processes of one local cluster.

    Parameters
    ----------
    cfg : ClusterConfig
    log_dir : str or None
        where each component's log goes (``controller.log``, ``node-<name>.log``,
        ``coordinator.log``, engines in ``engines/``); ``None`` = echoed on this process's
        stderr.
    log_level : str or None
        of every component (default ``$MOTOR_LOG_LEVEL``, else ``info``).
    source : str
        what the config came from, for error messages (``invalid config <source>: ...``).
    """

    def __init__(self, cfg: ClusterConfig, log_dir: str | None = None,
                 log_level: str | None = None, source: str = "(embedded default)") -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.source = source
        self.log_level = log_level or os.environ.get("MOTOR_LOG_LEVEL", "info")
        self.components: list[Component] = []
        self.config_path: str | None = None
        self._instances_checked = 0.0
        self._threads: list[threading.Thread] = []
        #: this process's client contexts for the controller and the coordinator (TLS on:
        #: :meth:`tls_contexts`, made by :meth:`start`)
        self._ctl_tls: ssl.SSLContext | None = None
        self._coord_tls: ssl.SSLContext | None = None
        #: the last failure of a probe, per URL (said when the start-up bound passes)
        self._probe_errors: dict[str, str] = {}

    # ------------------------------------------------------------------ views
    @property
    def url(self) -> str:
        """The coordinator's base URL, ``https://`` with ``coordinator.tls``."""
        c = self.cfg.coordinator
        scheme = "https" if c.tls is not None else "http"
        return f"{scheme}://{_connect_host(c.host)}:{c.port}"

    @property
    def controller_url(self) -> str:
        """Where this process reaches the controller, ``https://`` with ``controller.tls``."""
        c = self.cfg.controller
        scheme = "https" if c.tls is not None else "http"
        return f"{scheme}://{_connect_host(c.host)}:{c.port}"

    @property
    def endpoints_wanted(self) -> int:
        return sum(_api_ports(n.name, e) for n in self.cfg.nodes for e in n.engines)

    def component(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    # ------------------------------------------------------------- preflight
    def busy_ports(self) -> list[str]:
        """Ports of this config, on this machine, that something already listens on."""
        wanted: list[tuple[str, int, str]] = [
            (self.cfg.controller.host, self.cfg.controller.port, "controller.port"),
            (self.cfg.coordinator.host, self.cfg.coordinator.port, "coordinator.port")]
        for i, n in enumerate(self.cfg.nodes):
            for j, e in enumerate(n.engines):
                wanted += [(e.host, e.base_port + k, f"nodes[{i}].engines[{j}].base_port"
                            + (f"+{k}" if k else "")) for k in range(_api_ports(n.name, e))]
        busy = []
        for host, port, field in wanted:
            if host not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
                continue  # another machine's port: not ours to check
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1" if host in ("localhost", "::1") else host, port))
                except OSError:
                    busy.append(f"{field} = {port} on {host}")
        return busy

    def tls_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        """(controller, coordinator) client contexts of this process's probes, made from the
        config (None for a plain-HTTP one); every TLS file of the config is loaded once, so a
        bad one is an error before anything starts.

        * controller (``controller.tls``): its certificate checked against
          ``controller.tls.ca_file`` and the host name, ``controller.tls.cert_file`` presented
          (the node managers, which present the same, are probed through the controller);
        * coordinator (``coordinator.tls``): its certificate checked against the system's CAs
          and ``controller.tls.ca_file`` when set; with ``coordinator.tls.client_ca_file``
          the control-plane certificate is presented (so that CA must have signed it).

        Raises
        ------
        ConfigError
            a file that is missing or does not load (the field named);
            ``coordinator.tls.client_ca_file`` without ``controller.tls`` (no certificate to
            present to the coordinator's readiness probe).
        """
        from motor.control_tls import check
        from motor.control_tls import client_context as control_client
        from motor.http.tls import client_context, server_context
        ctl, coord = self.cfg.controller.tls, self.cfg.coordinator.tls
        check(ctl)
        ctl_ctx = control_client(ctl) if ctl is not None else None
        coord_ctx = None
        if coord is not None:
            server_context(coord.cert_file, coord.key_file, coord.key_password_file,
                           coord.client_ca_file)   # what the coordinator will load
            if coord.client_ca_file and ctl is None:
                raise ConfigError(
                    f"invalid config {self.source}: coordinator.tls.client_ca_file: motor up's "
                    f"readiness probe of the coordinator needs a client certificate; expected "
                    f"controller.tls (its cert_file is presented, signed by that CA), got "
                    f"controller.tls null")
            if ctl is not None:
                coord_ctx = client_context(
                    ctl.ca_file, cert_file=ctl.cert_file if coord.client_ca_file else None,
                    key_file=ctl.key_file, key_password_file=ctl.key_password_file,
                    field="controller.tls")
            else:
                coord_ctx = client_context(field="coordinator.tls")
        return ctl_ctx, coord_ctx

    def launcher_problems(self) -> list[str]:
        """Engines whose command cannot be run on this machine, one line each naming the
        config field, the expected and the received value.

        Raises
        ------
        ConfigError
            an engine_config the engine backend refuses (the node manager would refuse it).
        """
        from motor.node_manager.engines import plan_node
        out = []
        for i, node in enumerate(self.cfg.nodes):
            plans = plan_node(node, self.cfg)
            for j, e in enumerate(node.engines):
                argv = next((p.processes[0].argv for p in plans if p.engine is e
                             and p.processes), None)
                if not argv:
                    continue
                exe = argv[0]
                if shutil.which(exe) is not None:
                    continue
                if os.sep in exe:
                    why = "a directory" if os.path.isdir(exe) else \
                        "not executable" if os.path.exists(exe) else "no such file"
                else:
                    why = "not found on PATH"
                field = f"nodes[{i}].engines[{j}].launcher"
                if e.launcher:
                    out.append(f"{field}: expected a command that can be run, got "
                               f"{list(e.launcher)} ({exe!r}: {why})")
                else:
                    out.append(f"{field}: expected a command that can be run, got null (the "
                               f"default of kind {e.kind.value}, {exe!r}: {why}; install the "
                               f"engine or set {field})")
        return out

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Start the components in order (module docstring) and wait until every engine
        endpoint is routable; False when ``should_stop()`` became true meanwhile.

        Raises
        ------
        ConfigError
            before anything starts: a port of the config in use on this machine, an engine
            command that cannot be run, an engine_config the engine refuses.
        StartError
            a component exited, an engine failed to start, or ``timeout_s`` passed.
        """
        busy = self.busy_ports()
        if busy:
            raise ConfigError("these ports of the config are already in use on this machine "
                              "(stop what listens there or choose other ports with -c): "
                              + "; ".join(busy))
        problems = self.launcher_problems()
        if problems:
            raise ConfigError(f"invalid config {self.source}:\n  " + "\n  ".join(problems))
        self._ctl_tls, self._coord_tls = self.tls_contexts()
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        fd, self.config_path = tempfile.mkstemp(prefix="motor-cluster-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.cfg.model_dump(mode="json"), f)
        deadline = time.monotonic() + timeout_s
        cfg = self.cfg
        ctl = self._add("controller", ["controller", "-c", self.config_path],
                        self._controller_ready, STOP_MARGIN_S)
        self._spawn(ctl)
        if not self._wait(lambda: self._controller_ready(), deadline, should_stop,
                          lambda: f"the controller did not answer GET {self.controller_url}"
                                  f"/health within {timeout_s:g} s"
                                  + self._probe_error(self.controller_url + "/health"),
                          lambda: [ctl]):
            return False
        nodes = []
        for node in cfg.nodes:
            # the engines stop together: stop_timeout_s, up to 5 s more after a SIGKILL,
            # then the deregistration (2 s at most)
            bound = max((e.stop_timeout_s for e in node.engines), default=0.0) + 7.0 + \
                STOP_MARGIN_S
            c = self._add(f"node-{node.name}", ["node-manager", "-c", self.config_path,
                                                "--node", node.name],
                          functools.partial(self._node_registered, node.name), bound)
            self._spawn(c)
            nodes.append(c)

        def unregistered() -> list[str]:
            known = self._registered_nodes()
            return [n.name for n in cfg.nodes if known is None or n.name not in known]
        if not self._wait(lambda: not unregistered(), deadline, should_stop,
                          lambda: f"the node manager(s) of node(s) {', '.join(unregistered())} "
                                  f"did not register with the controller within {timeout_s:g} s",
                          lambda: [c for c in nodes if c.name[5:] in unregistered()]):
            return False
        coord = self._add("coordinator", ["coordinator", "-c", self.config_path],
                          self._coordinator_live,
                          cfg.coordinator.drain_timeout_s + STOP_MARGIN_S)
        self._spawn(coord)
        want = self.endpoints_wanted
        if not self._wait(lambda: (self.routable() or 0) >= want, deadline, should_stop,
                          lambda: self._not_routable_message(timeout_s),
                          self._tails_for_waiting):
            return False
        for c in self.components:
            c.state = "running"
        return True

    def _add(self, name: str, argv: list[str], ready: Callable[[], bool],
             stop_bound_s: float) -> Component:
        c = Component(name, argv, ready, stop_bound_s)
        self.components.append(c)
        return c

    def _spawn(self, c: Component) -> None:
        cmd = [sys.executable, "-m", "motor", "--log-level", self.log_level] + c.argv
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("MOTOR_ENGINE_START_ATTEMPTS", str(ENGINE_START_ATTEMPTS))
        if self.log_dir:
            env.setdefault("MOTOR_ENGINE_LOG_DIR", os.path.join(self.log_dir, "engines"))
            c.log_path = os.path.join(self.log_dir, f"{c.name}.log")
            with open(c.log_path, "ab") as out:
                out.write(f"==== motor up: starting {c.name} at "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
                out.flush()
                c._log_offset = out.tell()
                c.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, preexec_fn=_PREEXEC,
                                          env=env)
        else:
            c.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, preexec_fn=_PREEXEC, env=env)
            c._ring = collections.deque(maxlen=TAIL_LINES * 10)
            t = threading.Thread(target=_echo, args=(c.proc.stdout, c._ring),
                                 name=f"echo {c.name}", daemon=True)
            t.start()
            c._echo = t
            self._threads.append(t)
        c.state = "restarting"

    def _wait(self, done: Callable[[], bool], deadline: float, should_stop: Callable[[], bool],
              timeout_message: Callable[[], str], tails: Callable[[], list[Component]],
              ) -> bool:
        """Poll ``done()`` until true (True) or ``should_stop()`` (False); raises
        :class:`StartError` when a component exits, an engine fails or at ``deadline``."""
        while True:
            if should_stop():
                return False
            for c in self.components:
                rc = c.exit_status()
                if rc is not None:
                    raise StartError(
                        f"{c.name} exited during start-up ({describe_exit(rc)}); last lines "
                        f"of its log ({c.where()}):\n{quote(c.tail())}")
            self._check_engines()
            if done():
                return True
            for url, why in list(self._probe_errors.items()):
                if why.startswith(_CERT_FAILED):
                    raise StartError(
                        f"GET {url}: {why}; a certificate that does not verify will not start "
                        f"to: check the names (the host of the URL) and the dates of "
                        f"{'coordinator.tls' if url.startswith(self.url) else 'controller.tls'}"
                        f".cert_file and the CA it is checked against")
            if time.monotonic() >= deadline:
                msg = timeout_message()
                for c in tails():
                    msg += f"\nlast lines of {c.name}'s log ({c.where()}):\n{quote(c.tail())}"
                raise StartError(msg)
            time.sleep(0.1)

    def _check_engines(self) -> None:
        """StartError for an instance its node manager gave up on (checked twice a second)."""
        now = time.monotonic()
        if now - self._instances_checked < 0.5:
            return
        self._instances_checked = now
        for inst in self.instances() or []:
            reason = str(inst.get("reason") or "")
            if inst.get("state") != "unhealthy" or not reason.startswith("node manager gave up"):
                continue
            msg = f"engine instance {inst.get('id')} failed to start: {reason}"
            m = _ENGINE_LOG.search(reason)
            tail = engine_tail(m.group(1)) if m else []
            c = self.component(f"node-{inst.get('node')}")
            if tail:
                msg += f"\nlast lines of the engine's log:\n{quote(tail)}"
            elif c is not None:
                msg += f"\nlast lines of {c.name}'s log ({c.where()}):\n{quote(c.tail())}"
            raise StartError(msg)

    def _not_routable_message(self, timeout_s: float) -> str:
        n = self.routable()
        if n is None:
            return (f"the coordinator did not answer GET {self.url}/readiness within "
                    f"{timeout_s:g} s" + self._probe_error(self.url + "/readiness"))
        waiting = [f"{i.get('id')} ({i.get('state')}: {i.get('reason')})"
                   for i in self.instances() or [] if i.get("state") != "ready"]
        return (f"{n} of {self.endpoints_wanted} engine endpoint(s) routable after "
                f"{timeout_s:g} s" + (f"; waiting for: {', '.join(waiting)}" if waiting else
                                      " (the coordinator does not route to all of them)"))

    def _tails_for_waiting(self) -> list[Component]:
        nodes = {str(i.get("node")) for i in self.instances() or [] if i.get("state") != "ready"}
        out = [c for c in self.components if c.name[5:] in nodes and c.name.startswith("node-")]
        coord = self.component("coordinator")
        return out + ([coord] if coord is not None else [])

    # ------------------------------------------------------------------ probes
    def _get(self, url: str, any_status: bool = False) -> Any:
        """:func:`_get_json` with this process's TLS context for ``url``'s component."""
        ctx = self._coord_tls if url.startswith(self.url + "/") else self._ctl_tls
        return _get_json(url, any_status=any_status, context=ctx, errors=self._probe_errors)

    def _probe_error(self, url: str) -> str:
        why = self._probe_errors.get(url)
        return f" (last try: {why})" if why else ""

    def _controller_ready(self) -> bool:
        return self._get(self.controller_url + "/health") is not None

    def _coordinator_live(self) -> bool:
        return self._get(self.url + "/health") is not None

    def _registered_nodes(self) -> set[str] | None:
        got = self._get(self.controller_url + "/v1/nodes")
        if not isinstance(got, dict):
            return None
        return {str(n.get("node")) for n in got.get("nodes") or [] if isinstance(n, dict)}

    def _node_registered(self, node: str) -> bool:
        return node in (self._registered_nodes() or set())

    def instances(self) -> list[dict[str, Any]] | None:
        """The controller's instance table now (None when it does not answer)."""
        got = self._get(self.controller_url + "/v1/instances")
        if not isinstance(got, dict):
            return None
        return [i for i in got.get("instances") or [] if isinstance(i, dict)]

    def routable(self) -> int | None:
        """Endpoints the coordinator routes to now (None if it does not answer)."""
        got = self._get(self.url + "/readiness", any_status=True)
        if not isinstance(got, dict):
            return None
        try:
            return int(got.get("routable_endpoints", 0))
        except (TypeError, ValueError):
            return None

    # ------------------------------------------------------------- supervision
    def supervise(self, now: float | None = None) -> str | None:
        """One round of supervision: restart what exited (backoff), notice what came back;
        returns why it gives up (the caller stops the cluster), else None."""
        now = time.monotonic() if now is None else now
        for c in self.components:
            if c.state in ("running", "restarting"):
                rc = c.exit_status()
                if rc is None:
                    if c.state == "restarting" and c.ready():
                        c.state = "running"
                        c.in_a_row = 0
                        say(f"motor up: {c.name} restarted (pid {c.pid}) and serving again")
                    continue
                while c.restart_times and now - c.restart_times[0] > RESTART_WINDOW_S:
                    c.restart_times.popleft()
                what = f"{c.name} exited ({describe_exit(rc)})"
                tail = f"last lines of its log ({c.where()}):\n{quote(c.tail())}"
                if rc == _NO_RETRY_STATUS:
                    return f"{what}: a bad config or option, not restarting; {tail}"
                if len(c.restart_times) >= RESTART_MAX:
                    return (f"{what}; giving up after {len(c.restart_times)} restart(s) within "
                            f"{RESTART_WINDOW_S:g} s; {tail}")
                c.in_a_row += 1
                delay = backoff_delay(c.in_a_row, BACKOFF_INITIAL_S, BACKOFF_MAX_S)
                say(f"motor up: {what}; restarting in {delay:g} s (restart "
                    f"{len(c.restart_times) + 1} of {RESTART_MAX} in {RESTART_WINDOW_S:g} s)")
                # leftovers of its process group (a multi-worker coordinator's workers)
                c.signal(signal.SIGKILL)
                c.state = "backoff"
                c.restart_at = now + delay
            elif c.state == "backoff" and now >= c.restart_at:
                c.restart_times.append(now)
                self._spawn(c)
        return None

    # ------------------------------------------------------------------- stop
    def stop(self, force: Callable[[], bool] = lambda: False) -> None:
        """Stop in order, drain first (module docstring); idempotent."""
        by_kind: list[list[Component]] = [
            [c for c in self.components if c.name == "coordinator"],
            [c for c in self.components if c.name.startswith("node-")],
            [c for c in self.components if c.name == "controller"]]
        for group in by_kind:
            live = [c for c in group if c.alive()]
            if not live:
                continue
            if force():
                break
            for c in live:
                c.signal(signal.SIGTERM)
            bound = max(c.stop_bound_s for c in live)
            end = time.monotonic() + bound
            while any(c.alive() for c in live) and time.monotonic() < end and not force():
                time.sleep(0.05)
            for c in live:
                if c.alive():
                    if not force():
                        say(f"motor up: {c.name} did not stop within {bound:g} s after "
                            f"SIGTERM: SIGKILL")
                    c.signal(signal.SIGKILL)
        for c in self.components:  # forced, or anything left
            if c.alive():
                c.signal(signal.SIGKILL)
        for c in self.components:
            if c.proc is not None:
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                if c.proc.stdout is not None:
                    c.proc.stdout.close()
            c.state = "stopped"
        for t in self._threads:
            t.join(1.0)
        self._threads.clear()
        if self.config_path is not None:  # the path stays known (tests look for it)
            try:
                os.unlink(self.config_path)
            except OSError:
                pass


#: where an engine's log is, in the reason its node manager gives when it gave up
_ENGINE_LOG = re.compile(r"its log: (\S+)$")
#: the line the node manager writes in an engine's log before each start
_ENGINE_RUN_HEADER = "==== motor: starting "


def engine_tail(path: str, n: int = TAIL_LINES) -> list[str]:
    """The last ``n`` lines of the last run in an engine's log file."""
    lines = tail_lines(path, n)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(_ENGINE_RUN_HEADER):
            return [ln for ln in lines[i + 1:] if not ln.startswith("==== env: ")]
    return lines


def _echo(stream: IO[bytes] | None, ring: collections.deque[str]) -> None:
    """Reader thread of a piped component: each line to stderr and into ``ring``."""
    if stream is None:
        return
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            ring.append(line.rstrip("\n"))
            with _OUT:
                sys.stderr.write(line if line.endswith("\n") else line + "\n")
                sys.stderr.flush()
    except (OSError, ValueError):  # closed at stop
        pass


def _connect_host(host: str) -> str:
    """Where to connect to reach a server listening on ``host``."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


#: how a probe's failed certificate check starts (no retry fixes it)
_CERT_FAILED = "certificate verification failed"


def _get_json(url: str, timeout_s: float = 1.0, any_status: bool = False,
              context: ssl.SSLContext | None = None, errors: dict[str, str] | None = None,
              ) -> Any:
    """The JSON body of GET ``url`` when it answers 200 (any status with ``any_status``),
    else None. ``context``: the client context of an ``https://`` URL; ``errors``: gets the
    reason of a failure under ``url`` (removed when it answers)."""
    why = ""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
            got = json.loads(r.read())
        if errors is not None:
            errors.pop(url, None)
        return got
    except urllib.error.HTTPError as e:
        why = f"status {e.code}"
        if any_status:
            try:
                return json.loads(e.read())
            except (ValueError, OSError):
                pass
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            why = f"{_CERT_FAILED}: {e.reason.verify_message or e.reason}"
        else:
            why = str(e.reason)
    except (OSError, ValueError, http.client.HTTPException) as e:
        # HTTPException: not an HTTP answer (a loopback port nobody listens on yet can connect
        # the client to itself and read back its own request)
        why = f"{type(e).__name__}: {e}"
    if errors is not None:
        errors[url] = why
    return None


__all__ = ["Cluster", "Component", "StartError", "say"]


def _api_ports(node: str, e: EngineConfig) -> int:
    """API ports (= routable endpoints) engine group ``e`` opens on node ``node``: one per
    instance and DP rank; an instance spanning nodes (``span``) has one, on its DP master's
    node (the first of ``span.nodes``), and none on its headless nodes."""
    if e.span is None:
        return e.count * e.dp_size
    return 1 if node == e.span.nodes[0] else 0

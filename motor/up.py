"""``motor up``: a whole cluster on one machine from one config.

Starts the controller, one node manager per node of the config and the
coordinator as child processes (each in its own process group, each told by the
kernel to stop if ``motor up`` dies: ``PR_SET_PDEATHSIG``), waits until the
coordinator's ``/readiness`` answers 200, prints the endpoint, and on Ctrl-C /
SIGTERM stops them in reverse order (SIGTERM, then SIGKILL of the group after a
timeout), so nothing is left behind.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import IO

from motor.config import ClusterConfig, load_config, load_default_config
from motor.config.load import parse_config
from motor.errors import ConfigError
from motor.procs import die_with_parent

logger = logging.getLogger(__name__)

# each child gets its own session and SIGTERM when motor up dies
_PREEXEC = die_with_parent(signal.SIGTERM, new_session=True)


class Cluster:
    """Child processes of one local cluster.

    Parameters
    ----------
    cfg : ClusterConfig
    log_dir : str or None
        where each component's log goes (``controller.log``, ``node-<name>.log``,
        ``coordinator.log``); ``None`` = inherit this process's stderr.
    """

    def __init__(self, cfg: ClusterConfig, log_dir: str | None = None,
                 log_level: str | None = None) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.log_level = log_level or os.environ.get("MOTOR_LOG_LEVEL", "info")
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        fd, self.config_path = tempfile.mkstemp(prefix="motor-cluster-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(cfg.model_dump(mode="json"), f)
        self._logs: list[object] = []

    @property
    def url(self) -> str:
        c = self.cfg.coordinator
        return f"http://{c.host}:{c.port}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        cmd = [sys.executable, "-m", "motor", "--log-level", self.log_level] + argv
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.log_dir:
            env.setdefault("MOTOR_ENGINE_LOG_DIR", os.path.join(self.log_dir, "engines"))
        out: IO[bytes] | None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
            self._logs.append(out)
        else:
            out = None
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             preexec_fn=_PREEXEC, env=env)
        logger.info("started %s (pid %d)", name, p.pid)
        self.procs.append((name, p))

    def busy_ports(self) -> list[str]:
        """Ports of this config, on this machine, that something already listens on."""
        wanted: list[tuple[str, int, str]] = [
            (self.cfg.controller.host, self.cfg.controller.port, "controller.port"),
            (self.cfg.coordinator.host, self.cfg.coordinator.port, "coordinator.port")]
        for i, n in enumerate(self.cfg.nodes):
            for j, e in enumerate(n.engines):
                wanted += [(e.host, e.base_port + k, f"nodes[{i}].engines[{j}].base_port"
                            + (f"+{k}" if k else "")) for k in range(e.count * e.dp_size)]
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

    def start(self) -> None:
        """Start every component.

        Raises
        ------
        ConfigError
            when a port of the config is already in use on this machine (another cluster,
            another server): motor would otherwise probe and route to whatever listens there.
        """
        busy = self.busy_ports()
        if busy:
            raise ConfigError("these ports of the config are already in use on this machine "
                              "(stop what listens there or choose other ports with -c): "
                              + "; ".join(busy))
        self._spawn("controller", ["controller", "-c", self.config_path])
        for node in self.cfg.nodes:
            self._spawn(f"node-{node.name}", ["node-manager", "-c", self.config_path,
                                              "--node", node.name])
        self._spawn("coordinator", ["coordinator", "-c", self.config_path])

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs if p.poll() is not None]

    def wait_ready(self, timeout_s: float, min_endpoints: int | None = None,
                   should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the coordinator routes to ``min_endpoints`` endpoints (default: all
        configured ones) or ``timeout_s`` passes; False if a component died or timed out."""
        want = min_endpoints if min_endpoints is not None else sum(
            e.count * e.dp_size for n in self.cfg.nodes for e in n.engines)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not should_stop():
            dead = self.dead()
            if dead:
                logger.error("cluster component(s) exited during start-up: %s", ", ".join(dead))
                return False
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=1.0) as r:
                    body = json.loads(r.read())
                    if body.get("routable_endpoints", 0) >= want:
                        return True
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        return False

    def routable(self) -> int | None:
        """Endpoints the coordinator routes to now (None if it does not answer)."""
        try:
            with urllib.request.urlopen(self.url + "/readiness", timeout=1.0) as r:
                return int(json.loads(r.read()).get("routable_endpoints", 0))
        except urllib.error.HTTPError as e:
            try:
                return int(json.loads(e.read()).get("routable_endpoints", 0))
            except (ValueError, OSError):
                return None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop in reverse order of start: the coordinator, then the node managers (which stop
        their engines and deregister), then the controller; SIGTERM to each process group,
        SIGKILL after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        controller = [(n, p) for n, p in self.procs if n == "controller"]
        others = [(n, p) for n, p in reversed(self.procs) if n != "controller"]
        for batch in (others, controller):
            for _name, p in batch:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for name, p in batch:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time: SIGKILL", name)
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
        self.procs.clear()
        for f in self._logs:
            f.close()  # type: ignore[attr-defined]
        try:
            os.unlink(self.config_path)
        except OSError:
            pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="cluster config (YAML/JSON); default: the embedded "
                                          "default (simulated engines on loopback)")
    p.add_argument("--mode", choices=["union", "pd"], default="union",
                   help="without -c: which embedded cluster (union engines, or prefill + decode "
                        "engines with vLLM's prefill-first handshake)")
    p.add_argument("--port", type=int, help="coordinator port (overrides coordinator.port)")
    p.add_argument("--log-dir", help="write each component's log to DIR/<component>.log (engines' "
                                     "logs to DIR/engines) "
                                     "instead of this terminal")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for every engine to be routable")


def load_for_cli(args: argparse.Namespace) -> ClusterConfig:
    """The config of ``-c`` (or the embedded one) with command-line overrides.

    Raises
    ------
    ConfigError
        also when the config has no engine to run (an empty file would start nothing).
    """
    cfg = load_config(args.config) if args.config else \
        load_default_config(getattr(args, "mode", None) or "union")
    if not any(n.engines for n in cfg.nodes):
        raise ConfigError(f"invalid config {args.config}: nodes is expected to hold at least one "
                          f"node with at least one engine, got "
                          f"{len(cfg.nodes)} node(s) and no engine")
    if getattr(args, "port", None):
        data = cfg.model_dump(mode="json")
        data["coordinator"]["port"] = args.port
        cfg = parse_config(data, "command line")
    return cfg


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_for_cli(args)
    except ConfigError as e:
        print(f"motor up: {e}", file=sys.stderr)
        return 2
    stopping = {"flag": False}

    def on_signal(signum: int, frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster(cfg, args.log_dir)
    try:
        try:
            cluster.start()
        except ConfigError as e:
            print(f"motor up: {e}", file=sys.stderr)
            return 2
        if not cluster.wait_ready(args.ready_timeout, should_stop=lambda: stopping["flag"]):
            if not stopping["flag"]:
                print(f"motor up: the cluster did not become ready within {args.ready_timeout:g} s",
                      file=sys.stderr)
                return 1
            return 0
        models = ", ".join(sorted({e.model_name for n in cfg.nodes for e in n.engines}))
        print(f"motor is up: OpenAI API at {cluster.url}/v1 (model: {models}); Ctrl-C stops it",
              flush=True)
        want = sum(e.count * e.dp_size for n in cfg.nodes for e in n.engines)
        last = want
        next_check = time.monotonic() + 2.0
        while not stopping["flag"]:
            dead = [n for n in cluster.dead()]
            if dead:
                print(f"motor up: component(s) exited: {', '.join(dead)}; stopping",
                      file=sys.stderr)
                return 1
            if time.monotonic() >= next_check:
                # say so when engines drop out of rotation (or come back), instead of staying
                # silent while requests start failing
                next_check = time.monotonic() + 2.0
                n = cluster.routable()
                if n is not None and n != last:
                    print(f"motor up: {n} of {want} engine endpoint(s) routable"
                          + ("" if n == want else "; see the logs"
                             + (f" in {args.log_dir}" if args.log_dir else "")), file=sys.stderr)
                    last = n
            time.sleep(0.2)
        return 0
    finally:
        cluster.stop()
        print("motor up: stopped", file=sys.stderr)

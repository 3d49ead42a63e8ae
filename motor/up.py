"""``motor up``: a whole cluster on one machine from one config.

Checks the options and the config, then starts the controller, the node managers and the
coordinator in that order (:class:`motor.cluster.Cluster`), prints the endpoint once every
engine is routable, supervises the components (a dead one is restarted with backoff, said on
stderr), and on Ctrl-C / SIGTERM stops them in order, drain first: the coordinator finishes
the requests in flight while the engines still run, then the node managers stop their engines,
then the controller. A second Ctrl-C / SIGTERM kills what is left at once. Exit status: 0 after
a stop on request, 1 when the cluster failed (start-up, or a component that keeps dying), 2 for
bad options or a bad config (nothing started). See docs/operations.md.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable

from motor.cluster import Cluster, StartError, say
from motor.cli import (OptionError, add_config_option, add_log_dir_option, add_port_option,
                       apply_overrides, fail, positive_float)
from motor.config import ClusterConfig, load_config, load_default_config
from motor.errors import ConfigError

#: seconds between two looks at the routable endpoint count while up
_ROUTABLE_EVERY_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p, default="the embedded default config, simulated engines on loopback")
    p.add_argument("--mode", choices=["union", "pd"], default=None,
                   help="without -c: which embedded cluster, union engines or prefill + decode "
                        "engines with vLLM's prefill-first handshake (default: union)")
    add_port_option(p, "coordinator.port of the config", any_free=False,
                    what="for the OpenAI API")
    add_log_dir_option(p, "each component's log as DIR/<component>.log, the engines' in "
                          "DIR/engines", "this terminal")
    p.add_argument("--ready-timeout", type=positive_float, default=120.0, metavar="S",
                   help="seconds to wait for the whole start-up, until every engine is routable")


#: a second SIGINT / SIGTERM forces the stop only this long after the first
FORCE_AFTER_S = 0.5


def load_for_cli(args: argparse.Namespace) -> ClusterConfig:
    """The config of ``-c`` (or the embedded one of ``--mode``) with ``--port``.

    Raises
    ------
    ConfigError
        also when the config has no engine to run (an empty file would start nothing), and
        :class:`motor.cli.OptionError` for ``--mode`` with ``-c`` or a refused ``--port``.
    """
    mode = getattr(args, "mode", None)
    if args.config and mode is not None:
        raise OptionError("--mode", f"expected no --mode with -c/--config (the config file "
                                    f"gives the mode, coordinator.mode), got {mode!r}")
    cfg = load_config(args.config) if args.config else load_default_config(mode or "union")
    if not any(n.engines for n in cfg.nodes):
        raise ConfigError(f"invalid config {args.config}: nodes is expected to hold at least one "
                          f"node with at least one engine, got "
                          f"{len(cfg.nodes)} node(s) and no engine")
    cfg = apply_overrides(cfg, {"coordinator.port": ("--port", getattr(args, "port", None))})
    cfg = with_management_ports(cfg)
    # the coordinator's key sources and TLS files: a bad one is an error before anything starts
    import os

    from motor.coordinator.edge import check_edge
    from motor.coordinator.tokenize import check_tokenizers
    check_edge(cfg.coordinator, os.environ.get("MOTOR_API_KEYS", ""))
    check_tokenizers(cfg.coordinator)   # the routing tokenizers' files, as the coordinator
    return cfg


def with_management_ports(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with ``mgmt_port: 0`` (any free port) for every node that has none: the
    controller reaches a node's engines through its node manager's management API (``motor
    ctl drain / stop / start / restart``), which is off without a port. A node's port is
    registered with the controller, so its number does not matter."""
    if all(n.mgmt_port is not None for n in cfg.nodes):
        return cfg
    nodes = [n if n.mgmt_port is not None else n.model_copy(update={"mgmt_port": 0})
             for n in cfg.nodes]
    return cfg.model_copy(update={"nodes": nodes})


def make_log_dir(path: str | None) -> None:
    """Create ``--log-dir`` before anything starts.

    Raises
    ------
    OptionError
        it cannot be created (a file in the way since the option was checked, no permission).
    """
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OptionError("--log-dir", f"expected a directory, got {path!r} "
                                       f"({e.strerror or e})") from None


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_for_cli(args)
        make_log_dir(args.log_dir)
    except ConfigError as e:
        return fail("up", e)
    signals = {"count": 0, "first": 0.0}

    def on_signal(signum: int, frame: object) -> None:
        now = time.monotonic()
        if signals["count"] == 1 and now - signals["first"] < FORCE_AFTER_S:
            # the same stop delivered twice (a wrapper such as `timeout` or a terminal signals
            # the process group and this process): not a second Ctrl-C
            return
        signals["count"] += 1
        if signals["count"] == 1:
            signals["first"] = now
            say(f"motor up: {signal.Signals(signum).name}: stopping (the coordinator drains for "
                f"up to {cfg.coordinator.drain_timeout_s:g} s); Ctrl-C again to force")
        elif signals["count"] == 2:
            say("motor up: stopping now: SIGKILL to every component")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster(cfg, args.log_dir, source=args.config or "(embedded default)",
                      log_level=getattr(args, "log_level", None))
    status = 0
    try:
        try:
            if not cluster.start(args.ready_timeout, should_stop=lambda: signals["count"] > 0):
                return 0
        except ConfigError as e:  # nothing started
            status = fail("up", e)
            return status
        except StartError as e:
            say(f"motor up: the cluster did not start: {e}")
            status = 1
            return 1
        models = ", ".join(sorted({e.model_name for n in cfg.nodes for e in n.engines}))
        print(f"motor is up: OpenAI API at {cluster.url}/v1 (model: {models}); Ctrl-C stops it",
              flush=True)
        status = _serve(cluster, args, lambda: signals["count"] > 0)
        return status
    finally:
        if cluster.components:
            cluster.stop(force=lambda: signals["count"] > 1)
            say("motor up: stopped" if status == 0 else "motor up: stopped (the cluster failed)")


def _serve(cluster: Cluster, args: argparse.Namespace, stopping: Callable[[], bool]) -> int:
    """Supervise until a stop is asked (0) or supervision gives up (1)."""
    want = cluster.endpoints_wanted
    last = want
    next_check = time.monotonic() + _ROUTABLE_EVERY_S
    while not stopping():
        why = cluster.supervise()
        if why is not None:
            say(f"motor up: {why}\nmotor up: stopping the cluster")
            return 1
        if time.monotonic() >= next_check:
            # say so when engines drop out of rotation (or come back), instead of staying
            # silent while requests start failing
            next_check = time.monotonic() + _ROUTABLE_EVERY_S
            n = cluster.routable()
            if n is not None and n != last:
                say(f"motor up: {n} of {want} engine endpoint(s) routable"
                    + ("" if n == want else "; see the logs"
                       + (f" in {args.log_dir}" if args.log_dir else "")))
                last = n
        time.sleep(0.2)
    return 0


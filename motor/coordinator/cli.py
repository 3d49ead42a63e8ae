"""``motor coordinator``: the gateway process."""
from __future__ import annotations

import argparse
import logging

from motor.config import load_config, load_default_config
from motor.config.schema import ClusterConfig, DeploymentMode, PolicyName
from motor.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="cluster config file (YAML/JSON); default: the embedded "
                                          "default. The 'coordinator' section is used.")
    p.add_argument("--host", help="listen address (overrides coordinator.host)")
    p.add_argument("--port", type=int, help="listen port (overrides coordinator.port)")
    p.add_argument("--backend", action="extend", nargs="+", default=[], metavar="[ROLE=]URL",
                   help="standalone mode, no controller: an engine to route to, as "
                        "http://HOST:PORT (union) or prefill=URL / decode=URL; repeat or list "
                        "several. The coordinator then health-checks them itself.")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ADDRESS",
                   help="standalone mode: the KV-event publisher of backend URL, as "
                        "[bind:]tcp://HOST:PORT[;replay=ENDPOINT] (connect to a publisher that "
                        "binds, e.g. motor sim or vLLM tcp://*:P; 'bind:' for a vLLM publisher "
                        "that connects, e.g. its endpoint tcp://127.0.0.1:P); repeat per backend. "
                        "Used by --policy kv_affinity (see docs/kv-routing.md)")
    p.add_argument("--controller", metavar="URL",
                   help="controller to follow (default: controller.host/port of the config); "
                        "ignored with --backend")
    p.add_argument("--policy", choices=[x.value for x in PolicyName],
                   help="routing policy (overrides coordinator.policy)")
    p.add_argument("--mode", choices=[x.value for x in DeploymentMode],
                   help="deployment mode (overrides coordinator.mode)")
    p.add_argument("--workers", type=int, help="ingress worker processes on the same port "
                                               "(SO_REUSEPORT; overrides coordinator.workers)")


def _kv_events_arg(spec: str) -> tuple[str, str]:
    """``http://HOST:PORT=ADDRESS`` -> (backend URL, KV-event address), both checked."""
    from motor.protocol.kv_events import KvEventsAddress
    url, sep, addr = spec.partition("=")  # a backend URL has no '='
    if not sep or not url.startswith("http://"):
        raise ConfigError(f"--kv-events is expected as http://HOST:PORT=ADDRESS, got {spec!r}")
    KvEventsAddress.parse(addr)
    return url.rstrip("/"), addr


def run(cfg: ClusterConfig, backends: list[str] | None = None,
        controller_url: str | None = None) -> int:
    """Serve ``cfg.coordinator`` until SIGTERM / SIGINT; returns the exit status.

    One worker: this process serves (:func:`motor.coordinator.app.serve`, writing its port
    to ``$MOTOR_READY_FILE`` when set). ``coordinator.workers > 1``: the supervisor runs
    the feed and the workers (:func:`motor.coordinator.supervisor.run_workers`).
    ``backends``: standalone mode's ``--backend`` specs; ``controller_url``: the
    controller to follow otherwise (default: ``cfg.controller.url``).
    """
    if cfg.coordinator.workers > 1:
        from motor.coordinator.supervisor import run_workers
        return run_workers(cfg, backends, controller_url, cfg.coordinator.workers)
    import asyncio
    import os

    from motor.coordinator.app import serve
    from motor.http.server import install_uvloop
    install_uvloop()
    asyncio.run(serve(cfg, backends, controller_url,
                      ready_file=os.environ.get("MOTOR_READY_FILE")))
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config) if args.config else load_default_config()
        over = {k: v for k, v in (("host", args.host), ("port", args.port),
                                  ("policy", args.policy), ("mode", args.mode),
                                  ("workers", args.workers)) if v is not None}
        kv_events = dict(_kv_events_arg(x) for x in args.kv_events)
        if over or kv_events:
            from motor.config.load import parse_config
            data = cfg.model_dump(mode="json")
            data["coordinator"].update(over)
            data["coordinator"]["kv"]["events"]["backends"].update(kv_events)
            cfg = parse_config(data, "command line")
        c = cfg.coordinator
        if c.mode == DeploymentMode.PD_DECODE_FIRST and c.workers > 1:
            raise ConfigError(
                f"coordinator.workers is expected to be 1 with mode pd_decode_first (the "
                f"metaserver callback must reach the worker holding the request), got {c.workers}")
        from motor.coordinator.backends import parse_backend
        for b in args.backend:
            parse_backend(b)
        from motor.coordinator.policy import make_policy
        make_policy(cfg.coordinator.policy.value)
        from motor.coordinator.server import Coordinator  # noqa: F401
    except (ConfigError, ValueError) as e:
        print(f"motor coordinator: {e}")
        return 2
    import socket
    c = cfg.coordinator
    with socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((c.host, c.port))
        except OSError as e:
            from motor.http.server import ListenError
            print(f"motor coordinator: {ListenError(c.host, c.port, e, 'coordinator.port / --port').message}")
            return 1
    return run(cfg, args.backend or None, args.controller)

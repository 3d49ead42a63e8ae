"""``motor coordinator``: the gateway process."""
from __future__ import annotations

import argparse
import logging

from motor.cli import (add_config_option, add_controller_option, add_host_option,
                       add_port_option, apply_overrides, fail, http_url, positive_int)
from motor.config import load_config, load_default_config
from motor.config.schema import ClusterConfig, DeploymentMode, PolicyName
from motor.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p, "its coordinator and controller sections are used")
    add_host_option(p, "coordinator.host of the config")
    add_port_option(p, "coordinator.port of the config", any_free=False)
    p.add_argument("--backend", action="extend", nargs="+", default=[], metavar="[ROLE=]URL",
                   type=_backend_arg,
                   help="standalone mode, no controller: an engine to route to, as "
                        "http://HOST:PORT (union) or prefill=URL / decode=URL; repeat or list "
                        "several. The coordinator then health-checks them itself.")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ADDRESS",
                   type=_kv_events_arg,
                   help="standalone mode: the KV-event publisher of backend URL, as "
                        "[bind:]tcp://HOST:PORT[;replay=ENDPOINT] (connect to a publisher that "
                        "binds, e.g. motor sim or vLLM tcp://*:P; 'bind:' for a vLLM publisher "
                        "that connects, e.g. its endpoint tcp://127.0.0.1:P); repeat per backend. "
                        "Used by --policy kv_affinity (see docs/kv-routing.md)")
    add_controller_option(p, "its instance table is followed; ignored with --backend")
    p.add_argument("--policy", choices=[x.value for x in PolicyName], metavar="POLICY",
                   help="routing policy: " + ", ".join(x.value for x in PolicyName)
                        + " (default: coordinator.policy of the config)")
    p.add_argument("--mode", choices=[x.value for x in DeploymentMode], metavar="MODE",
                   help="deployment mode: " + ", ".join(x.value for x in DeploymentMode)
                        + " (default: coordinator.mode of the config)")
    p.add_argument("--workers", type=positive_int, metavar="N",
                   help="ingress worker processes on the same port (SO_REUSEPORT) "
                        "(default: coordinator.workers of the config)")
    p.add_argument("--access-log", action="store_const", const=True, default=None,
                   help="one structured log line per inference request at info level, on the "
                        "logger motor.access (default: coordinator.access_log of the config)")


def _backend_arg(spec: str) -> str:
    """argparse type of ``--backend``: ``[ROLE=]http(s)://HOST:PORT``."""
    from motor.coordinator.backends import parse_backend
    try:
        parse_backend(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected [ROLE=]http(s)://HOST:PORT with ROLE one of union, prefill, decode, "
            f"got {spec!r}") from None
    return spec


def _kv_events_arg(spec: str) -> tuple[str, str]:
    """argparse type of ``--kv-events``: ``http://HOST:PORT=ADDRESS`` -> (backend URL,
    KV-event address), both checked."""
    from motor.protocol.kv_events import KvEventsAddress
    url, sep, addr = spec.partition("=")  # a backend URL has no '='
    try:
        if not sep:
            raise ValueError
        http_url(url)
        KvEventsAddress.parse(addr)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"expected http://HOST:PORT=[bind:]tcp://HOST:PORT[;replay=ENDPOINT], "
            f"got {spec!r}") from None
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
                      ready_file=os.environ.get("MOTOR_READY_FILE"), own_process=True))
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config) if args.config else load_default_config()
        if args.backend or not args.config:
            # standalone, or the embedded stand-in: the nodes are not what this coordinator
            # routes to, so the role checks of the engines do not apply to them
            cfg = cfg.model_copy(update={"nodes": []})
        kv_events = dict(args.kv_events)
        cfg = apply_overrides(cfg, {
            "coordinator.host": ("--host", args.host), "coordinator.port": ("--port", args.port),
            "coordinator.policy": ("--policy", args.policy),
            "coordinator.mode": ("--mode", args.mode),
            "coordinator.workers": ("--workers", args.workers),
            "coordinator.access_log": ("--access-log", args.access_log),
            "coordinator.kv.events.backends": (
                "--kv-events",
                {**cfg.coordinator.kv.events.backends, **kv_events} if kv_events else None)})
        if args.backend:   # (pd_decode_first with workers > 1: refused by the schema)
            from motor.cli import OptionError
            from motor.config.schema import role_problem
            from motor.coordinator.backends import parse_backend
            problem = role_problem(cfg.coordinator.mode,
                                   {parse_backend(b)[0] for b in args.backend}, "backend",
                                   "--mode" if args.mode else "coordinator.mode")
            if problem is not None:
                raise OptionError("--backend", f"{problem} ({' '.join(args.backend)})")
        from motor.coordinator.policy import make_policy
        make_policy(cfg.coordinator.policy.value)
        from motor.coordinator.tokenize import check_tokenizers
        check_tokenizers(cfg.coordinator)   # each routing tokenizer's files, read once here
        # key sources and TLS files: read now, so a bad one is an error before anything starts
        import os

        from motor.coordinator.backends import is_https
        from motor.coordinator.edge import check_edge
        check_edge(cfg.coordinator, os.environ.get("MOTOR_API_KEYS", ""),
                   any(is_https(b) for b in args.backend))
        if not args.backend:   # controller mode: its URL's scheme and controller.tls's files
            from motor.control_link import controller_urls
            from motor.control_tls import check, controller_endpoint
            urls = controller_urls(args.controller or cfg.controller.urls)
            if not urls:
                raise ConfigError("--controller: expected at least one controller URL, got none")
            for u in urls:
                controller_endpoint(u, cfg.controller.tls)
            check(cfg.controller.tls)
        from motor.coordinator.server import Coordinator  # noqa: F401
    except (ConfigError, ValueError) as e:
        return fail("coordinator", e)
    import socket
    c = cfg.coordinator
    with socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((c.host, c.port))
        except OSError as e:
            from motor.http.server import ListenError
            if ListenError(c.host, c.port, e).bad_host:
                field = "--host" if args.host is not None else "coordinator.host"
            else:
                field = "--port" if args.port is not None else "coordinator.port"
            return fail("coordinator", ListenError(c.host, c.port, e, field).message, 1)
    return run(cfg, args.backend or None, args.controller)

"""``motor controller``: the node / instance registry and the live instance table."""
from __future__ import annotations

import argparse
import logging

from motor.cli import add_config_option, add_host_option, add_port_option, fail

logger = logging.getLogger("motor.controller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the controller: node managers register their engine instances and heartbeat "
        "here; coordinators long-poll GET /v1/instances for the versioned instance table. "
        "API: POST /v1/nodes/register, /v1/nodes/heartbeat, /v1/nodes/deregister; "
        "GET /v1/instances?after=V&timeout=S, /v1/nodes, /health, /readiness, /metrics; "
        "POST /v1/instances/ID/{drain,stop,start,restart} (lifecycle). With controller.etcd, "
        "several controllers elect one leader; the others redirect to it (307). "
        "Stops cleanly (exit status 0) on SIGTERM or SIGINT.")
    add_config_option(parser, "its controller section gives the address and the heartbeat "
                              "timeouts")
    add_host_option(parser, "controller.host of the config")
    add_port_option(parser, "controller.port of the config", any_free=True)
    parser.add_argument("--advertise-host", default=None, metavar="HOST",
                        help="the address others reach this controller at, published as the "
                             "leader's address with controller.etcd (default: "
                             "controller.advertise_host, else the listen host)")


def main(args: argparse.Namespace) -> int:
    from motor.config.load import load_config, load_default_config
    from motor.controller.server import ListenError, run_controller
    from motor.errors import ConfigError

    try:
        cfg = load_config(args.config) if args.config else load_default_config()
        if cfg.controller.tls is not None:   # a bad certificate file: exit 2 before listening
            from motor.control_tls import server_context
            server_context(cfg.controller.tls)
        if cfg.controller.etcd is not None and cfg.controller.etcd.tls is not None:
            from motor.controller.etcd_store import credentials
            credentials(cfg.controller.etcd)
    except ConfigError as e:
        return fail("controller", e)
    try:
        if args.advertise_host is not None:
            from motor.config.schema import valid_host
            try:
                valid_host(args.advertise_host)
            except ValueError as e:
                return fail("controller", f"--advertise-host: {e}")
        elif cfg.controller.etcd is not None and cfg.controller.advertise_host is None and \
                (args.host or cfg.controller.host) in ("0.0.0.0", "::"):
            return fail("controller", "controller.advertise_host: expected the address others "
                                      "reach this controller at (the listen host is a wildcard "
                                      "and controller.etcd is set; or give --advertise-host), "
                                      "got null")
        return run_controller(cfg.controller, args.host, args.port, args.advertise_host)
    except ListenError as e:
        if e.bad_host:
            field = "--host" if args.host is not None else "controller.host"
        else:
            field = "--port" if args.port is not None else "controller.port"
        return fail("controller", f"cannot listen on {e.host}:{e.port} ({field}): {e.reason}", 1)
    except OSError as e:
        logger.error("cannot start the controller: %s", e)
        return 1

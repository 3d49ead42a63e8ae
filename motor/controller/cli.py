"""``motor controller``: the node / instance registry and the live instance table."""
from __future__ import annotations

import argparse
import logging
import sys

from motor.cli import port_number

logger = logging.getLogger("motor.controller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the help texts below say their defaults themselves (they come from the config)
    parser.formatter_class = argparse.HelpFormatter
    parser.description = (
        "Run the controller: node managers register their engine instances and heartbeat "
        "here; coordinators long-poll GET /v1/instances for the versioned instance table. "
        "API: POST /v1/nodes/register, /v1/nodes/heartbeat, /v1/nodes/deregister; "
        "GET /v1/instances?after=V&timeout=S, /v1/nodes, /health, /readiness, /metrics. "
        "Stops cleanly (exit status 0) on SIGTERM or SIGINT.")
    parser.add_argument("-c", "--config", metavar="FILE", default=None,
                        help="cluster config (YAML or JSON); its `controller` section gives the "
                             "address and the heartbeat timeouts (default: the embedded default "
                             "config)")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: controller.host from the config)")
    parser.add_argument("--port", type=port_number, default=None,
                        help="port to listen on, 0 = any free port (default: controller.port "
                             "from the config)")


def main(args: argparse.Namespace) -> int:
    from motor.config.load import load_config, load_default_config
    from motor.controller.server import ListenError, run_controller
    from motor.errors import ConfigError

    try:
        cfg = load_config(args.config) if args.config else load_default_config()
    except ConfigError as e:
        print(f"motor controller: {e}", file=sys.stderr)
        return 2
    try:
        return run_controller(cfg.controller, args.host, args.port)
    except ListenError as e:
        if e.bad_host:
            field = "--host" if args.host is not None else "controller.host"
        else:
            field = "--port" if args.port is not None else "controller.port"
        print(f"motor controller: cannot listen on {e.host}:{e.port} ({field}): {e.reason}",
              file=sys.stderr)
        return 1
    except OSError as e:
        logger.error("cannot start the controller: %s", e)
        return 1

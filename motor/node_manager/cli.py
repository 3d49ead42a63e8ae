"""``motor node-manager``: launch, supervise, health-check and register one node's engines."""
from __future__ import annotations

import argparse
import logging
import sys

from motor.cli import port_number

logger = logging.getLogger("motor.node_manager")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the help texts below say their defaults themselves (they come from the config)
    parser.formatter_class = argparse.HelpFormatter
    parser.description = (
        "Run one node's manager: start every engine instance of the node's config (instance id "
        "<node>/<engine>/<i>, one process per DP rank, each in its own process group, output "
        "in <log_dir>/<node>-<engine>-<i>.log), poll their health endpoint, restart crashed "
        "engines with exponential backoff (restart policy from the config), register them with "
        "the controller and heartbeat their health. SIGTERM or SIGINT stops the engines "
        "(SIGTERM, then SIGKILL of the group after stop_timeout_s), deregisters the node and "
        "exits with status 0.")
    parser.add_argument("-c", "--config", metavar="FILE", default=None,
                        help="cluster config (YAML or JSON) (default: the embedded default config)")
    parser.add_argument("--node", metavar="NAME", default=None,
                        help="which node of the config this is (`nodes[].name`); may be left "
                             "out when the config has exactly one node")
    parser.add_argument("--controller", metavar="URL", default=None,
                        help="controller to register with, http://HOST:PORT (default: "
                             "controller.host/port from the config)")
    parser.add_argument("--host", default=None,
                        help="address of the management API (default: the node's host)")
    parser.add_argument("--port", type=port_number, default=None,
                        help="port of the management API (GET /health, /metrics, /v1/instances); "
                             "0 = any free port (default: the node's mgmt_port; none there: no "
                             "management API)")
    parser.add_argument("--log-dir", metavar="DIR", default=None,
                        help="directory of the engine log files (default: the node's log_dir, "
                             "else $MOTOR_ENGINE_LOG_DIR, else a new temporary directory, removed "
                             "on a clean stop unless an engine failed)")


def main(args: argparse.Namespace) -> int:
    from motor.config.load import load_config, load_default_config
    from motor.errors import ConfigError
    from motor.node_manager.agent import ListenError, parse_url, run_node_manager

    try:
        cfg = load_config(args.config) if args.config else load_default_config()
        names = [n.name for n in cfg.nodes]
        if args.node is None:
            if len(names) != 1:
                raise ConfigError(f"--node is required: the config has {len(names)} nodes "
                                  f"({', '.join(names) or 'none'})")
            node = cfg.nodes[0]
        else:
            matches = [n for n in cfg.nodes if n.name == args.node]
            if not matches:
                raise ConfigError(f"--node {args.node!r} is not in the config (nodes: "
                                  f"{', '.join(names) or 'none'})")
            node = matches[0]
        url = args.controller or cfg.controller.url
        parse_url(url)
        from motor.node_manager.engines import plan_node
        plan_node(node)  # bad engine_config -> error before anything starts
    except ConfigError as e:
        print(f"motor node-manager: {e}", file=sys.stderr)
        return 2
    try:
        return run_node_manager(node, url, cfg.controller.heartbeat_interval_s, args.log_dir,
                                args.host, args.port)
    except ListenError as e:
        at = f"nodes[{cfg.nodes.index(node)}]"
        if e.bad_host:
            field = "--host" if args.host is not None else f"{at}.host"
        else:
            field = "--port" if args.port is not None else f"{at}.mgmt_port"
        print(f"motor node-manager: cannot listen on {e.host}:{e.port} ({field}): {e.reason}",
              file=sys.stderr)
        return 1
    except OSError as e:
        logger.error("cannot start the node manager: %s", e)
        return 1

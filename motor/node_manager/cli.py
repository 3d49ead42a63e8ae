"""``motor node-manager``: launch, supervise, health-check and register one node's engines."""
from __future__ import annotations

import argparse
import logging

from motor.cli import (OptionError, add_config_option, add_controller_option, add_host_option,
                       add_log_dir_option, add_port_option, fail)

logger = logging.getLogger("motor.node_manager")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run one node's manager: start every engine instance of the node's config (instance id "
        "<node>/<engine>/<i>, one process per DP rank, each in its own process group, output "
        "in <log_dir>/<node>-<engine>-<i>.log), poll their health endpoint, restart crashed "
        "engines with exponential backoff (restart policy from the config), register them with "
        "the controller and heartbeat their health. SIGTERM or SIGINT stops the engines "
        "(SIGTERM, then SIGKILL of the group after stop_timeout_s), deregisters the node and "
        "exits with status 0.")
    add_config_option(parser, "its controller section and the node's section are used")
    parser.add_argument("--node", metavar="NAME", default=None,
                        help="which node of the config this is (nodes[].name) "
                             "(default: the only node of the config)")
    add_controller_option(parser, "the node registers there")
    add_host_option(parser, "nodes[].host of this node",
                    what="for the management API (GET /health, /metrics, /v1/instances)")
    add_port_option(parser, "nodes[].mgmt_port of this node; none there: no management API",
                    any_free=True, what="for the management API")
    add_log_dir_option(parser, "one <node>-<engine>-<i>.log per engine instance",
                       "nodes[].log_dir of this node, else $MOTOR_ENGINE_LOG_DIR, else a new "
                       "temporary directory, removed on a clean stop unless an engine failed")


def main(args: argparse.Namespace) -> int:
    from motor.config.load import load_config, load_default_config
    from motor.errors import ConfigError
    from motor.node_manager.agent import ListenError, parse_url, run_node_manager

    try:
        cfg = load_config(args.config) if args.config else load_default_config()
        names = [n.name for n in cfg.nodes]
        if not names:
            raise ConfigError("the config has no node (nodes is empty): nothing to manage")
        if args.node is None:
            if len(names) != 1:
                raise OptionError("--node", f"expected one of the config's {len(names)} nodes "
                                            f"({', '.join(names)}), got none")
            node = cfg.nodes[0]
        else:
            matches = [n for n in cfg.nodes if n.name == args.node]
            if not matches:
                raise OptionError("--node", f"expected one of the config's nodes "
                                            f"({', '.join(names)}), got {args.node!r}")
            node = matches[0]
        url = args.controller or ",".join(cfg.controller.urls)
        from motor.control_link import controller_urls
        from motor.control_tls import check, controller_endpoint
        for u in controller_urls(url):
            parse_url(u)
            controller_endpoint(u, cfg.controller.tls)   # a scheme that does not fit controller.tls
        check(cfg.controller.tls)   # a bad certificate file: exit 2 before anything starts
        from motor.node_manager.agent import check_start_attempts_env
        from motor.node_manager.engines import plan_node
        plan_node(node, cfg)  # bad engine_config -> error before anything starts
        check_start_attempts_env()
    except ConfigError as e:
        return fail("node-manager", e)
    try:
        return run_node_manager(node, url, cfg.controller.heartbeat_interval_s, args.log_dir,
                                args.host, args.port, cfg.controller.tls, cluster=cfg)
    except ListenError as e:
        at = f"nodes[{cfg.nodes.index(node)}]"
        if e.bad_host:
            field = "--host" if args.host is not None else f"{at}.host"
        else:
            field = "--port" if args.port is not None else f"{at}.mgmt_port"
        return fail("node-manager", f"cannot listen on {e.host}:{e.port} ({field}): {e.reason}",
                    1)
    except OSError as e:
        logger.error("cannot start the node manager: %s", e)
        return 1

"""``motor run``: start one role of a cluster from the environment a container is given.

One image and one config file serve every pod: ``MOTOR_ROLE`` picks the role, the config
(``MOTOR_CONFIG``, a mounted ConfigMap) describes the cluster, and the pod's own identity
(``POD_IP``, ``POD_NAME``, from the Downward API) fills in what differs from pod to pod. The
entrypoint turns that into the options of an existing sub-command and runs it in this process
(the same checks, logs, signals and exit statuses as ``motor controller`` & co.):

==============  ===============================================================================
``MOTOR_ROLE``  what runs
==============  ===============================================================================
controller      ``motor controller``; ``controller.advertise_host`` = ``POD_IP``
coordinator     ``motor coordinator --controller <MOTOR_CONTROLLER>``; with ``pd_decode_first``
                and no ``coordinator.pd.metaserver_url``: ``http://POD_IP:<port>/v1/metaserver``
node-manager    ``motor node-manager --node <MOTOR_NODE>``: a node of the config as it is
engine-pod      ``motor node-manager`` for this pod: the config's node ``MOTOR_NODE_TEMPLATE`` is
                the template, renamed ``POD_NAME``, with ``nodes[].host`` and every engine's
                ``host`` = ``POD_IP`` (its instances are ``<POD_NAME>/<engine>/<i>``)
==============  ===============================================================================

The changed config is written to a temporary JSON file (removed at exit) that the role reads
with ``-c``; the log's first line gives the equivalent command and every changed field with
the variable it came from. ``motor run --dry-run`` prints them and exits.

Every variable is in :data:`ENV` (docs/deployment.md's table is :func:`env_table`); a bad
value is refused before anything starts, exit status 2, with the variable, what was expected
and what was received: ``POD_IP: expected the pod's IP address (an IPv4 or IPv6 address, not
0.0.0.0 / ::), got '10.0.0.300'``.
"""
from __future__ import annotations

import argparse
import copy
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from motor.errors import ConfigError

logger = logging.getLogger(__name__)

#: the roles ``MOTOR_ROLE`` names
ROLES = ("controller", "coordinator", "node-manager", "engine-pod")
#: where the image expects the config when ``MOTOR_CONFIG`` is not set (the ConfigMap mount)
DEFAULT_CONFIG_PATH = "/etc/motor/motor.yaml"
LOG_LEVELS = ("debug", "info", "warning", "error")
_WILDCARDS = ("0.0.0.0", "::", "")
_NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,253}")
_DNS_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
#: a Kubernetes object name (RFC 1123 subdomain): what a pod\'s POD_NAME always is
_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of the image.

    Attributes
    ----------
    name : the variable
    roles : the ``MOTOR_ROLE`` values that read it; empty = every role
    default : what holds when it is not set (text for the docs)
    meaning : what it does, and the config field or option it maps to
    read_by : ``motor run`` (checked by :func:`plan`) or the module that reads it itself
    """
    name: str
    roles: tuple[str, ...]
    default: str
    meaning: str
    read_by: str = "motor run"


#: every variable motor reads in a container (docs/deployment.md, "Environment")
ENV: tuple[EnvVar, ...] = (
    EnvVar("MOTOR_ROLE", (), "**required**",
           "the role of this process: `controller`, `coordinator`, `node-manager` (a node of the "
           "config as it is) or `engine-pod` (a StatefulSet pod that is a node: the node manager "
           "is the pod's main process and launches its engines)"),
    EnvVar("MOTOR_CONFIG", (), f"`{DEFAULT_CONFIG_PATH}`",
           "the cluster config file (YAML or JSON; the ConfigMap's `motor.yaml`)"),
    EnvVar("POD_IP", (), "not set",
           "the pod's IP address (Downward API `status.podIP`): `controller.advertise_host` of a "
           "controller (required with `controller.etcd` when `controller.host` is 0.0.0.0 / ::); "
           "a `pd_decode_first` coordinator's `coordinator.pd.metaserver_url` when the config "
           "has none; `engine-pod`: **required**, the node's `host` and every engine's `host` "
           "(where the engines listen and what the controller publishes)"),
    EnvVar("POD_NAME", ("engine-pod",), "not set",
           "the pod's name (Downward API `metadata.name`), **required** for `engine-pod`: the "
           "node's name, so instance ids are `<POD_NAME>/<engine>/<i>` (a StatefulSet's names "
           "are stable across restarts); other roles only log it"),
    EnvVar("POD_NAMESPACE", (), "not set",
           "the pod's namespace (Downward API `metadata.namespace`), a DNS label; logged with "
           "the pod's identity"),
    EnvVar("MOTOR_CONTROLLER", ("coordinator", "node-manager", "engine-pod"),
           "the config's `controller.peers`, else `controller.host`:`port`",
           "the controller to follow / register with: a Service name (`motor-controller`: "
           "`http://NAME:<controller.port>`, `https://` with `controller.tls`) or a URL "
           "`http(s)://HOST:PORT`; becomes `--controller`. Required when `controller.host` is "
           "0.0.0.0 / :: and `controller.peers` is empty (nobody can reach 0.0.0.0)"),
    EnvVar("MOTOR_NODE", ("node-manager",), "the config's only node",
           "which `nodes[].name` this node manager runs (`--node`)"),
    EnvVar("MOTOR_NODE_TEMPLATE", ("engine-pod",), "the config's only node",
           "which `nodes[].name` is this pod's template (an engine group: `prefill`, `decode`)"),
    EnvVar("MOTOR_LISTEN_HOST", ("controller", "coordinator"), "the config's `host`",
           "listen address of the controller (`controller.host`) or coordinator "
           "(`coordinator.host`), e.g. `0.0.0.0`"),
    EnvVar("MOTOR_COORDINATOR_WORKERS", ("coordinator",), "`coordinator.workers`",
           "ingress worker processes, 1..64 (`--workers`): size it with the pod's CPU "
           "(docs/deployment.md, \"Sizing\")"),
    EnvVar("MOTOR_LOG_LEVEL", (), "`info`", "`debug`, `info`, `warning` or `error`",
           "motor.logs"),
    EnvVar("MOTOR_LOG_FORMAT", (), "`text`", "`text` or `json` (one JSON object a line)",
           "motor.logs"),
    EnvVar("MOTOR_API_KEYS", ("coordinator",), "not set",
           "comma-separated client API keys, added to `coordinator.api_keys` (docs/security.md); "
           "a mounted Secret directory in `coordinator.api_keys_file` is the other way",
           "motor.coordinator"),
    EnvVar("MOTOR_WORKER_API_KEY", ("coordinator",), "not set",
           "the key sent to the engines when `coordinator.worker_api_key` is null",
           "motor.coordinator"),
    EnvVar("MOTOR_ENGINE_LOG_DIR", ("node-manager", "engine-pod"), "a new temporary directory",
           "engine log directory when the node has no `log_dir`", "motor.node_manager"),
    EnvVar("MOTOR_ENGINE_START_ATTEMPTS", ("node-manager", "engine-pod"), "not set",
           "give up on an engine that was never healthy after this many failed starts in a row",
           "motor.node_manager"),
)

#: variables that motor does not read but hands on to the engines it launches (their names'
#: beginnings): vLLM / vLLM-Ascend / SGLang settings, the Ascend and CUDA runtimes, Hugging
#: Face, PyTorch, Gloo and OpenMP
ENGINE_ENV_PREFIXES: tuple[str, ...] = (
    "ASCEND_", "HCCL_", "HCCN_", "LCCL_", "ATB_", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
    "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MOONCAKE_",
    "VLLM_", "SGLANG_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH",
    "PYTORCH_", "OMP_", "MKL_", "NCCL_", "CUDA_", "NVIDIA_", "LD_LIBRARY_PATH", "LD_PRELOAD",
    "PYTHON")

_BY_NAME = {v.name: v for v in ENV}


def known_env(name: str) -> bool:
    """Whether ``name`` is a variable motor reads (:data:`ENV`) or hands on to its engines
    (:data:`ENGINE_ENV_PREFIXES`)."""
    return name in _BY_NAME or name.startswith(ENGINE_ENV_PREFIXES)


class EnvError(ConfigError):
    """An environment variable refused by :func:`plan`; ``str()`` is ``NAME: expected ...,
    got ...``."""

    def __init__(self, name: str, expected: str, got: str | None, why: str = "") -> None:
        shown = "nothing (not set)" if got is None else repr(got)
        super().__init__(f"{name}: expected {expected}, got {shown}" + (f" ({why})" if why else ""))
        self.variable = name


@dataclass
class RunPlan:
    """What :func:`plan` chose for an environment.

    Attributes
    ----------
    role : ``MOTOR_ROLE``
    command : the motor sub-command that runs (``controller``, ``coordinator``,
        ``node-manager``)
    options : its options after ``-c FILE`` (``["--node", "motor-prefill-0"]``)
    config : the config with the environment's changes, as JSON-ready data (valid: it went
        through the schema)
    changes : ``(field, value, variable)`` for every changed config field
    source : the config file the changes apply to
    """
    role: str
    command: str
    options: list[str]
    config: dict[str, Any]
    changes: list[tuple[str, object, str]] = field(default_factory=list)
    source: str = ""

    def argv(self, config_path: str) -> list[str]:
        """The sub-command's argv with the changed config at ``config_path``."""
        return [self.command, "-c", config_path, *self.options]


def _get(env: Mapping[str, str], name: str) -> str | None:
    v = env.get(name)
    if v is None:
        return None
    v = v.strip()
    return v if v else None


def _pod_ip(env: Mapping[str, str], required_for: str = "") -> str | None:
    raw = _get(env, "POD_IP")
    if raw is None:
        if required_for:
            raise EnvError("POD_IP", f"the pod's IP address ({required_for})", None)
        return None
    try:
        ip = ipaddress.ip_address(raw)
    except ValueError:
        ip = None
    if ip is None or ip.is_unspecified:
        raise EnvError("POD_IP", "the pod's IP address (an IPv4 or IPv6 address, not "
                                 "0.0.0.0 / ::)", raw)
    return str(ip)


def _controller_url(env: Mapping[str, str], cfg: Any) -> str | None:
    """``--controller`` from ``MOTOR_CONTROLLER`` (None = the config decides)."""
    from motor.cli import http_url
    from motor.hosts import is_host
    raw = _get(env, "MOTOR_CONTROLLER")
    ctl = cfg.controller
    if raw is None:
        if ctl.host in _WILDCARDS and not ctl.peers:
            raise EnvError("MOTOR_CONTROLLER", f"the controller's Service name or URL "
                                               f"(controller.host of the config is {ctl.host} "
                                               f"and controller.peers is empty)", None)
        return None
    expected = "the controller's Service name (a host name) or a URL http://HOST:PORT"
    if "://" in raw:
        try:
            return http_url(raw).rstrip("/")
        except argparse.ArgumentTypeError:
            raise EnvError("MOTOR_CONTROLLER", expected, raw) from None
    if not is_host(raw):
        raise EnvError("MOTOR_CONTROLLER", expected, raw)
    scheme = "https" if ctl.tls is not None else "http"
    host = f"[{raw}]" if ":" in raw else raw
    return f"{scheme}://{host}:{ctl.port}"


def _node_index(cfg: Any, variable: str, name: str | None) -> int:
    names = [n.name for n in cfg.nodes]
    if not names:
        raise EnvError(variable, "a config with nodes (nodes is empty)", name)
    if name is None:
        if len(names) != 1:
            raise EnvError(variable, f"one of the config's {len(names)} nodes "
                                     f"({', '.join(names)})", None)
        return 0
    if name not in names:
        raise EnvError(variable, f"one of the config's nodes ({', '.join(names)})", name)
    return names.index(name)


def plan(env: Mapping[str, str]) -> RunPlan:
    """Choose the sub-command, its options and the config changes for an environment.

    Parameters
    ----------
    env : the environment (``os.environ``); only the variables of :data:`ENV` are read

    Returns
    -------
    RunPlan
        with the changed config validated by the schema.

    Raises
    ------
    EnvError
        a variable is missing or malformed (``NAME: expected ..., got ...``).
    ConfigError
        the config file is invalid, or invalid once changed (the message names the fields and
        the variables that set them).
    """
    from motor.cli import config_file
    from motor.config.load import load_config, parse_config
    from motor.config.schema import DeploymentMode

    role = _get(env, "MOTOR_ROLE")
    if role not in ROLES:
        raise EnvError("MOTOR_ROLE", f"one of {', '.join(ROLES)}", role)
    level = _get(env, "MOTOR_LOG_LEVEL")
    if level is not None and level.lower() not in LOG_LEVELS:
        raise EnvError("MOTOR_LOG_LEVEL", f"one of {', '.join(LOG_LEVELS)}", level)
    fmt = _get(env, "MOTOR_LOG_FORMAT")
    if fmt is not None and fmt.lower() not in ("text", "json"):
        raise EnvError("MOTOR_LOG_FORMAT", "one of text, json", fmt)
    ns = _get(env, "POD_NAMESPACE")
    if ns is not None and not _DNS_LABEL.fullmatch(ns):
        raise EnvError("POD_NAMESPACE", "a namespace (a DNS label: lower-case letters, digits, "
                                        "inner hyphens)", ns)
    pod_name = _get(env, "POD_NAME")
    if pod_name is not None and not (_POD_NAME.fullmatch(pod_name) and len(pod_name) <= 253):
        raise EnvError("POD_NAME", "a pod name (a DNS subdomain: lower-case letters, digits, "
                                   "inner hyphens, dots; at most 253 characters)", pod_name)
    attempts = _get(env, "MOTOR_ENGINE_START_ATTEMPTS")
    if attempts is not None and not (attempts.isdigit() and int(attempts) >= 1):
        raise EnvError("MOTOR_ENGINE_START_ATTEMPTS", "an integer >= 1", attempts)

    path = _get(env, "MOTOR_CONFIG") or DEFAULT_CONFIG_PATH
    try:
        config_file(path)
    except argparse.ArgumentTypeError as e:
        why = re.search(r" \(([^()]*)\)$", str(e))
        raise EnvError("MOTOR_CONFIG", "a config file (YAML or JSON)", path,
                       why.group(1) if why else "") from None
    cfg = load_config(path)
    data = cfg.model_dump(mode="json")
    changes: list[tuple[str, object, str]] = []
    options: list[str] = []

    def change(at: list[Any], key: str, value: object, where: str, variable: str) -> None:
        node: Any = data
        for part in at:
            node = node[part]
        node[key] = value
        changes.append((where, value, variable))

    listen = _get(env, "MOTOR_LISTEN_HOST")
    if listen is not None and role in ("controller", "coordinator"):
        from motor.hosts import is_host
        if not is_host(listen):
            raise EnvError("MOTOR_LISTEN_HOST", "an IP address or host name", listen)
        change([role], "host", listen, f"{role}.host", "MOTOR_LISTEN_HOST")

    if role == "controller":
        command = "controller"
        ip = _pod_ip(env)
        host = listen or cfg.controller.host
        if ip is not None:
            change(["controller"], "advertise_host", ip, "controller.advertise_host", "POD_IP")
        elif cfg.controller.etcd is not None and host in _WILDCARDS and \
                cfg.controller.advertise_host is None:
            raise EnvError("POD_IP", f"the pod's IP address (controller.host is {host} and "
                                     f"controller.advertise_host is not set: the other "
                                     f"controllers could not reach this one)", None)
    elif role == "coordinator":
        command = "coordinator"
        url = _controller_url(env, cfg)
        if url is not None:
            options += ["--controller", url]
        workers = _get(env, "MOTOR_COORDINATOR_WORKERS")
        if workers is not None:
            if not (workers.isdigit() and 1 <= int(workers) <= 64):
                raise EnvError("MOTOR_COORDINATOR_WORKERS", "an integer 1..64", workers)
            options += ["--workers", str(int(workers))]
        ip = _pod_ip(env)
        c = cfg.coordinator
        if ip is not None and c.mode is DeploymentMode.PD_DECODE_FIRST and \
                not c.pd.metaserver_url:
            scheme = "https" if c.tls is not None else "http"
            host = f"[{ip}]" if ":" in ip else ip
            change(["coordinator", "pd"], "metaserver_url",
                   f"{scheme}://{host}:{c.port}/v1/metaserver",
                   "coordinator.pd.metaserver_url", "POD_IP")
    elif role == "node-manager":
        command = "node-manager"
        i = _node_index(cfg, "MOTOR_NODE", _get(env, "MOTOR_NODE"))
        options += ["--node", cfg.nodes[i].name]
        url = _controller_url(env, cfg)
        if url is not None:
            options += ["--controller", url]
    else:   # engine-pod
        command = "node-manager"
        i = _node_index(cfg, "MOTOR_NODE_TEMPLATE", _get(env, "MOTOR_NODE_TEMPLATE"))
        if pod_name is None:
            raise EnvError("POD_NAME", "the pod's name (the node's name for MOTOR_ROLE "
                                       "engine-pod)", None)
        others = [n.name for j, n in enumerate(cfg.nodes) if j != i]
        if pod_name in others:
            raise EnvError("POD_NAME", f"a name that is not another node of the config "
                                       f"({', '.join(others)})", pod_name)
        ip = _pod_ip(env, "where the engines of MOTOR_ROLE engine-pod listen")
        assert ip is not None
        at = f"nodes[{i}]"
        change(["nodes", i], "name", pod_name, f"{at}.name", "POD_NAME")
        change(["nodes", i], "host", ip, f"{at}.host", "POD_IP")
        for j in range(len(cfg.nodes[i].engines)):
            change(["nodes", i, "engines", j], "host", ip, f"{at}.engines[{j}].host", "POD_IP")
        options += ["--node", pod_name]
        url = _controller_url(env, cfg)
        if url is not None:
            options += ["--controller", url]

    if changes:
        by = ", ".join(f"{w} from {v}" for w, _x, v in changes)
        parse_config(copy.deepcopy(data), f"{path} as changed by the environment ({by})")
    return RunPlan(role, command, options, data, changes, path)


# ---------------------------------------------------------------- docs


def env_table() -> str:
    """The Markdown table of :data:`ENV` that docs/deployment.md carries (checked by
    tests/deploy/test_run.py; ``python -m motor.run`` prints it)."""
    rows = ["| variable | roles | default | meaning | read by |", "|---|---|---|---|---|"]
    for v in ENV:
        roles = ", ".join(f"`{r}`" for r in v.roles) or "all"
        rows.append(f"| `{v.name}` | {roles} | {v.default} | {v.meaning} | {v.read_by} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------- the sub-command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start the role named by MOTOR_ROLE (controller, coordinator, node-manager, engine-pod) "
        "from the environment alone: the config file MOTOR_CONFIG, the pod's POD_IP / "
        "POD_NAME / POD_NAMESPACE, the controller MOTOR_CONTROLLER. The container image's "
        "entrypoint; every variable is listed in docs/deployment.md. A bad variable exits "
        "with status 2 before anything starts.")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and the config changes the environment "
                             "selects, then exit")


def main(args: argparse.Namespace) -> int:
    import importlib
    import tempfile

    import orjson

    from motor.cli import build_parser, fail
    try:
        p = plan(os.environ)
    except ConfigError as e:
        return fail("run", e)
    level = _get(os.environ, "MOTOR_LOG_LEVEL")
    if level is not None:
        logging.getLogger().setLevel(level.upper())
    pod = ", ".join(f"{k}={os.environ[k]}" for k in ("POD_NAME", "POD_NAMESPACE", "POD_IP")
                    if _get(os.environ, k))
    if args.dry_run:
        print("motor " + " ".join(p.argv("<changed config>")))
        print(f"config: {p.source}")
        for where, value, variable in p.changes:
            print(f"  {where} = {value!r} ({variable})")
        return 0
    fd, path = tempfile.mkstemp(prefix=f"motor-run-{p.role}-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(p.config, option=orjson.OPT_INDENT_2))
        argv = p.argv(path)
        logger.info("role %s%s: motor %s (config %s%s)", p.role, f" ({pod})" if pod else "",
                    " ".join(argv), p.source,
                    "".join(f"; {w} = {v} from {e}" for w, v, e in p.changes))
        sub = build_parser(p.command).parse_args(argv)
        return int(importlib.import_module(sub._module).main(sub) or 0)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    print(env_table(), end="")

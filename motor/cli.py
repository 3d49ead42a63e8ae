"""`motor` command line: one sub-command per process or tool.

Each sub-command lives in its component package as ``<package>/cli.py`` (``motor.up``,
``motor.demo``) with two functions, ``add_arguments(parser)`` and ``main(args) -> int``
(exit status). Components are imported lazily so ``motor --help`` stays fast: this module
imports nothing of motor but :mod:`motor.errors` and :mod:`motor.hosts` at module level.

Conventions every sub-command follows (``tests/unit/test_cli_conventions.py`` checks them):

* **Option values are checked by argparse, before anything starts**, with the types of this
  module (:data:`port_number`, :data:`positive_int`, :func:`host_name`, :func:`output_file`,
  ...): a bad value exits with status 2 and two lines on stderr, a one-line usage and
  ``motor <command>: error: argument --opt: expected <what>, got <value>``. A value the
  config schema refuses only with the rest of the config (a cross-field check) goes through
  :func:`apply_overrides`, which words it the same way (:class:`OptionError`).
* **Errors of** ``main()``: a message on stderr prefixed ``motor <command>: `` (:func:`fail`);
  exit status 2 when nothing was started (a bad config file, a bad option), 1 for a failure at
  run time (a busy port, a component that died), 130 on Ctrl-C. Never a traceback.
* **Help**: the same option has the same metavar and the same wording in every command
  (:func:`add_config_option`, :func:`add_host_option`, :func:`add_port_option`,
  :func:`add_controller_option`, :func:`add_log_dir_option`): ``-c FILE``, ``--host HOST``,
  ``--port PORT``, ``--controller URL``, ``--log-dir DIR``; numbers have a short metavar
  (``N``, ``S`` for seconds). A default is shown as a trailing ``(default: X)``:
  :class:`HelpFormatter` adds it for every option whose argparse default is a value; an
  option whose default is not a value (taken from the config, computed) writes it by hand in
  the same form, ``(default: coordinator.port of the config)``. No help text says ``None``.
* ``--log-level`` and ``--log-format`` are global: ``motor --log-level debug --log-format
  json <command> ...``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from motor.errors import ConfigError
from motor.hosts import is_host

if TYPE_CHECKING:
    from pydantic import BaseModel

T = TypeVar("T")
M = TypeVar("M", bound="BaseModel")

# sub-command -> (module with add_arguments/main, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("motor.up", "start a whole cluster (controller, node manager(s), coordinator) from one config"),
    "demo": ("motor.demo", "start the embedded default cluster of simulated engines, run a short bench, print the table"),
    "coordinator": ("motor.coordinator.cli", "run the OpenAI-compatible gateway (with a controller or standalone with --backend)"),
    "controller": ("motor.controller.cli", "run the controller: node/instance registry, instance states, live instance table"),
    "node-manager": ("motor.node_manager.cli", "run one node's manager: launch, supervise, health-check and register engines"),
    "ctl": ("motor.ctl", "operate a running cluster through the controller: instances, nodes, drain, stop, start, (rolling) restart"),
    "sim": ("motor.sim.cli", "run a simulated engine speaking vLLM's OpenAI-compatible HTTP API"),
    "bench": ("motor.bench.cli", "load generator for OpenAI-compatible endpoints (TTFT/TPOT/ITL/E2EL table)"),
    "bench-plot": ("motor.bench.plot_cli", "PNG plots of 'motor bench --json' result files: one run's, or a comparison of several"),
    "run": ("motor.run", "start the role MOTOR_ROLE names from the environment alone (the container entrypoint; docs/deployment.md)"),
}


# ---------------------------------------------------------------- argparse types

def bounded(cast: Callable[[str], T], ok: Callable[[T], bool], expected: str,
            ) -> Callable[[str], T]:
    """An argparse type: ``cast`` the text, then require ``ok``; the error says ``expected``."""
    def parse(v: str) -> T:
        try:
            x = cast(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {v!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {v.strip()}")
        return x
    return parse


_bounded = bounded  # the former name

#: argparse type: an integer
integer = bounded(int, lambda i: True, "an integer")
#: argparse type: a number
number = bounded(float, lambda f: f == f, "a number")  # not NaN
#: argparse type: a port 0..65535 (0 = any free port)
port_number = bounded(int, lambda i: 0 <= i <= 65535, "a port number 0..65535")
#: argparse type: a port 1..65535 (where the port must be known in advance: the API's)
nonzero_port = bounded(int, lambda i: 1 <= i <= 65535, "a port number 1..65535")
#: argparse type: an integer >= 1
positive_int = bounded(int, lambda i: i >= 1, "an integer >= 1")
#: argparse type: an integer >= 0
non_negative_int = bounded(int, lambda i: i >= 0, "an integer >= 0")
#: argparse type: a number > 0
positive_float = bounded(float, lambda f: f > 0, "a number > 0")
#: argparse type: a number >= 0
non_negative_float = bounded(float, lambda f: f >= 0, "a number >= 0")
#: argparse type: a probability 0..1
probability = bounded(float, lambda f: 0 <= f <= 1, "a number in [0, 1]")



def host_name(text: str) -> str:
    """argparse type: an IP address or a host name (``0.0.0.0`` / ``::`` = every interface)."""
    if not is_host(text):
        raise argparse.ArgumentTypeError(f"expected an IP address or host name, got {text!r}")
    return text


def _url_parts(text: str, schemes: tuple[str, ...]) -> tuple[bool, str]:
    from urllib.parse import urlsplit
    try:
        u = urlsplit(text)
        port = u.port
    except ValueError:
        return False, ""
    ok = u.scheme in schemes and bool(u.hostname) and is_host(u.hostname or "") \
        and port != 0 and not u.query and not u.fragment
    return ok, u.path


def http_url(text: str) -> str:
    """argparse type: ``http://HOST:PORT`` or ``https://HOST:PORT`` (a motor component: the
    controller; https with ``controller.tls``)."""
    ok, path = _url_parts(text, ("http", "https"))
    if not ok or path not in ("", "/"):
        raise argparse.ArgumentTypeError(
            f"expected a URL http://HOST:PORT or https://HOST:PORT, got {text!r}")
    return text


def http_urls(text: str) -> str:
    """argparse type: one or several (comma-separated) ``http(s)://HOST:PORT`` URLs: every
    controller of an HA set (clients follow the leader)."""
    if "," not in text:
        return http_url(text)
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected a URL http://HOST:PORT (or several, "
                                         f"comma-separated), got {text!r}")
    for p in parts:
        if not p:
            continue
        try:
            http_url(p)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected URLs http://HOST:PORT or https://HOST:PORT, comma-separated, got "
                f"{p!r} in {text!r}") from None
    return ",".join(p for p in parts if p)


def base_url(text: str) -> str:
    """argparse type: ``http[s]://HOST[:PORT][/PATH]`` (a server's base URL)."""
    ok, _path = _url_parts(text, ("http", "https"))
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected a URL http://HOST:PORT or https://HOST:PORT, got {text!r}")
    return text


def config_file(text: str) -> str:
    """argparse type: a config file that exists and can be read (not a directory)."""
    if os.path.isdir(text):
        why = "a directory"
    elif not os.path.exists(text):
        why = "no such file"
    elif not os.access(text, os.R_OK):
        why = "not readable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"expected a config file (YAML or JSON), got {text!r} ({why})")


def output_file(text: str) -> str:
    """argparse type: a file to write at the end of a run, checked before it starts:
    ``-`` (standard output), or a path that is not a directory, in a writable directory."""
    if text == "-":
        return text
    parent = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text):
        why = "a directory"
    elif not os.path.isdir(parent):
        why = f"no directory {parent}"
    elif not os.access(parent, os.W_OK | os.X_OK) or \
            (os.path.exists(text) and not os.access(text, os.W_OK)):
        why = "not writable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"expected a file to write, got {text!r} ({why})")


def _directory_problem(text: str) -> str | None:
    """Why ``text`` cannot be (or become) a writable directory, None when it can: it is one,
    or its nearest existing ancestor is a writable directory."""
    path = os.path.abspath(text)
    at = path
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at):
        return "a file" if at == path else f"{at} is a file"
    if not os.access(at, os.W_OK | os.X_OK):
        return "not writable" if at == path else f"cannot create it in {at}: not writable"
    return None


def log_directory(text: str) -> str:
    """argparse type: a writable directory, or one that can be created (its nearest existing
    ancestor is a writable directory)."""
    why = _directory_problem(text)
    if why is None:
        return text
    raise argparse.ArgumentTypeError(f"expected a directory, got {text!r} ({why})")


def output_directory(text: str) -> str:
    """argparse type: a directory to write files into at the end of a run, checked before it
    starts (not created): a writable directory, or one that can be created."""
    why = "empty" if not text else _directory_problem(text)
    if why is None:
        return text
    raise argparse.ArgumentTypeError(f"expected a directory to write, got {text!r} ({why})")


# ---------------------------------------------------------------- shared options

#: how every command words its shared options (help texts start with these)
HELP_CONFIG = "cluster config file, YAML or JSON"
HELP_HOST = "address to listen on"
HELP_PORT = "port to listen on"
HELP_CONTROLLER = ("the controller's URL, http://HOST:PORT (https://HOST:PORT with controller.tls); "
                   "several controllers (HA) comma-separated: the leader is followed")
HELP_LOG_DIR = "directory of the log files"
CONFIG_DEFAULT = "the embedded default config"
CONTROLLER_DEFAULT = "controller.peers of the config, else controller.host and controller.port"


def _help(head: str, what: str, default: str | None, sep: str = "; ") -> str:
    return head + (f"{sep}{what}" if what else "") + (f" (default: {default})" if default else "")


def add_config_option(p: argparse._ActionsContainer, what: str = "",
                      default: str = CONFIG_DEFAULT) -> argparse.Action:
    """``-c FILE, --config FILE``; ``what``: which part of the config the command uses."""
    return p.add_argument("-c", "--config", metavar="FILE", type=config_file, default=None,
                          help=_help(HELP_CONFIG, what, default))


def add_host_option(p: argparse._ActionsContainer, default: str, what: str = "",
                    ) -> argparse.Action:
    """``--host HOST``; ``default``: an address (shown by the formatter) or the config field
    it comes from (written as ``(default: ...)``); ``what``: ``for ...`` (which API)."""
    if is_host(default):
        return p.add_argument("--host", metavar="HOST", type=host_name, default=default,
                              help=_help(HELP_HOST, what, None, " "))
    return p.add_argument("--host", metavar="HOST", type=host_name, default=None,
                          help=_help(HELP_HOST, what, default, " "))


def add_port_option(p: argparse._ActionsContainer, default: int | str, *, any_free: bool,
                    what: str = "", note: str = "") -> argparse.Action:
    """``--port PORT``; ``any_free``: 0 means any free port (else 1..65535); ``default``: the
    port, or the config field it comes from (a string); ``what``: ``for ...`` (which API);
    ``note``: a last remark."""
    head = HELP_PORT + (f" {what}" if what else "")
    tail = "; ".join(x for x in ("0 = any free port" if any_free else "", note) if x)
    kind = port_number if any_free else nonzero_port
    if isinstance(default, int):
        return p.add_argument("--port", metavar="PORT", type=kind, default=default,
                              help=_help(head, tail, None))
    return p.add_argument("--port", metavar="PORT", type=kind, default=None,
                          help=_help(head, tail, default))


def add_controller_option(p: argparse._ActionsContainer, what: str) -> argparse.Action:
    """``--controller URL``; ``what``: what the command does with it."""
    return p.add_argument("--controller", metavar="URL[,URL...]", type=http_urls, default=None,
                          help=_help(HELP_CONTROLLER, what, CONTROLLER_DEFAULT))


def add_log_dir_option(p: argparse._ActionsContainer, what: str, default: str,
                       ) -> argparse.Action:
    """``--log-dir DIR`` (created when missing); ``what``: which files go there."""
    return p.add_argument("--log-dir", metavar="DIR", type=log_directory, default=None,
                          help=_help(HELP_LOG_DIR, what, default))


# ---------------------------------------------------------------- errors after parsing

class OptionError(ConfigError):
    """A command-line option refused after parsing; ``str()`` reads like argparse's message,
    ``argument --port: expected ..., got ...`` (:func:`fail` prints it with ``error:``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")
        self.option = option


def fail(command: str, error: BaseException | str, status: int = 2) -> int:
    """Print ``motor <command>: <error>`` on stderr (``motor <command>: error: argument ...``
    for an :class:`OptionError`, as argparse words it); returns ``status``."""
    text = str(error)
    if isinstance(error, OptionError):
        text = f"error: {text}"
        print(_usage(f"motor {command}"), file=sys.stderr)
    print(f"motor {command}: {text}", file=sys.stderr, flush=True)
    return status


def _shown(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


_EXPECTED = re.compile(r"(?::| is expected to be| is expected| must be| should be) (.*)", re.S)
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def _expected(err: Mapping[str, Any], path: str, value: object) -> str:
    """``expected ..., got ...`` for one pydantic error about the field ``path``."""
    ctx = err.get("ctx") or {}
    kind = str(err.get("type", ""))
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        noun = "an integer" if isinstance(value, int) else "a number"
        return f"expected {noun} {op} {ctx.get(key)}, got {_shown(value)}"
    msg = str(err.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if msg.startswith(path):  # "<path>: ..." / "<path> is expected to be ..."
        m = _EXPECTED.match(msg, len(path))
        if m:
            rest = m.group(1)
            msg = rest if m.group(0).startswith(":") or rest.startswith("expected ") \
                else "expected " + rest
    elif msg.startswith("Input should be "):
        msg = "expected " + msg.removeprefix("Input should be ")
    if msg.startswith("expected ") and ", got " not in msg:
        msg += f", got {_shown(value)}"
    return msg


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def apply_overrides(cfg: M, overrides: Mapping[str, tuple[str, object]]) -> M:
    """``cfg`` with command-line values set, re-validated by its schema (cross-field checks
    included).

    Parameters
    ----------
    cfg : a pydantic model (a ``ClusterConfig``)
    overrides : dotted field path -> (option, value), e.g.
        ``{"coordinator.port": ("--port", args.port)}``; a ``None`` value is left out.

    Raises
    ------
    OptionError
        ``argument --port: expected ..., got ...`` naming the option of the refused field
        (or, for a cross-field check that names no overridden field, the options given).
    """
    given = {path: (opt, v) for path, (opt, v) in overrides.items() if v is not None}
    if not given:
        return cfg
    from pydantic import ValidationError
    data = cfg.model_dump(mode="json")
    for path, (_opt, value) in given.items():
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = getattr(value, "value", value)  # an Enum member -> its value
    try:
        return type(cfg).model_validate(data)
    except ValidationError as e:
        errors = e.errors()
    longest_first = sorted(given, key=len, reverse=True)
    for err in errors:  # an error located at an overridden field
        at = _dotted(tuple(err["loc"]))
        for path in longest_first:
            if at == path or at.startswith(path + ".") or at.startswith(path + "["):
                opt, value = given[path]
                raise OptionError(opt, _expected(err, path, value))
    for err in errors:  # a cross-field check whose message names an overridden field
        msg = str(err.get("msg", ""))
        for path in longest_first:
            if path in msg.removeprefix("Value error, "):
                opt, value = given[path]
                raise OptionError(opt, _expected(err, path, value))
    first = errors[0]
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    where = _dotted(tuple(first["loc"]))
    raise OptionError(", ".join(opt for opt, _v in given.values()),
                      f"{where}: {msg}" if where else msg)


# ---------------------------------------------------------------- the parser

def _is_trivial(default: object) -> bool:
    return default is None or default is False or default == [] or default == "" or \
        default is argparse.SUPPRESS


class HelpFormatter(argparse.HelpFormatter):
    """Ends each help with ``(default: X)`` where argparse has a default worth showing
    (not ``None`` / ``False`` / empty) and the help does not say it already; a boolean
    ``--x / --no-x`` pair shows the option that is the default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text is argparse.SUPPRESS:
            return text
        # BooleanOptionalAction appends its own " (default: %(default)s)" (Python < 3.14)
        text = text.replace(" (default: %(default)s)", "")
        d = action.default
        if isinstance(action, argparse.BooleanOptionalAction):
            if "(default: " in text or d is None or d is argparse.SUPPRESS:
                return text
            shown = action.option_strings[0 if d else 1]
            return text + " (default: " + shown + ")"
        if "(default: " in text or _is_trivial(d) or \
                any(o.startswith("--no-") for o in action.option_strings):
            return text
        if isinstance(d, bool):
            shown = "true" if d else "false"
        elif isinstance(d, (list, tuple)):
            shown = " ".join(map(str, d))
        elif isinstance(d, float) and d.is_integer():
            shown = f"{d:g}"
        else:
            shown = str(d)
        return text + " (default: " + shown.replace("%", "%%") + ")"


class Parser(argparse.ArgumentParser):
    """argparse with motor's wording: choices as ``expected one of ..., got ...``, and on an
    error a one-line usage plus ``<prog>: error: <message>`` (exit status 2)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(
                action, f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        # a bare type=int / type=float words its error like the types of this module
        plain = {int: integer, float: number}.get(action.type)  # type: ignore[call-overload]
        if plain is None:
            return super()._get_value(action, arg_string)
        try:
            return plain(arg_string)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(action, str(e)) from None

    #: sub-command -> its parser (set by :func:`build_parser` on the top-level one)
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{_usage(self.prog)}\n{self.prog}: error: {message}\n")


_HelpFormatter = HelpFormatter  # the former name


def _usage(prog: str) -> str:
    """The one usage line printed before an option error (``--help`` has the long one)."""
    return f"usage: {prog} [OPTIONS] ('{prog} --help' lists them)"


def build_parser(command: str | None = None) -> Parser:
    """The argument parser; only ``command``'s module is imported (all when ``None``)."""
    parser = Parser(
        prog="motor",
        description="motor: a performance-first manager for LLM inference clusters.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--log-level", default="info", metavar="LEVEL",
                        choices=["debug", "info", "warning", "error"],
                        help="log level of this process: debug, info, warning or error")
    parser.add_argument("--log-format", default=None, metavar="FORMAT", choices=["text", "json"],
                        help="log line format of this process and the ones it starts: text "
                             "or json, one JSON object a line (default: MOTOR_LOG_FORMAT, "
                             "else text)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        if command is None or command == name:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), "")
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # worded by the sub-command's parser: "motor sim: error: unrecognized ..."
        hint = next((f" ({o} is global: motor {o} {o[6:].upper()} {args.command} ...)"
                     for o in ("--log-level", "--log-format") if o in extra), "")
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    from motor.logs import FORMATS, setup_logging
    try:
        setup_logging(args.log_level, args.log_format)
    except ValueError:   # only $MOTOR_LOG_FORMAT can be wrong here (--log-format is a choice)
        got = os.environ.get("MOTOR_LOG_FORMAT", "")
        print(f"motor: MOTOR_LOG_FORMAT: expected one of {', '.join(FORMATS)}, got {got!r}",
              file=sys.stderr)
        return 2
    mod = importlib.import_module(args._module)
    try:
        return int(mod.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`motor` command line: one sub-command per process or tool.

Each sub-command lives in its component package as ``<package>/cli.py`` with two
functions, ``add_arguments(parser)`` and ``main(args) -> int`` (exit status).
Components are imported lazily so ``motor --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# sub-command -> (module with add_arguments/main, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("motor.up", "start a whole cluster (controller, node manager(s), coordinator) from one config"),
    "demo": ("motor.demo", "start the embedded default cluster of simulated engines, run a short bench, print the table"),
    "coordinator": ("motor.coordinator.cli", "run the OpenAI-compatible gateway (with a controller or standalone with --backend)"),
    "controller": ("motor.controller.cli", "run the controller: node/instance registry, instance states, live instance table"),
    "node-manager": ("motor.node_manager.cli", "run one node's manager: launch, supervise, health-check and register engines"),
    "sim": ("motor.sim.cli", "run a simulated engine speaking vLLM's OpenAI-compatible HTTP API"),
    "bench": ("motor.bench.cli", "load generator for OpenAI-compatible endpoints (TTFT/TPOT/ITL/E2EL table)"),
}


def _bounded(cast: Callable[[str], T], ok: Callable[[T], bool], expected: str,
             ) -> Callable[[str], T]:
    """An argparse type: ``cast`` the text, then require ``ok``; the error says ``expected``."""
    def parse(v: str) -> T:
        try:
            x = cast(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {v!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {x}")
        return x
    return parse


#: argparse type: a port 0..65535 (0 = any free port)
port_number = _bounded(int, lambda i: 0 <= i <= 65535, "a port number 0..65535")
#: argparse type: an integer >= 1
positive_int = _bounded(int, lambda i: i >= 1, "an integer >= 1")
#: argparse type: a number > 0
positive_float = _bounded(float, lambda f: f > 0, "a number > 0")
#: argparse type: a number >= 0
non_negative_float = _bounded(float, lambda f: f >= 0, "a number >= 0")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], argparse.SUPPRESS) or \
                (action.help and "default" in action.help) or \
                any(o.startswith("--no-") for o in action.option_strings):
            return action.help
        return super()._get_help_string(action)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported (all when ``None``)."""
    parser = argparse.ArgumentParser(
        prog="motor",
        description="motor: a performance-first manager for LLM inference clusters.",
    )
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="log level of this process (default: info)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=_HelpFormatter)
        if command is None or command == name:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), "")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    from motor.logs import setup_logging
    setup_logging(args.log_level)
    mod = importlib.import_module(args._module)
    try:
        return int(mod.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

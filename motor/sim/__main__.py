"""``python -m motor.sim ...``: the same as ``motor sim ...`` (without the other sub-commands)."""
from __future__ import annotations

import sys


def run(argv: list[str] | None = None) -> int:
    from motor.cli import HelpFormatter, Parser
    from motor.logs import setup_logging
    from motor.sim import cli

    parser = Parser(prog="motor sim", description=cli.__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="info", metavar="LEVEL",
                        choices=["debug", "info", "warning", "error"],
                        help="log level of this process: debug, info, warning or error")
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return int(cli.main(args) or 0)


if __name__ == "__main__":
    sys.exit(run())

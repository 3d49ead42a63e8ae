"""``motor bench-plot``: PNG plots of ``motor bench --json`` result files.

One file: the plots ``motor bench --plot`` writes (TTFT / ITL / E2EL histogram + CDF,
throughput over time). Several: a comparison (overlaid TTFT and ITL CDFs, bars of the mean and
P99 of TTFT, TPOT, ITL and E2EL), labelled with the file names. Exit status 0, or 2 when a file
is not a result, the output directory is not writable or matplotlib is missing
(nothing written), 1 when the PNGs cannot be written.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from motor.cli import fail, output_directory, positive_int

#: resolution of the PNGs (:data:`motor.bench.plots.DEFAULT_DPI`, not imported here: the
#: parser of every command is built for ``motor --help``, and that imports no numpy)
DEFAULT_DPI = 100


def _result_file(text: str) -> tuple[str, dict[str, Any]]:
    """argparse type of FILE: a ``motor bench --json`` document, read and checked."""
    import orjson

    from motor.bench.plots import problem
    why: str | None
    data: Any = None
    if os.path.isdir(text):
        why = "a directory"
    elif not os.path.exists(text):
        why = "no such file"
    else:
        try:
            with open(text, "rb") as f:
                data = orjson.loads(f.read())
        except OSError as e:
            why = str(e.strerror or e)
        except orjson.JSONDecodeError:
            why = "not JSON"
        else:
            why = problem(data)
    if why is None:
        return text, data
    raise argparse.ArgumentTypeError(
        f"expected a 'motor bench --json' result file, got {text!r} ({why})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("One file: ttft.png, itl.png, e2el.png, throughput.png (what 'motor bench "
                "--plot' writes). Several: compare_cdf.png (overlaid TTFT and ITL CDFs) and "
                "compare_stats.png (mean and P99 bars), labelled with the file names. Needs "
                "matplotlib (pip install 'motor[plot]').")
    p.add_argument("files", nargs="+", type=_result_file, metavar="FILE",
                   help="result files written by 'motor bench --json' (or 'motor demo --json')")
    p.add_argument("--out", type=output_directory, default=".", metavar="DIR",
                   help="directory of the PNGs (created if needed)")
    p.add_argument("--dpi", type=positive_int, default=DEFAULT_DPI, metavar="N",
                   help="resolution of the PNGs in dots per inch")


def main(args: argparse.Namespace) -> int:
    from motor.bench.plots import (MISSING, have_matplotlib, labels_for, write_compare_plots,
                                   write_run_plots)
    if not have_matplotlib():
        return fail("bench-plot", "error: " + MISSING)
    files: list[tuple[str, dict[str, Any]]] = args.files
    try:
        if len(files) == 1:
            paths = write_run_plots(files[0][1], args.out, args.dpi)
        else:
            labels = labels_for([path for path, _d in files])
            paths = write_compare_plots([(label, d) for label, (_p, d) in zip(labels, files)],
                                        args.out, args.dpi)
    except OSError as e:
        return fail("bench-plot", f"cannot write the plots to {args.out}: {e.strerror or e}", 1)
    for path in paths:
        print(path)
    return 0

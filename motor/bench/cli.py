"""``motor bench``: load generator for any OpenAI-compatible endpoint.

Prints the table (E2EL, TTFT, TPOT, ITL, input/output tokens, output token
throughput: average, min, max, median, P75, P90, P99, N) and a summary.
Exit status: 0 when every request succeeded (and at least one completed),
1 when any request failed, 2 when the run could not start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from motor.bench.config import (CONVERSATION_SAMPLING, DATASETS, DEFAULT_CONCURRENCY,
                                DEFAULT_NUM_REQUESTS, BenchConfig, BenchError)
from motor.cli import (HelpFormatter, Parser, base_url, bounded, fail, non_negative_int,
                       output_directory, output_file, positive_float, positive_int)


def _json_object(text: str) -> dict:
    """argparse type of ``--extra-body``: a JSON object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object, e.g. '{{\"temperature\": 0}}', got {text!r}")
    return obj


def _api_path(text: str) -> str:
    """argparse type of ``--endpoint``: a path starting with ``/``."""
    if not text.startswith("/") or any(c in text for c in "?# "):
        raise argparse.ArgumentTypeError(
            f"expected an API path starting with / (e.g. /v1/chat/completions), got {text!r}")
    return text


_ratio = bounded(float, lambda f: 0 <= f < 1, "a number in [0, 1)")


def _plot_directory(text: str) -> str:
    """argparse type of ``--plot``: a directory to write (:func:`motor.cli.output_directory`),
    and matplotlib installed (looked up, not imported)."""
    path = output_directory(text)
    from motor.bench.plots import MISSING, have_matplotlib
    if not have_matplotlib():
        raise argparse.ArgumentTypeError(MISSING)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Lengths are in tokens; with motor's simulated engine one token is one byte "
                     "and the generated prompts are ASCII, so N characters = N tokens. "
                     "Exit status: 0 if every request succeeded, 1 if any failed "
                     "(or none completed), 2 if the run could not start.")
    t = parser.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", metavar="URL", type=base_url,
                   help="base URL of the OpenAI-compatible server; a trailing /v1 (the OpenAI "
                        "SDK's base_url form) is dropped, --endpoint carries it")
    t.add_argument("--endpoint", default="/v1/chat/completions", metavar="PATH", type=_api_path,
                   help="API path: /v1/chat/completions (messages) or /v1/completions "
                        "(text prompt); any path ending in chat/completions is sent messages")
    t.add_argument("--model", default=None, metavar="NAME",
                   help="model name sent in each request (default: the first model of "
                        "GET <url>/v1/models)")
    t.add_argument("--api-key", default=None, metavar="KEY",
                   help="API key, sent as 'Authorization: Bearer <key>' (default: no header)")

    d = parser.add_argument_group("workload")
    d.add_argument("--dataset", choices=DATASETS, default="random", metavar="NAME",
                   help="random: unique random prompts of --input-len; shared-prefix: "
                        "--num-groups groups, each request = its group's system prompt of "
                        "--prefix-len + a unique question of --input-len; multi-turn: "
                        "--num-conversations conversations of --turns turns (each turn adds "
                        "--input-len of user text to the history and carries the previous "
                        "answers; turns of one conversation are sent one after the other), "
                        "conversations of one group share a --prefix-len system prompt")
    d.add_argument("--num-requests", type=positive_int, default=None, metavar="N",
                   help=f"requests to send (default: {DEFAULT_NUM_REQUESTS} for random / "
                        "shared-prefix, every turn (--num-conversations x --turns) for "
                        "multi-turn)")
    d.add_argument("--input-len", type=positive_int, default=256, metavar="N",
                   help="prompt (question / user turn) length in tokens")
    d.add_argument("--output-len", "--max-tokens", dest="output_len", type=positive_int,
                   default=128, metavar="N", help="max_tokens asked for each answer")
    d.add_argument("--range-ratio", type=_ratio, default=0.0, metavar="R",
                   help="input and output lengths are drawn uniformly in "
                        "[len*(1-r), len*(1+r)]; 0 = fixed lengths; must be < 1")
    d.add_argument("--prefix-len", type=non_negative_int, default=1024, metavar="N",
                   help="shared system prompt length in tokens (shared-prefix, multi-turn; "
                        "0 = none for multi-turn)")
    d.add_argument("--num-groups", type=positive_int, default=4, metavar="N",
                   help="number of distinct shared system prompts (shared-prefix, multi-turn)")
    d.add_argument("--num-conversations", type=positive_int, default=16, metavar="N",
                   help="conversations of the multi-turn dataset")
    d.add_argument("--turns", type=positive_int, default=4, metavar="N",
                   help="turns per conversation of the multi-turn dataset")
    d.add_argument("--conversation-sampling", choices=CONVERSATION_SAMPLING,
                   default="round_robin", metavar="HOW",
                   help="which ready conversation the next request continues: round_robin = "
                        "the one waiting longest (a fixed cycle while answers come back in "
                        "order), random "
                        "= any ready one, drawn with --seed (independent users; a fixed cycle "
                        "can line conversations up with a round-robin router's rotation)")
    d.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the dataset, of the Poisson arrivals and of the random "
                        "conversation draws (same seed, same prompts)")

    ld = parser.add_argument_group("load")
    ld.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                    help="max requests in flight; without --request-rate it is a closed loop "
                         f"keeping this many busy (default: {DEFAULT_CONCURRENCY} in closed "
                         "loop, no cap with --request-rate)")
    ld.add_argument("--request-rate", type=positive_float, default=None, metavar="RPS",
                    help="open loop: start requests at Poisson arrivals of this rate (req/s), "
                         "still capped by --concurrency if given (default: closed loop)")
    ld.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="stream answers (SSE, with stream_options.include_usage); TTFT, ITL "
                         "and TPOT are only measured when streaming")
    ld.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                    help="send ignore_eos: true (vLLM / SGLang extension) so every answer has "
                         "--output-len tokens")
    ld.add_argument("--duration", type=positive_float, default=None, metavar="S",
                    help="stop starting new requests after this many seconds (requests in "
                         "flight still finish) (default: no limit)")
    ld.add_argument("--timeout", type=positive_float, default=300.0, metavar="S",
                    help="per-request timeout in seconds (whole answer); a request past it fails")
    ld.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                    help="JSON object merged into every request body, e.g. '{\"temperature\": 0}'")

    o = parser.add_argument_group("output")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar on stderr (default: on when stderr is a terminal)")
    o.add_argument("--json", dest="json_path", type=output_file, default=None, metavar="PATH",
                   help="also write the config, summary, per-metric statistics and one "
                        "record per request as JSON to PATH ('-' = stdout; the table then goes "
                        "to stderr); checked before the run")
    o.add_argument("--plot", type=_plot_directory, default=None, metavar="DIR",
                   help="also write PNG plots into DIR (created if needed; checked before the "
                        "run): ttft.png, itl.png, e2el.png (histogram + CDF), throughput.png "
                        "(requests/s and output tokens/s in 1 s bins); drawn from the --json "
                        "document; needs matplotlib (pip install 'motor[plot]')")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    progress = args.progress
    if progress is None:
        progress = sys.stderr.isatty()
    return BenchConfig(
        url=args.url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        dataset=args.dataset, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        num_groups=args.num_groups, num_conversations=args.num_conversations, turns=args.turns,
        seed=args.seed, conversation_sampling=args.conversation_sampling,
        concurrency=args.concurrency, request_rate=args.request_rate,
        stream=args.stream, ignore_eos=args.ignore_eos, duration=args.duration,
        timeout=args.timeout, extra_body=args.extra_body or {}, progress=progress)


_T = TypeVar("_T")


def _run(coro: Coroutine[Any, Any, _T]) -> _T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(args: argparse.Namespace) -> int:
    from motor.bench.report import format_table, write_json
    from motor.bench.runner import run_bench

    try:
        config = config_from_args(args)
        config.validate()
        result = _run(run_bench(config))
    except BenchError as e:
        return fail("bench", e)
    table_out = sys.stderr if args.json_path == "-" else sys.stdout
    print(format_table(result), file=table_out, flush=True)
    if args.json_path:
        try:
            write_json(result, args.json_path)
        except OSError as e:  # checked before the run; still possible (the disk filled up)
            return fail("bench", f"cannot write {args.json_path}: {e.strerror or e}", 1)
    if getattr(args, "plot", None):
        from motor.bench.plots import write_run_plots
        try:
            paths = write_run_plots(result.to_dict(), args.plot)
        except OSError as e:  # checked before the run; still possible
            return fail("bench", f"cannot write the plots to {args.plot}: {e.strerror or e}", 1)
        print(f"Plots written to {args.plot}: "
              + " ".join(os.path.basename(p) for p in paths), file=table_out, flush=True)
    return result.exit_status


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m motor.bench.cli``)."""
    p = Parser(prog="motor bench", description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))

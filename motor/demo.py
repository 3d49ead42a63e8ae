"""``motor demo``: the embedded default cluster, a short benchmark, the table.

Checks the options first (nothing starts on a bad one: exit 2), starts the cluster of
:mod:`motor.cluster` on the embedded default config (simulated engines on loopback), waits
until every engine is routable, runs ``motor bench`` in-process against the coordinator,
prints the table, stops everything, and exits 0 when no request failed (1 otherwise or when
the cluster could not start, 2 for bad options or a bad config).

Logs: ``--log-dir`` keeps them there; without it they go to a temporary directory that is
removed after a clean run and kept (its path printed) when the demo failed.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile

from motor.cli import (add_config_option, add_log_dir_option, add_port_option, fail,
                       output_file, positive_float, positive_int)
from motor.cluster import Cluster, StartError, say
from motor.errors import ConfigError
from motor.up import load_for_cli, make_log_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p)
    p.add_argument("--mode", choices=["union", "pd"], default=None,
                   help="without -c: union engines, or a PD cluster (2 prefill + 2 decode "
                        "engines, vLLM's prefill-first handshake) (default: union)")
    add_port_option(p, "coordinator.port of the config", any_free=False,
                    what="for the OpenAI API")
    p.add_argument("--num-requests", type=positive_int, default=64, metavar="N",
                   help="requests in the benchmark")
    p.add_argument("--concurrency", type=positive_int, default=8, metavar="N",
                   help="requests in flight at once")
    p.add_argument("--dataset", default="shared-prefix",
                   choices=["random", "shared-prefix", "multi-turn"], help="benchmark dataset")
    p.add_argument("--input-len", type=positive_int, default=128, metavar="N",
                   help="prompt tokens (unique part)")
    p.add_argument("--output-len", type=positive_int, default=32, metavar="N",
                   help="max_tokens per request")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--json", metavar="FILE", type=output_file,
                   help="also write the result as JSON to FILE")
    add_log_dir_option(p, "component logs, the engines' in DIR/engines",
                       "a temporary directory, removed after a clean run, kept and printed "
                       "on failure")
    p.add_argument("--ready-timeout", type=positive_float, default=120.0, metavar="S",
                   help="seconds to wait for the cluster to be ready")


def main(args: argparse.Namespace) -> int:
    from motor.bench import BenchConfig, format_table, run_bench, write_json
    from motor.bench.config import BenchError
    try:
        cfg = load_for_cli(args)
        make_log_dir(args.log_dir)
    except ConfigError as e:
        return fail("demo", e)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="motor-demo-")
    cluster = Cluster(cfg, log_dir, source=args.config or "(embedded default)",
                      log_level=getattr(args, "log_level", None))
    n_eps = cluster.endpoints_wanted
    print(f"motor demo: starting controller, {len(cfg.nodes)} node manager(s) with {n_eps} "
          f"simulated engine(s), coordinator ({cfg.coordinator.mode.value}) at {cluster.url}"
          + (f" (logs in {log_dir})" if args.log_dir else ""), flush=True)
    failed = True
    try:
        try:
            cluster.start(args.ready_timeout)
        except ConfigError as e:
            failed = False  # nothing started, no log to keep
            return fail("demo", e)
        except StartError as e:
            say(f"motor demo: the cluster did not start: {e}")
            return 1
        print(f"motor demo: cluster ready; running {args.num_requests} {args.dataset} requests "
              f"at concurrency {args.concurrency}", flush=True)
        bc = BenchConfig(url=cluster.url, dataset=args.dataset, num_requests=args.num_requests,
                         concurrency=args.concurrency, input_len=args.input_len,
                         output_len=args.output_len, stream=not args.no_stream,
                         prefix_len=512, num_groups=4, progress=sys.stderr.isatty())
        try:
            result = asyncio.run(run_bench(bc))
        except BenchError as e:
            say(f"motor demo: the benchmark failed: {e}")
            return 1
        print(format_table(result), flush=True)
        if args.json:
            write_json(result, args.json)
        failed = result.exit_status != 0
        return result.exit_status
    finally:
        cluster.stop()
        if args.log_dir:
            pass
        elif failed:
            say(f"motor demo: logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)

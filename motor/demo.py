"""``motor demo``: the embedded default cluster, a short benchmark, the table.

Starts the cluster of :mod:`motor.up` on the embedded default config (simulated
engines on loopback), waits until every engine is routable, runs ``motor bench``
in-process against the coordinator, prints the table, stops everything, and exits
0 when no request failed (1 otherwise, 2 when the cluster could not start).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

from motor.errors import ConfigError
from motor.up import Cluster, load_for_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="cluster config (default: the embedded default)")
    p.add_argument("--mode", choices=["union", "pd"], default="union",
                   help="without -c: union engines, or a PD cluster (2 prefill + 2 decode "
                        "engines, vLLM's prefill-first handshake)")
    p.add_argument("--port", type=int, help="coordinator port (overrides coordinator.port)")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the benchmark")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--dataset", default="shared-prefix",
                   choices=["random", "shared-prefix", "multi-turn"], help="benchmark dataset")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (unique part)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    p.add_argument("--log-dir", help="component logs, engines' in DIR/engines (default: a "
                                     "temporary directory, removed after a clean run, kept and "
                                     "printed on failure)")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for the cluster to be ready")


def main(args: argparse.Namespace) -> int:
    from motor.bench import BenchConfig, format_table, run_bench, write_json
    try:
        cfg = load_for_cli(args)
    except ConfigError as e:
        print(f"motor demo: {e}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="motor-demo-")
    cluster = Cluster(cfg, log_dir)
    n_eps = sum(e.count * e.dp_size for n in cfg.nodes for e in n.engines)
    print(f"motor demo: starting controller, {len(cfg.nodes)} node manager(s) with {n_eps} "
          f"simulated engine(s), coordinator ({cfg.coordinator.mode.value}) at {cluster.url} "
          f"(logs in {log_dir})", flush=True)
    failed = True
    try:
        try:
            cluster.start()
        except ConfigError as e:
            print(f"motor demo: {e}", file=sys.stderr)
            failed = False  # nothing started, no log to keep
            return 2
        if not cluster.wait_ready(args.ready_timeout):
            print(f"motor demo: the cluster did not become ready; see the logs in {log_dir}",
                  file=sys.stderr)
            return 2
        print(f"motor demo: cluster ready; running {args.num_requests} {args.dataset} requests "
              f"at concurrency {args.concurrency}", flush=True)
        bc = BenchConfig(url=cluster.url, dataset=args.dataset, num_requests=args.num_requests,
                         concurrency=args.concurrency, input_len=args.input_len,
                         output_len=args.output_len, stream=not args.no_stream,
                         prefix_len=512, num_groups=4, progress=sys.stderr.isatty())
        result = asyncio.run(run_bench(bc))
        print(format_table(result), flush=True)
        if args.json:
            write_json(result, args.json)
        failed = result.exit_status != 0
        return result.exit_status
    finally:
        cluster.stop()
        if failed and not args.log_dir:
            print(f"motor demo: logs kept in {log_dir}", file=sys.stderr)
        elif not args.log_dir and os.path.isdir(log_dir):
            import shutil
            shutil.rmtree(log_dir, ignore_errors=True)

"""The issue-19 acceptance sweep of ``kv_affinity`` against ``round_robin`` on the simulator.

Runs ``bench/bench_kv_routing.py`` (realistic timing model, KV events, no oracle) for

* multi-turn: 32 conversations x 8 turns, a 2048-token system prompt each, at concurrency
  4, 8 and 16;
* shared prompts: 8 system prompts, each shared by 4 conversations (``--groups 8``), at
  concurrency 8;

over seeds 1, 2, 3, and prints one markdown table: per run the mean and p99 TTFT of both
policies, their ratios (round robin / kv_affinity: > 1 = kv_affinity faster), the mean
ratio of the engine-side TTFT (the sims' own histograms: without the coordinator, HTTP and
client time, which CPU contention on a shared machine inflates for every policy alike),
the requests per instance (max / fair share = 256 / 4), and the best ratios any router
could reach on that run (``bench_kv_routing.router_bound``: the first wave at its best
split, every other request at one engine step of its uncached tokens, round robin's
coordinator + HTTP time) with that time. ``kv_affinity`` runs with
``coordinator.kv.cost: time`` (a config file written next to the JSON, or
``--coordinator-config``); ``--tokens-cost`` adds the default prompt-token cost
(``cost: tokens``) as a third policy.

Run::

    .venv/bin/python bench/bench_kv_sweep.py [--seeds 1,2,3] [--tokens-cost]

Each run takes 1-2 minutes (two or three policies of 256 requests); the whole sweep about
15-25 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = (("multi-turn, c=4", ["--concurrency", "4"]),
             ("multi-turn, c=8", ["--concurrency", "8"]),
             ("multi-turn, c=16", ["--concurrency", "16"]),
             ("8 prompts x 4 conversations, c=8", ["--groups", "8", "--concurrency", "8"]))
KV = "kv_affinity (KV events)"
TOK = "kv_affinity (KV events, tokens cost)"
SECOND = "kv_affinity (KV events, second config)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--workloads", default="", help="comma list of indexes into the four "
                   "workloads (0: c=4, 1: c=8, 2: c=16, 3: shared prompts); default all")
    p.add_argument("--tokens-cost", action="store_true")
    p.add_argument("--second-config", default="",
                   help="a cluster config for a second kv_affinity run per workload (e.g. the "
                        "time cost with other ttft settings), shown as `second config`")
    p.add_argument("--coordinator-config", default="",
                   help="cluster config for kv_affinity (default: one with kv.cost: time)")
    p.add_argument("--out", default="", help="directory for the per-run JSON (default: a "
                   "temporary one)")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="motor-kvsweep-")
    os.makedirs(out, exist_ok=True)
    if not a.coordinator_config:     # the policy under test: kv_affinity with the time cost
        a.coordinator_config = os.path.join(out, "time-cost.yaml")
        with open(a.coordinator_config, "w") as f:
            f.write("coordinator:\n  kv:\n    cost: time\n")
    seeds = [int(s) for s in a.seeds.split(",")]
    picked = [int(i) for i in a.workloads.split(",")] if a.workloads else range(len(WORKLOADS))
    rows = []
    for wi in picked:
        name, args = WORKLOADS[wi]
        for seed in seeds:
            js = os.path.join(out, f"w{wi}-s{seed}.json")
            if not os.path.exists(js):
                cmd = [sys.executable, os.path.join(HERE, "bench_kv_routing.py"), "--no-oracle",
                       "--only", "kv_affinity-ev", "--seed", str(seed), "--json-out", js, *args]
                if a.tokens_cost:
                    cmd.append("--tokens-cost")
                if a.second_config:
                    cmd += ["--second-config", a.second_config]
                if a.coordinator_config:
                    cmd += ["--coordinator-config", a.coordinator_config]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(js) as f:
                rows.append((name, seed, json.load(f)))
            print(f"done: {name}, seed {seed}", file=sys.stderr)
    pols = [KV] + ([TOK] if a.tokens_cost else []) + ([SECOND] if a.second_config else [])
    names = {KV: "kv_affinity", TOK: "tokens cost", SECOND: "second config"}
    head = ("| workload | seed | round_robin mean / p99 TTFT (ms) | " + " | ".join(
        f"{names[q]} mean / p99 (ms) | mean ratio | "
        f"p99 ratio | engine-side mean ratio | requests per instance (max / fair)"
        for q in pols) + " | best any router: mean / p99 ratio | coordinator + HTTP (ms) |")
    print(head)
    print("|" + "---|" * (5 + 5 * len(pols)))
    for name, seed, r in rows:
        rr = r["round_robin"]
        cells = [name, str(seed), f"{rr['mean_ttft_ms']:.1f} / {rr['p99_ttft_ms']:.1f}"]
        for q in pols:
            k = r[q]
            per = k["requests_per_sim"]
            fair = sum(per) / len(per)
            eng = (f"{rr['engine_mean_ttft_ms'] / k['engine_mean_ttft_ms']:.2f}x"
                   if k.get("engine_mean_ttft_ms") else "-")
            cells += [f"{k['mean_ttft_ms']:.1f} / {k['p99_ttft_ms']:.1f}",
                      f"{rr['mean_ttft_ms'] / k['mean_ttft_ms']:.2f}x",
                      f"{rr['p99_ttft_ms'] / k['p99_ttft_ms']:.2f}x", eng,
                      f"{'/'.join(map(str, per))} ({max(per) / fair:.2f}x)"]
        b = r.get("bound")
        cells += [f"{rr['mean_ttft_ms'] / b['mean_ttft_ms']:.2f}x / "
                  f"{rr['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}x" if b else "-",
                  f"{b['overhead_ms']:.1f}" if b else "-"]
        print("| " + " | ".join(cells) + " |")
    print(f"\nper-run JSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PD routing on simulated engines: today's sequential (prefill, decode) choice vs the joint
choice with conditional disaggregation (``coordinator.pd.joint``), mean TTFT and TPOT.

Not a pytest-benchmark suite (`pytest bench/` does not collect it): an end-to-end run with
real processes on 127.0.0.1. 2 ``motor sim --role prefill`` + 2 ``--role decode``
instances (KV events, prefix caching) behind one ``motor coordinator --mode
pd_prefill_first --policy kv_affinity`` (standalone ``--backend``), driven by two
``motor bench`` clients at once, a mixed workload:

* long prompts with shared prefixes: ``--dataset multi-turn`` (conversations of a
  ``--prefix-len`` system prompt shared by ``--groups`` groups, turns that grow);
* short prompts: ``--dataset random`` of ``--short-len`` tokens.

Compared, with the same sims, seeds and load:

* ``sequential``: ``kv_affinity`` picks P, then ``least_load`` picks D (today's default);
* ``joint``: ``pd.joint.enabled`` (one cost over the pairs, local prefill on D allowed).

Run::

    .venv/bin/python bench/bench_pd_routing.py [--seeds 1,2,3]

Prints a markdown table (docs/benchmarks.md, "PD routing: joint choice and conditional
disaggregation"), with the requests each instance finished. ``motor sim``'s decode role
pulls only the blocks past its own prefix hit, as vLLM's NIXL connector does (what the joint
cost's transfer term prices). ``--coordinator-log-level debug`` logs every joint decision
with its terms (the coordinator's log is in the directory printed at the end); it costs
the coordinator time, more for the pairs (two decisions each) than for local legs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from bench_kv_routing import PY, free_port, spawn, stop_all, wait_http

#: the sims all listen on 127.0.0.1 (one node to pd.joint): their transfer time is the
#: sim's --kv-transfer-ms-per-block, given as same_node
CONFIGS = {
    "sequential": "coordinator:\n  pd:\n    decode_policy: least_load\n",
    "joint": "coordinator:\n  pd:\n    decode_policy: least_load\n    joint:\n"
             "      enabled: true\n      stall_weight: {stall}\n"
             "      transfer_us_per_token: {{same_node: {xfer}}}\n",
    "joint, no local prefill": "coordinator:\n  pd:\n    decode_policy: least_load\n"
             "    joint:\n      enabled: true\n      local_prefill: false\n"
             "      transfer_us_per_token: {{same_node: {xfer}}}\n",
}


def _bench(target: str, extra: list[str], out: str) -> None:
    subprocess.run([PY, "-m", "motor", "bench", "--url", target, "--endpoint",
                    "/v1/chat/completions", "--json", out, "--no-progress"] + extra,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(label: str, seed: int, a: argparse.Namespace, tmp: str) -> dict:
    tag = label.replace(",", "").replace(" ", "-")
    procs = []
    try:
        backends, kv = [], []
        for i, role in enumerate(("prefill", "prefill", "decode", "decode")):
            port, kport = free_port(), free_port()
            procs.append(spawn(["sim", "--port", str(port), "--role", role,
                                "--enable-prompt-tokens-details",
                                "--kv-events-endpoint", f"tcp://127.0.0.1:{kport}",
                                "--seed", str(i), "--time-scale", str(a.time_scale),
                                "--step-fixed-ms", str(a.step_fixed_ms),
                                "--prefill-token-us", str(a.prefill_token_us),
                                "--decode-token-us", str(a.decode_token_us),
                                "--kv-transfer-ms-per-block", str(a.kv_transfer_ms_per_block),
                                "--num-gpu-blocks", str(a.num_gpu_blocks),
                                "--max-model-len", "8192"],
                               f"{tmp}/{tag}-{seed}-sim{i}.log"))
            backends.append(f"{role}=http://127.0.0.1:{port}")
            kv.append(f"http://127.0.0.1:{port}=tcp://127.0.0.1:{kport}")
        for b in backends:
            wait_http(b.split("=", 1)[1] + "/health")
        cfg = f"{tmp}/{tag}.yaml"
        with open(cfg, "w") as f:
            f.write(CONFIGS[label].format(stall=a.stall_weight,
                                          xfer=1e3 * a.kv_transfer_ms_per_block / 16))
        cport = free_port()
        args = ["coordinator", "-c", cfg, "--port", str(cport), "--mode", "pd_prefill_first",
                "--policy", "kv_affinity", "--backend", *backends]
        for k in kv:
            args += ["--kv-events", k]
        procs.append(spawn(args, f"{tmp}/{tag}-{seed}-coord.log", a.coordinator_log_level))
        target = f"http://127.0.0.1:{cport}"
        wait_http(target + "/readiness")
        time.sleep(1.0)  # ZMQ slow joiner
        long_out, short_out = f"{tmp}/{tag}-{seed}-long.json", f"{tmp}/{tag}-{seed}-short.json"
        jobs = [
            threading.Thread(target=_bench, args=(target, [
                "--dataset", "multi-turn", "--num-conversations", str(a.conversations),
                "--turns", str(a.turns), "--prefix-len", str(a.prefix_len),
                "--num-groups", str(a.groups), "--input-len", str(a.input_len),
                "--output-len", str(a.output_len), "--range-ratio", "0.5",
                "--conversation-sampling", "random", "--concurrency", str(a.concurrency),
                "--seed", str(seed)], long_out)),
            threading.Thread(target=_bench, args=(target, [
                "--dataset", "random", "--num-requests", str(a.short_requests),
                "--input-len", str(a.short_len), "--output-len", str(a.output_len),
                "--range-ratio", "0.5", "--concurrency", str(a.concurrency),
                "--seed", str(seed + 1000)], short_out))]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join()
        res = {}
        for name, path in (("long", long_out), ("short", short_out)):
            with open(path) as f:
                res[name] = json.load(f)
        with open(f"{tmp}/{tag}-{seed}-metrics.txt", "w") as f:
            with urllib.request.urlopen(target + "/metrics", timeout=5) as r:
                f.write(r.read().decode())
        res["split"] = "/".join(str(served(b.split("=", 1)[1])) for b in backends)
        return res
    finally:
        stop_all(procs)


def served(url: str) -> int:
    """Requests an instance finished (its ``vllm:request_success_total``, all reasons)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))


def decisions(path: str) -> str:
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("motor_coordinator_pd_route_decisions_total{"):
                name, _, v = line.rpartition(" ")
                lab = dict(kv.split("=") for kv in name[name.index("{") + 1:-1].split(","))
                out.append(f"{lab['decision'].strip(chr(34))}/{lab['reason'].strip(chr(34))} "
                           f"{int(float(v))}")
    return ", ".join(out) or "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--short-requests", type=int, default=64)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4,
                   help="per client (two clients: long and short prompts)")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-gpu-blocks", type=int, default=8192)
    # bench_kv_routing's timing model (an 8B dense model in bf16 on one H100); KV of
    # 128 KiB/token = 2 MiB/block at ~25 GB/s between nodes: 0.08 ms/block (5 us/token,
    # pd.joint.transfer_us_per_token.other)
    p.add_argument("--step-fixed-ms", type=float, default=6.0)
    p.add_argument("--prefill-token-us", type=float, default=37.0)
    p.add_argument("--decode-token-us", type=float, default=100.0)
    p.add_argument("--kv-transfer-ms-per-block", type=float, default=0.08)
    p.add_argument("--stall-weight", type=float, default=1.0,
                   help="pd.joint.stall_weight of the joint run")
    p.add_argument("--only", default="", help="choices to run, separated by ; (default: all)")
    p.add_argument("--coordinator-log-level", default="info")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="motor-pdbench-")
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for seed in seeds:
        for label in CONFIGS:
            if a.only and label not in a.only.split(";"):
                continue
            r = run(label, seed, a, tmp)
            split = r.pop("split")
            n = {k: r[k]["summary"]["requests_completed"] for k in r}
            ttft = {k: r[k]["metrics"]["TTFT"]["average"] for k in r}
            tpot = {k: r[k]["metrics"]["TPOT"]["average"] for k in r}
            failed = sum(r[k]["summary"].get("requests_failed", 0) for k in r)
            tot = sum(n.values()) or 1
            tag = label.replace(",", "").replace(" ", "-")
            rows.append((seed, label, sum(ttft[k] * n[k] for k in r) / tot, ttft["long"],
                         ttft["short"], sum(tpot[k] * n[k] for k in r) / tot, failed,
                         split, decisions(f"{tmp}/{tag}-{seed}-metrics.txt")))
            print(f"done: seed {seed} {label}", file=sys.stderr)
    print(f"\n2 P + 2 D sims, pd_prefill_first, kv_affinity on KV events; long: {a.conversations} "
          f"conversations x {a.turns} turns, {a.groups} system prompts of {a.prefix_len} tokens, "
          f"user turns {a.input_len} +-50 %; short: {a.short_requests} prompts of {a.short_len} "
          f"+-50 % tokens; output {a.output_len} +-50 %; concurrency {a.concurrency} per client; "
          f"step {a.step_fixed_ms} ms + {a.prefill_token_us} us/prefill token + "
          f"{a.decode_token_us} us/decoding sequence, KV transfer {a.kv_transfer_ms_per_block} "
          f"ms/block; joint stall_weight {a.stall_weight}\n")
    print("| seed | choice | mean TTFT (ms) | long TTFT (ms) | short TTFT (ms) | mean TPOT (ms) "
          "| TTFT vs sequential | failed | served by P0/P1/D0/D1 | decisions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {}
    for seed, label, t, tl, ts, tp, failed, split, dec in rows:
        if label == "sequential":
            base[seed] = t
        sp = f"{base[seed] / t:.2f}x" if seed in base and label != "sequential" else "-"
        print(f"| {seed} | {label} | {t:.1f} | {tl:.1f} | {ts:.1f} | {tp:.2f} | {sp} | {failed} "
              f"| {split} | {dec} |")
    for label in CONFIGS:
        rs = [r for r in rows if r[1] == label]
        if not rs:
            continue
        sps = [base[r[0]] / r[2] for r in rs if r[0] in base and label != "sequential"]
        mean_sp = f"{sum(sps) / len(sps):.2f}x" if sps else ""
        print(f"| mean | {label} | {sum(r[2] for r in rs) / len(rs):.1f} | "
              f"{sum(r[3] for r in rs) / len(rs):.1f} | {sum(r[4] for r in rs) / len(rs):.1f} | "
              f"{sum(r[5] for r in rs) / len(rs):.2f} | {mean_sp} | | | |")
    print(f"\nlogs and JSON: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

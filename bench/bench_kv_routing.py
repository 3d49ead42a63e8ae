"""KV-aware routing on simulated engines: cached-token share and TTFT per policy.

Not a pytest-benchmark suite (`pytest bench/` does not collect it): an end-to-end run with
real processes on 127.0.0.1.
4 ``motor sim`` union instances (KV events on ZMQ, prefix caching, cached tokens in
usage) behind one ``motor coordinator`` (standalone ``--backend``), driven by
``motor bench --dataset multi-turn``. Policies compared at the same load:

* ``round_robin``;
* ``kv_affinity`` fed by the sims' KV events (exact);
* ``kv_affinity`` without events (approximate mode: what was routed, with TTL);
* the oracle: one sim with an unbounded cache serving the same request sequence
  (every request finds every prefix any earlier request left), for the cached share.

Run::

    .venv/bin/python bench/bench_kv_routing.py [--conversations 32 --turns 8 --prefix-len 2048]

Prints a markdown table (docs/benchmarks.md, "KV-aware routing").
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

PY = sys.executable


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001
            time.sleep(0.1)
    raise TimeoutError(url)


def spawn(args: list[str], log: str, level: str = "info") -> subprocess.Popen[bytes]:
    f = open(log, "ab")  # noqa: SIM115 (the child keeps it)
    env = dict(os.environ, MOTOR_LOG_LEVEL=level)
    return subprocess.Popen([PY, "-m", "motor"] + args, stdout=f, stderr=f, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


_PROFILE = ("time_to_first_token_seconds", "request_queue_time_seconds",
            "request_prefill_time_seconds", "request_prompt_tokens", "prefix_cache_queries",
            "prefix_cache_hits", "num_preemptions")


def scrape(url: str) -> dict[str, float]:
    """The sim's TTFT / queue / prefill histograms (sum, count) and counters."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("vllm:"):
            continue
        name, _, val = line.rpartition(" ")
        base = name.split("{", 1)[0][5:]
        for m in _PROFILE:
            if base in (m + "_sum", m + "_count", m + "_total"):
                out[base] = out.get(base, 0.0) + float(val)
    with urllib.request.urlopen(url + "/admin/stats", timeout=5) as r:
        st = json.load(r)
    out["steps"] = float(st["steps"])
    out["requests"] = float(st["finished"])
    return out


def run(label: str, policy: str | None, events: bool, n_sims: int, a: argparse.Namespace,
        tmp: str, sim_extra: list[str]) -> dict:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls, kv = [], []
        for i in range(n_sims):
            port, kport = free_port(), free_port()
            procs.append(spawn(["sim", "--port", str(port), "--enable-prompt-tokens-details",
                                "--kv-events-endpoint", f"tcp://127.0.0.1:{kport}",
                                "--time-scale", str(a.time_scale), "--seed", str(i),
                                "--step-fixed-ms", str(a.step_fixed_ms),
                                "--prefill-token-us", str(a.prefill_token_us),
                                "--decode-token-us", str(a.decode_token_us),
                                "--max-model-len", str(a.max_model_len),
                                "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
                               + sim_extra,
                               f"{tmp}/{label}-sim{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
            kv.append(f"http://127.0.0.1:{port}=tcp://127.0.0.1:{kport}")
        for u in urls:
            wait_http(u + "/health")
        target = urls[0]
        if policy is not None:
            cport = free_port()
            args = ["coordinator", "--port", str(cport), "--policy", policy, "--backend", *urls]
            if a.coordinator_config:
                args += ["-c", a.coordinator_config]
            if events:
                for k in kv:
                    args += ["--kv-events", k]
            procs.append(spawn(args, f"{tmp}/{label}-coord.log", a.coordinator_log_level))
            target = f"http://127.0.0.1:{cport}"
            wait_http(target + "/readiness")
            time.sleep(1.0)  # ZMQ slow joiner: subscriptions settle before traffic
        out = f"{tmp}/{label}.json"
        subprocess.run([PY, "-m", "motor", "bench", "--url", target, "--dataset", "multi-turn",
                        "--num-conversations", str(a.conversations), "--turns", str(a.turns),
                        "--prefix-len", str(a.prefix_len), "--num-groups", str(a.groups),
                        "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                        "--range-ratio", str(a.range_ratio),
                        "--num-requests", str(a.conversations * a.turns),
                        "--concurrency", str(a.concurrency), "--seed", str(a.seed),
                        "--conversation-sampling", a.conversation_sampling, "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            res = json.load(f)
        res["engines"] = [scrape(u) for u in urls]
        return res
    finally:
        stop_all(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--groups", type=int, default=32,
                   help="distinct system prompts (conversation c uses prompt c %% groups: "
                        "32 = one per conversation, 8 = one per group of 4 conversations)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1,
                   help="motor bench --seed (the prompts and the conversation draws)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="motor bench --range-ratio (user turn and answer lengths vary by this "
                        "share)")
    p.add_argument("--conversation-sampling", choices=("random", "round_robin"), default="random",
                   help="motor bench --conversation-sampling: random = the next request "
                        "continues any ready conversation (independent users); round_robin = "
                        "conversations in a fixed cycle, which lines them up with a round-robin "
                        "router when their number is a multiple of the instances' "
                        "(docs/benchmarks.md)")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-gpu-blocks", type=int, default=8192)
    p.add_argument("--only", default="", help="comma list of kv_affinity-ev, kv_affinity "
                   "(approximate) to run besides the oracle and round_robin")
    p.add_argument("--coordinator-config", default="",
                   help="cluster config file whose coordinator section (e.g. coordinator.kv "
                        "weights) the coordinator uses")
    p.add_argument("--coordinator-log-level", default="info",
                   help="debug logs every kv_affinity decision with its terms")
    p.add_argument("--no-oracle", action="store_true",
                   help="skip the oracle run (its cached share then shows as 0)")
    p.add_argument("--tokens-cost", action="store_true",
                   help="also run kv_affinity (KV events) with coordinator.kv.cost: tokens (the "
                        "earlier cost in prompt-token equivalents) for comparison")
    p.add_argument("--second-config", default="",
                   help="also run kv_affinity (KV events) with this cluster config file (e.g. "
                        "another coordinator.kv.ttft setting) for comparison")
    p.add_argument("--json-out", default="",
                   help="write each policy's mean / p99 TTFT, cached share and requests per "
                        "sim to this JSON file (bench/bench_kv_sweep.py reads it)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the sims' per-step token budget (vLLM's default on an H100)")
    # timing model of an 8B dense model in bf16 on one H100 (docs/benchmarks.md):
    # decode step ~6 ms (16 GB of weights at ~3 TB/s + overhead), prefill ~27k tokens/s
    # (37 us/token: 16 GFLOP/token at ~45 % of 990 TFLOPS), ~0.1 ms per decoding sequence
    # (its ~3k-token KV, 128 KiB/token)
    p.add_argument("--step-fixed-ms", type=float, default=6.0)
    p.add_argument("--prefill-token-us", type=float, default=37.0)
    p.add_argument("--decode-token-us", type=float, default=100.0)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="motor-kvbench-")
    blocks = ["--num-gpu-blocks", str(a.num_gpu_blocks)]
    rows = []
    only = set(a.only.split(",")) if a.only else None
    plan: list[tuple[str, str | None, bool, int, list[str]]] = [
        ("oracle (1 sim, unbounded cache)", None, False, 1, ["--num-gpu-blocks", "1000000"]),
        ("round_robin", "round_robin", False, 4, blocks),
        ("kv_affinity (KV events)", "kv_affinity", True, 4, blocks),
        ("kv_affinity (approximate)", "kv_affinity", False, 4, blocks)]
    if a.no_oracle:
        plan = plan[1:]
    if a.tokens_cost:
        plan.append(("kv_affinity (KV events, tokens cost)", "kv_affinity", True, 4, blocks))
    if a.second_config:
        plan.append(("kv_affinity (KV events, second config)", "kv_affinity", True, 4, blocks))
    for label, policy, events, n, extra in plan:
        tokens = "tokens cost" in label
        second = "second config" in label
        if only is not None and label.split()[0] + ("-ev" if events else "") not in only \
                and label.split()[0] != "oracle" and label.split()[0] != "round_robin" \
                and not tokens and not second:
            continue
        saved_cfg = a.coordinator_config
        if second:
            a.coordinator_config = a.second_config
        if tokens:
            a.coordinator_config = f"{tmp}/tokens-cost.yaml"
            with open(a.coordinator_config, "w") as f:
                f.write("coordinator:\n  kv:\n    cost: tokens\n")
        try:
            r = run(label.split()[0] + ("-ev" if events else "") + ("-tokens" if tokens else "")
                    + ("-second" if second else ""), policy, events, n, a, tmp, extra)
        finally:
            a.coordinator_config = saved_cfg
        rows.append((label, r))
        print(f"done: {label}", file=sys.stderr)
    if a.no_oracle:
        oracle = 0.0
        rows.insert(0, ("oracle (not run)", {"summary": {"cached_token_share": 0.0},
                                             "metrics": {"TTFT": {"average": 0.0, "p90": 0.0,
                                                                  "p99": 0.0},
                                                         "E2EL": {"average": 0.0}},
                                             "engines": []}))
    oracle = rows[0][1]["summary"]["cached_token_share"] or 0.0
    rr_ttft = rows[1][1]["metrics"]["TTFT"]["average"]
    bound = router_bound(dict(rows), a)
    if a.json_out:
        out = {label: {"mean_ttft_ms": r["metrics"]["TTFT"]["average"],
                       "p99_ttft_ms": r["metrics"]["TTFT"]["p99"],
                       "engine_mean_ttft_ms": engine_mean_ttft_ms(r["engines"]),
                       "cached_share": r["summary"]["cached_token_share"],
                       "failed": r["summary"].get("requests_failed", 0),
                       "requests_per_sim": [int(e.get("requests", 0)) for e in r["engines"]]}
               for label, r in rows if label != "oracle (not run)"}
        if bound is not None:
            out["bound"] = bound
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{a.conversations} conversations x {a.turns} turns, {a.groups} system prompts of "
          f"{a.prefix_len} tokens, input {a.input_len}, output {a.output_len}, concurrency "
          f"{a.concurrency}, seed {a.seed}, range ratio {a.range_ratio}, conversation sampling "
          f"{a.conversation_sampling}, 4 sims x {a.num_gpu_blocks} blocks of 16 tokens, "
          f"max-model-len "
          f"{a.max_model_len}, step {a.step_fixed_ms} ms + {a.prefill_token_us} us/prefill token "
          f"+ {a.decode_token_us} us/decoding sequence\n")
    print("| policy | cached-token share | of oracle | mean TTFT (ms) | P90 TTFT (ms) | "
          "P99 TTFT (ms) | TTFT vs round_robin | mean E2EL (ms) | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    if a.no_oracle:
        rows = rows[1:]
    for label, r in rows:
        s = r["summary"]
        share = s["cached_token_share"] or 0.0
        ttft = r["metrics"]["TTFT"]
        e2e = r["metrics"]["E2EL"]
        speed = f"{rr_ttft / ttft['average']:.2f}x" if rr_ttft and label != rows[0][0] else "-"
        print(f"| {label} | {100 * share:.1f} % | {100 * share / oracle if oracle else 0:.0f} % | "
              f"{ttft['average']:.1f} | {ttft['p90']:.1f} | {ttft['p99']:.1f} | {speed} | "
              f"{e2e['average']:.1f} | "
              f"{s['requests_failed']} |")
    print("\nProfile (engine side, summed over the sims): TTFT at the engine = queue (arrival "
          "-> first scheduled) + prefill (first scheduled -> first token); client TTFT - "
          "engine TTFT = coordinator + HTTP.\n")
    print("| policy | client TTFT (ms) | engine TTFT (ms) | queue (ms) | prefill (ms) | "
          "coordinator + HTTP (ms) | uncached prompt tokens / request | requests per sim | "
          "steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        es = r["engines"]

        def tot(k: str, es: list[dict] = es) -> float:
            return sum(e.get(k, 0.0) for e in es)

        def mean_ms(m: str, es: list[dict] = es) -> float:
            n = tot(m + "_count", es)
            return 1e3 * tot(m + "_sum", es) / n if n else 0.0
        ttft_c = r["metrics"]["TTFT"]["average"]
        ttft_e = mean_ms("time_to_first_token_seconds")
        n = tot("request_prompt_tokens_count") or 1.0
        unc = (tot("prefix_cache_queries_total") - tot("prefix_cache_hits_total")) / n
        per = "/".join(str(int(e.get("requests", 0))) for e in es)
        print(f"| {label} | {ttft_c:.1f} | {ttft_e:.1f} | "
              f"{mean_ms('request_queue_time_seconds'):.1f} | "
              f"{mean_ms('request_prefill_time_seconds'):.1f} | {ttft_c - ttft_e:.1f} | "
              f"{unc:.0f} | {per} | {int(tot('steps'))} |")
    if bound is not None:
        print(f"\nNo router beats (kv_first_wave_bound.run_bound: the first wave at its best "
              f"split, every later request at one step of its uncached tokens, plus round "
              f"robin's coordinator + HTTP time {bound['overhead_ms']:.1f} ms): mean "
              f"{bound['mean_ttft_ms']:.1f} ms ({rr_ttft / bound['mean_ttft_ms']:.2f}x round "
              f"robin), p99 {bound['p99_ttft_ms']:.1f} ms "
              f"({rows[1][1]['metrics']['TTFT']['p99'] / bound['p99_ttft_ms']:.2f}x)")
    print(f"\nlogs and JSON: {tmp}")
    return 0


def engine_mean_ttft_ms(engines: list[dict]) -> float:
    """Mean TTFT (ms) the sims measured (arrival at the engine -> first token), all sims."""
    n = sum(e.get("time_to_first_token_seconds_count", 0.0) for e in engines)
    return 1e3 * sum(e.get("time_to_first_token_seconds_sum", 0.0) for e in engines) / n \
        if n else 0.0


def router_bound(runs: dict[str, dict], a: argparse.Namespace) -> dict[str, float] | None:
    """Least mean and p99 client TTFT (ms) any router could reach on this run's requests:
    the first ``concurrency`` requests (simultaneous first turns, nothing cached) at their
    best split over the 4 instances (:func:`kv_first_wave_bound.run_bound`), every other
    request at one engine step of its uncached tokens (``step_fixed_ms`` +
    ``prefill_token_us`` x tokens, no queueing; cached: the larger of what round robin and
    kv_affinity found, kv_affinity reaching the oracle's share), and each request paying
    round robin's mean coordinator + HTTP time (client TTFT - engine TTFT; the p99 adds
    it too). None without both runs."""
    from kv_first_wave_bound import run_bound
    rr, kv = runs.get("round_robin"), runs.get("kv_affinity (KV events)")
    if rr is None or kv is None:
        return None
    key = ("conversation", "turn")
    cached = {tuple(q[k] for k in key): q["cached_tokens"] or 0 for q in rr["requests"]}
    for q in kv["requests"]:
        k2 = tuple(q[k] for k in key)
        cached[k2] = max(cached.get(k2, 0), q["cached_tokens"] or 0)
    reqs = sorted(kv["requests"], key=lambda q: q["start_s"])
    wave, rest = reqs[:a.concurrency], reqs[a.concurrency:]
    wave_prompt = min(q["input_tokens"] - cached[tuple(q[k] for k in key)] for q in wave)
    floors = [a.step_fixed_ms + 1e-3 * a.prefill_token_us
              * max(0, q["input_tokens"] - cached[tuple(q[k] for k in key)]) for q in rest]
    mean, p99 = run_bound(floors, len(wave), wave_prompt, 4, a.max_num_batched_tokens,
                          a.step_fixed_ms, a.prefill_token_us, a.decode_token_us)
    over = rr["metrics"]["TTFT"]["average"] - engine_mean_ttft_ms(rr["engines"])
    return {"mean_ttft_ms": mean + over, "p99_ttft_ms": p99 + over, "overhead_ms": over}


if __name__ == "__main__":
    sys.exit(main())

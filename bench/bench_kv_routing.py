"""KV-aware routing on simulated engines: cached-token share and TTFT per policy.

Not a pytest-benchmark suite: an end-to-end run with real processes on 127.0.0.1.
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


def spawn(args: list[str], log: str) -> subprocess.Popen[bytes]:
    f = open(log, "ab")
    return subprocess.Popen([PY, "-m", "motor"] + args, stdout=f, stderr=f,
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


def run(label: str, policy: str | None, events: bool, n_sims: int, a: argparse.Namespace,
        tmp: str, sim_extra: list[str]) -> dict:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls, kv = [], []
        for i in range(n_sims):
            port, kport = free_port(), free_port()
            procs.append(spawn(["sim", "--port", str(port), "--enable-prompt-tokens-details",
                                "--kv-events-endpoint", f"tcp://127.0.0.1:{kport}",
                                "--time-scale", str(a.time_scale), "--seed", str(i)] + sim_extra,
                               f"{tmp}/{label}-sim{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
            kv.append(f"http://127.0.0.1:{port}=tcp://127.0.0.1:{kport}")
        for u in urls:
            wait_http(u + "/health")
        target = urls[0]
        if policy is not None:
            cport = free_port()
            args = ["coordinator", "--port", str(cport), "--policy", policy, "--backend", *urls]
            if events:
                for k in kv:
                    args += ["--kv-events", k]
            procs.append(spawn(args, f"{tmp}/{label}-coord.log"))
            target = f"http://127.0.0.1:{cport}"
            wait_http(target + "/readiness")
            time.sleep(1.0)  # ZMQ slow joiner: subscriptions settle before traffic
        out = f"{tmp}/{label}.json"
        subprocess.run([PY, "-m", "motor", "bench", "--url", target, "--dataset", "multi-turn",
                        "--num-conversations", str(a.conversations), "--turns", str(a.turns),
                        "--prefix-len", str(a.prefix_len), "--num-groups", str(a.groups),
                        "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                        "--num-requests", str(a.conversations * a.turns),
                        "--concurrency", str(a.concurrency), "--seed", "1", "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:
        stop_all(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-gpu-blocks", type=int, default=8192)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="motor-kvbench-")
    blocks = ["--num-gpu-blocks", str(a.num_gpu_blocks)]
    rows = []
    for label, policy, events, n, extra in (
            ("oracle (1 sim, unbounded cache)", None, False, 1, ["--num-gpu-blocks", "1000000"]),
            ("round_robin", "round_robin", False, 4, blocks),
            ("kv_affinity (KV events)", "kv_affinity", True, 4, blocks),
            ("kv_affinity (approximate)", "kv_affinity", False, 4, blocks)):
        r = run(label.split()[0] + ("-ev" if events else ""), policy, events, n, a, tmp, extra)
        rows.append((label, r))
        print(f"done: {label}", file=sys.stderr)
    oracle = rows[0][1]["summary"]["cached_token_share"] or 0.0
    rr_ttft = rows[1][1]["metrics"]["TTFT"]["average"]
    print(f"\n{a.conversations} conversations x {a.turns} turns, {a.groups} system prompts of "
          f"{a.prefix_len} tokens, input {a.input_len}, output {a.output_len}, concurrency "
          f"{a.concurrency}, 4 sims x {a.num_gpu_blocks} blocks of 16 tokens\n")
    print("| policy | cached-token share | of oracle | mean TTFT (ms) | P90 TTFT (ms) | "
          "TTFT vs round_robin | mean E2EL (ms) | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        s = r["summary"]
        share = s["cached_token_share"] or 0.0
        ttft = r["metrics"]["TTFT"]
        e2e = r["metrics"]["E2EL"]
        speed = f"{rr_ttft / ttft['average']:.2f}x" if rr_ttft and label != rows[0][0] else "-"
        print(f"| {label} | {100 * share:.1f} % | {100 * share / oracle if oracle else 0:.0f} % | "
              f"{ttft['average']:.1f} | {ttft['p90']:.1f} | {speed} | {e2e['average']:.1f} | "
              f"{s['requests_failed']} |")
    print(f"\nlogs and JSON: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overload run of the coordinator's admission control (issue 17's acceptance).

Not a pytest-benchmark suite (`pytest bench/` does not collect it): real processes on
127.0.0.1, figures printed, no timing assertion.

* two ``motor sim`` engines with a known capacity (``--max-num-seqs`` sequences each, the
  step time stretched by ``--time-scale``), each in its own process group;
* one standalone ``motor coordinator --backend <both> --policy least_load`` with two API keys,
  ``interactive`` (class ``interactive``) and ``batch`` (class ``batch``), equal weights,
  ``admission.max_in_flight`` = what the two engines run at once, a bounded queue and a
  queue timeout;
* phases: unloaded (closed loop, one stream per engine: the reference TTFT), capacity
  (closed loop above the cap: completions per second), then overload: Poisson arrivals at
  ``--load-factor`` x the measured capacity for ``--duration`` seconds, split between the
  two keys by ``--interactive-share``; streaming ``/v1/completions``.

The load generator is an asyncio loop on one aiohttp session written here, not ``motor
bench``: the run needs two keys at once, an open loop that keeps sending while most answers
are refusals, the latency of every refusal, its ``Retry-After``, and a check that every
request got exactly one terminal answer, none of which ``motor bench`` records.

Run::

    .venv/bin/python bench/overload.py                               # ~20 s of overload
    .venv/bin/python bench/overload.py --duration 60 --json out.json  # issue 17's 60 s form

Prints a markdown table (docs/benchmarks.md, "Overload (admission control)") and the
acceptance targets with whether each held; ``--json`` writes every figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PY = sys.executable
KEYS = {"interactive": "sk-overload-interactive", "batch": "sk-overload-batch"}
#: refusal reasons as the coordinator's 503 message words them (motor/coordinator/edge.py)
REASONS = {"queue full": "queue full", "displaced": "displaced",
           "queue timeout": "queue timeout", "predicted not to serve": "predicted wait"}


# -- processes ----------------------------------------------------------------------------
def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return int(p)


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
    f = open(log, "ab")  # noqa: SIM115 (the child keeps it)
    env = dict(os.environ, MOTOR_LOG_LEVEL="warning")
    return subprocess.Popen([PY, "-m", "motor"] + args, stdout=f, stderr=f, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each child's process group, SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def group_rss_kib(pgid: int) -> int:
    """VmRSS summed over the processes of group ``pgid`` (the coordinator and any workers)."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            if int(st.rpartition(")")[2].split()[2]) != pgid:
                continue
            with open(f"/proc/{d}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def coordinator_config(a: argparse.Namespace, max_in_flight: int) -> dict[str, Any]:
    return {"coordinator": {
        "api_keys": [{"name": n, "key": k} for n, k in KEYS.items()],
        "limits": {"keys": {"interactive": {"priority": "interactive", "weight": 1},
                            "batch": {"priority": "batch", "weight": 1}}},
        "admission": {"max_in_flight": max_in_flight, "max_queue": a.max_queue,
                      "queue_timeout_s": a.queue_timeout,
                      "classes": ["interactive", "batch"],
                      "max_wait_s": {c: w for c, w in (("interactive", a.interactive_max_wait),
                                                      ("batch", a.batch_max_wait)) if w},
                      "predict": not a.no_predict},
    }}


# -- requests -----------------------------------------------------------------------------
@dataclass
class Result:
    key: str
    t0: float
    status: int = 0
    ttft_s: float | None = None
    end_s: float = 0.0
    retry_after: str | None = None
    reason: str = ""          # refusals: "queue full" / "queue timeout" / the error message
    terminal: int = 0         # terminal answers seen: [DONE], or one whole error body
    error: str = ""           # client-side failure (no terminal answer)


@dataclass
class Phase:
    results: list[Result] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0


async def one(session: aiohttp.ClientSession, url: str, key: str, body: bytes,
              timeout_s: float, out: list[Result]) -> None:
    r = Result(key, time.perf_counter())
    out.append(r)
    headers = {"Authorization": f"Bearer {KEYS[key]}", "Content-Type": "application/json"}
    try:
        async with session.post(url + "/v1/completions", data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            r.status = resp.status
            r.retry_after = resp.headers.get("Retry-After")
            if resp.status != 200:
                raw = await resp.read()
                r.end_s = time.perf_counter() - r.t0
                try:
                    msg = json.loads(raw)["error"]["message"]
                    r.terminal = 1
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200].decode("latin-1")
                r.reason = next((v for w, v in REASONS.items() if w in msg), msg[:80])
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    r.terminal += 1
                elif r.ttft_s is None and b'"text"' in line:
                    r.ttft_s = time.perf_counter() - r.t0
            r.end_s = time.perf_counter() - r.t0
    except Exception as e:  # noqa: BLE001 (every failure is counted, none is fatal)
        r.error = f"{type(e).__name__}: {e}"[:120]
        r.end_s = time.perf_counter() - r.t0


def request_body(prompt_len: int, output_len: int, rng: random.Random) -> bytes:
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_len))
    return json.dumps({"model": "motor-sim", "prompt": text, "max_tokens": output_len,
                       "stream": True}).encode()


async def closed_loop(session: aiohttp.ClientSession, url: str, key: str, concurrency: int,
                      seconds: float, a: argparse.Namespace, rng: random.Random) -> Phase:
    ph = Phase(start=time.perf_counter())
    stop = ph.start + seconds

    async def worker() -> None:
        while time.perf_counter() < stop:
            await one(session, url, key, request_body(a.prompt_len, a.output_len, rng),
                      a.queue_timeout + 60, ph.results)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    ph.end = time.perf_counter()
    return ph


async def open_loop(session: aiohttp.ClientSession, url: str, rate: float, seconds: float,
                    a: argparse.Namespace, rng: random.Random) -> Phase:
    ph = Phase(start=time.perf_counter())
    tasks: list[asyncio.Task[None]] = []
    t = ph.start
    while True:
        t += rng.expovariate(rate)
        if t - ph.start >= seconds:
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        key = "interactive" if rng.random() < a.interactive_share else "batch"
        tasks.append(asyncio.create_task(one(session, url, key,
                                             request_body(a.prompt_len, a.output_len, rng),
                                             a.queue_timeout + 60, ph.results)))
    ph.end = time.perf_counter()   # arrivals stopped; answers in flight still finish
    await asyncio.gather(*tasks)
    return ph


class EngineWatch:
    """Samples every engine's running and waiting sequences (``/admin/stats``) and the
    client's event-loop lag, every ``period_s``."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str],
                 period_s: float = 0.01) -> None:
        self.session, self.urls, self.period_s = session, urls, period_s
        self.max_running = [0] * len(urls)
        self.max_held = [0] * len(urls)        # running + waiting
        self.samples = 0
        self.lag_s: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lag_s.append(time.perf_counter() - t - self.period_s)
            for i, u in enumerate(self.urls):
                try:
                    async with self.session.get(u + "/admin/stats") as r:
                        st = await r.json()
                except Exception:  # noqa: BLE001
                    continue
                self.max_running[i] = max(self.max_running[i], st["running"])
                self.max_held[i] = max(self.max_held[i], st["running"] + st["waiting"])
            self.samples += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


# -- figures ------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100); None without samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def key_figures(ph: Phase, key: str) -> dict[str, Any]:
    rs = [r for r in ph.results if r.key == key]
    done = [r for r in rs if r.status == 200 and r.terminal == 1 and not r.error]
    refused = [r for r in rs if r.status in (429, 503)]
    by_status: dict[str, int] = {}
    for r in rs:
        if r.status != 200:
            k = str(r.status) if r.status else "no answer"
            if r.status in (429, 503):
                k += f" {r.reason}"
            by_status[k] = by_status.get(k, 0) + 1
    lat = {why: [r.end_s for r in refused if r.reason == why]
           for why in REASONS.values()}
    ttft = [r.ttft_s for r in rs if r.status == 200 and r.ttft_s is not None]
    return {
        "offered": len(rs),
        "admitted": sum(1 for r in rs if r.status == 200),
        "completed": len(done),
        "refused": len(refused),
        "refused_by_status": by_status,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "refusal_p50_s": pct([r.end_s for r in refused], 50),
        "refusal_p99_s": pct([r.end_s for r in refused], 99),
        "refusal_max_s": max((r.end_s for r in refused), default=None),
        "refusal_p99_by_reason_s": {why: pct(xs, 99) for why, xs in lat.items() if xs},
        "refusals_without_retry_after": sum(1 for r in refused if not r.retry_after),
        "retry_after_values": sorted({r.retry_after for r in refused if r.retry_after}),
        "not_one_terminal_answer": sum(1 for r in rs if r.terminal != 1),
        "client_errors": sorted({r.error for r in rs if r.error})[:5],
    }


def fair_shares(capacity: float, offered: dict[str, float]) -> dict[str, float]:
    """Admitted rate each key should get of ``capacity`` (the rate served during the
    overload): classes in strict order (interactive first), each key at most what it
    offers."""
    left = capacity
    out = {}
    for k in ("interactive", "batch"):
        out[k] = min(offered[k], left)
        left -= out[k]
    return out


async def measure(a: argparse.Namespace, coord: str, sims: list[str], coord_pid: int,
                  max_in_flight: int) -> dict[str, Any]:
    rng = random.Random(a.seed)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        rss_boot = group_rss_kib(coord_pid)
        # warm-up: connections, first requests
        await closed_loop(session, coord, "interactive", 2, 1.0, a, rng)
        unloaded = await closed_loop(session, coord, "interactive", 2, a.unloaded_s, a, rng)
        unloaded_b = [r for r in unloaded.results if r.status == 200 and r.ttft_s is not None]
        cap = await closed_loop(session, coord, "interactive", max_in_flight + 2,
                                a.capacity_s, a, rng)
        cap_done = [r for r in cap.results if r.status == 200 and r.terminal == 1]
        capacity = len(cap_done) / (max(r.t0 + r.end_s for r in cap_done) - cap.start)
        rate = a.load_factor * capacity
        print(f"unloaded p99 TTFT {ms(pct([r.ttft_s or 0 for r in unloaded_b], 99))} ms; "
              f"capacity {capacity:.1f} req/s; offering {rate:.0f} req/s for {a.duration:g} s",
              file=sys.stderr)
        await asyncio.sleep(1.0)
        rss_start = group_rss_kib(coord_pid)
        watch = EngineWatch(session, sims)
        watch.start()
        over = await open_loop(session, coord, rate, a.duration, a, rng)
        await watch.stop()
        rss_end = group_rss_kib(coord_pid)
        await asyncio.sleep(2.0)
        rss_settled = group_rss_kib(coord_pid)
        async with session.get(coord + "/metrics") as r:
            metrics_text = await r.text()
    span = over.end - over.start
    keys = {k: key_figures(over, k) for k in ("interactive", "batch")}
    offered_rate = {k: v["offered"] / span for k, v in keys.items()}
    # shares of what was served (the closed-loop capacity above reads a few % low: the
    # client's gap between two requests of a stream)
    served = sum(v["admitted"] for v in keys.values()) / span
    fair = fair_shares(served, offered_rate)
    for k, v in keys.items():
        v["offered_per_s"] = offered_rate[k]
        v["admitted_per_s"] = v["admitted"] / span
        v["fair_share_per_s"] = fair[k]
    lag = watch.lag_s
    return {
        "setup": {k: v for k, v in vars(a).items() if k != "json"},
        "max_in_flight": max_in_flight,
        "unloaded": {"requests": len(unloaded_b),
                     "ttft_p50_s": pct([r.ttft_s or 0 for r in unloaded_b], 50),
                     "ttft_p99_s": pct([r.ttft_s or 0 for r in unloaded_b], 99)},
        "capacity_req_per_s": capacity,
        "served_req_per_s": served,
        "offered_req_per_s": rate,
        "overload_s": span,
        "keys": keys,
        "engines": {"max_num_seqs": a.max_num_seqs, "samples": watch.samples,
                    "max_running": watch.max_running, "max_running_plus_waiting": watch.max_held},
        "coordinator_rss_kib": {"boot": rss_boot, "start": rss_start, "end": rss_end,
                                "end_plus_2s": rss_settled},
        "client_loop_lag_p99_s": pct(lag, 99),
        "coordinator_edge_metrics": [ln for ln in metrics_text.splitlines()
                                     if ln.startswith(("motor_coordinator_key_requests_total",
                                                       "motor_coordinator_admission"))
                                     and "_bucket" not in ln],
    }


def targets(res: dict[str, Any]) -> list[tuple[str, str, bool]]:
    ki, kb = res["keys"]["interactive"], res["keys"]["batch"]
    un = res["unloaded"]["ttft_p99_s"] or 0.0
    cap = res["served_req_per_s"]
    rss = res["coordinator_rss_kib"]
    refused = [k for k in (ki, kb) if k["refused"]]
    p99 = max((k["refusal_p99_s"] or 0.0) for k in (ki, kb))
    why: dict[str, float] = {}
    for k in (ki, kb):
        for w, v in k["refusal_p99_by_reason_s"].items():
            why[w] = max(why.get(w, 0.0), v or 0.0)
    no_ra = sum(k["refusals_without_retry_after"] for k in (ki, kb))
    bad = sum(k["not_one_terminal_answer"] for k in (ki, kb))
    tol = 0.05 * cap
    held = max(res["engines"]["max_running_plus_waiting"])
    out = [
        ("every request ended with exactly one terminal answer", f"{bad} did not", bad == 0),
        ("admitted interactive p99 TTFT <= 2x unloaded p99",
         f"{ms(ki['ttft_p99_s'])} ms vs 2 x {ms(un)} ms",
         ki["ttft_p99_s"] is not None and ki["ttft_p99_s"] <= 2 * un),
        ("refusals < 50 ms (p99 of each key) with Retry-After",
         f"p99 {ms(p99)} ms (" + ", ".join(f"{w} {ms(v)}" for w, v in why.items())
         + f"); {no_ra} without Retry-After",
         bool(refused) and p99 < 0.05 and no_ra == 0),
        ("batch gets its fair share and no more (within 5 % of capacity)",
         f"batch {kb['admitted_per_s']:.2f} req/s vs fair {kb['fair_share_per_s']:.2f}; "
         f"interactive {ki['admitted_per_s']:.2f} vs {ki['fair_share_per_s']:.2f}",
         abs(kb["admitted_per_s"] - kb["fair_share_per_s"]) <= tol
         and ki["admitted_per_s"] >= ki["fair_share_per_s"] - tol),
        ("coordinator RSS within 10 % of its start",
         f"{rss['start'] / 1024:.1f} -> {rss['end'] / 1024:.1f} MiB",
         rss["end"] <= 1.1 * rss["start"]),
        ("engines never above their limit (running + waiting <= max-num-seqs, sampled)",
         f"max {res['engines']['max_running_plus_waiting']} vs {res['engines']['max_num_seqs']}",
         held <= res["engines"]["max_num_seqs"]),
    ]
    return out


def report(res: dict[str, Any]) -> None:
    s = res["setup"]
    print(f"\n2 sims x max-num-seqs {s['max_num_seqs']}, time-scale {s['time_scale']:g}, "
          f"prompt {s['prompt_len']} / output {s['output_len']} tokens; admission "
          f"max_in_flight {res['max_in_flight']}, max_queue {s['max_queue']}, queue_timeout_s "
          f"{s['queue_timeout']:g}, max_wait_s interactive {s['interactive_max_wait']:g} / "
          f"batch {s['batch_max_wait']:g} (0 = queue_timeout_s), predict "
          f"{not s['no_predict']}; capacity {res['capacity_req_per_s']:.1f} req/s measured "
          f"(closed loop), {res['served_req_per_s']:.1f} served under overload; offered "
          f"{res['offered_req_per_s']:.0f} req/s ({s['load_factor']:g}x) for "
          f"{res['overload_s']:.1f} s, interactive share {s['interactive_share']:g}; unloaded "
          f"TTFT p50 {ms(res['unloaded']['ttft_p50_s'])} ms, p99 "
          f"{ms(res['unloaded']['ttft_p99_s'])} ms ({res['unloaded']['requests']} requests)\n")
    print("| key | offered | admitted | completed | refused (by status) | TTFT p50 / p99 (ms) "
          "| refusal p50 / p99 (ms) | admitted req/s (fair) | no terminal answer |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for k, v in res["keys"].items():
        by = ", ".join(f"{n}: {c}" for n, c in sorted(v["refused_by_status"].items())) or "-"
        print(f"| {k} | {v['offered']} | {v['admitted']} | {v['completed']} | {by} | "
              f"{ms(v['ttft_p50_s'])} / {ms(v['ttft_p99_s'])} | {ms(v['refusal_p50_s'])} / "
              f"{ms(v['refusal_p99_s'])} | {v['admitted_per_s']:.2f} "
              f"({v['fair_share_per_s']:.2f}) | {v['not_one_terminal_answer']} |")
    e, rss = res["engines"], res["coordinator_rss_kib"]
    print(f"\nengines: max running {e['max_running']}, max running + waiting "
          f"{e['max_running_plus_waiting']} (limit {e['max_num_seqs']} each; {e['samples']} "
          f"samples); coordinator RSS boot {rss['boot'] / 1024:.1f} MiB, start "
          f"{rss['start'] / 1024:.1f}, end {rss['end'] / 1024:.1f}, end + 2 s "
          f"{rss['end_plus_2s'] / 1024:.1f}; client loop lag p99 "
          f"{ms(res['client_loop_lag_p99_s'])} ms\n")
    print("| target | measured | holds |")
    print("|---|---|---|")
    for name, got, ok in targets(res):
        print(f"| {name} | {got} | {'yes' if ok else 'no'} |")
    for k, v in res["keys"].items():
        if v["client_errors"]:
            print(f"{k} client errors: {v['client_errors']}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    p.add_argument("--load-factor", type=float, default=10.0,
                   help="offered load as a multiple of the measured capacity")
    p.add_argument("--interactive-share", type=float, default=0.5,
                   help="share of the offered requests sent with the interactive key")
    p.add_argument("--max-num-seqs", type=int, default=4, help="each sim's running batch")
    p.add_argument("--time-scale", type=float, default=5.0,
                   help="sim step-time multiplier (default step ~11 ms)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=8, help="admission.max_queue")
    p.add_argument("--queue-timeout", type=float, default=1.0, help="admission.queue_timeout_s")
    p.add_argument("--interactive-max-wait", type=float, default=0.025,
                   help="admission.max_wait_s.interactive (0 = queue_timeout_s)")
    p.add_argument("--batch-max-wait", type=float, default=0.0,
                   help="admission.max_wait_s.batch (0 = queue_timeout_s)")
    p.add_argument("--no-predict", action="store_true",
                   help="admission.predict: false (refusal only when the queue is full or a "
                        "wait ran out)")
    p.add_argument("--unloaded-s", type=float, default=8.0,
                   help="seconds of the unloaded reference (one stream per engine)")
    p.add_argument("--capacity-s", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write every figure to this file")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="motor-overload-")
    procs: list[subprocess.Popen[bytes]] = []

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    try:
        sims = []
        for i in range(2):
            port = free_port()
            procs.append(spawn(["sim", "--host", "127.0.0.1", "--port", str(port),
                                "--max-num-seqs", str(a.max_num_seqs),
                                "--time-scale", str(a.time_scale), "--seed", str(i)],
                               f"{tmp}/sim{i}.log"))
            sims.append(f"http://127.0.0.1:{port}")
        max_in_flight = 2 * a.max_num_seqs
        cfg = f"{tmp}/config.json"
        with open(cfg, "w") as f:
            json.dump(coordinator_config(a, max_in_flight), f)
        cport = free_port()
        coord = f"http://127.0.0.1:{cport}"
        for u in sims:
            wait_http(u + "/health")
        cp = spawn(["coordinator", "-c", cfg, "--host", "127.0.0.1", "--port", str(cport),
                    "--policy", "least_load", "--backend", *sims], f"{tmp}/coordinator.log")
        procs.append(cp)
        wait_http(coord + "/readiness")
        res = asyncio.run(measure(a, coord, sims, cp.pid, max_in_flight))
        res["targets"] = [{"target": n, "measured": m, "holds": ok} for n, m, ok in targets(res)]
        report(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        print(f"\nlogs: {tmp}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print("interrupted; stopping the engines and the coordinator", file=sys.stderr)
        return 130
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())

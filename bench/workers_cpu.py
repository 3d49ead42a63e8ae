"""CPU per request of a coordinator with 1 and with 2 workers, natively, under wrk.

Not a pytest suite: a command (issue 13 item 4). Two fast fake backends
(``bench/fast_backend.py``) and, for every repetition and every worker count (interleaved,
the order alternating), a fresh ``motor coordinator --workers N`` (round robin), a
warm-up, then ``wrk -t2 -c64`` (``--connections``) for ``--duration`` seconds of 1 KB chat
requests (``max_tokens`` 16; stream: 16 SSE events). Per run, from /proc, for the
coordinator's whole process tree (supervisor, feed, workers; one process with 1 worker)
and for the backends and wrk: user and system CPU per request, and voluntary / involuntary
context switches per request. Medians over the repetitions are printed last, and the ratio
of 2 workers to 1.

The machine is shared: ``rest_cores`` is what the machine was busy with beyond the
coordinator and the backends (wrk itself, ~0.3-0.5 cores, and anything foreign) during
the run; a run where it is far above the others was disturbed.

Use::

    .venv/bin/python bench/workers_cpu.py                       # 5 reps x 8 s, both modes
    .venv/bin/python bench/workers_cpu.py --reps 3 --stream-only
    .venv/bin/python bench/workers_cpu.py --pythonpath OLD      # motor of OLD as well
    .venv/bin/python bench/workers_cpu.py --connections 8       # a lighter load

Needs ``wrk``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from workers_cost import _descendants  # noqa: E402 (the process tree, one reading of /proc)
TICK = os.sysconf("SC_CLK_TCK")
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"%s"}]%s}'
"""


def _free_ports(n: int) -> list[int]:
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _stat(pids: list[int]) -> tuple[float, float, int, int]:
    """(user s, system s, voluntary, involuntary context switches) summed over ``pids``
    (every thread)."""
    u = s = vol = inv = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            u += int(fields[11]) / TICK
            s += int(fields[12]) / TICK
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches"):
                            vol += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            inv += int(line.split()[1])
        except OSError:
            pass
    return u, s, int(vol), int(inv)


def _busy_cores() -> tuple[float, float]:
    """(busy jiffies, total jiffies) of the whole machine."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v) - idle) / TICK, sum(v) / TICK


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


#: wrk's connections (``--connections``): fewer leave each event loop fewer ready sockets a
#: turn, which is what a second worker does to each loop at the same load
CONNECTIONS = 64


def _wrk(port: int, lua: str, seconds: float) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "-s", lua, f"http://127.0.0.1:{port}/v1/chat/completions"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), cmd


def _requests(out: str) -> int:
    m = re.search(r"(\d+) requests in", out)
    if not m:
        raise RuntimeError("wrk output not understood:\n" + out)
    if re.search(r"Non-2xx", out):
        raise RuntimeError("wrk saw errors:\n" + out)
    return int(m.group(1))


def one_run(workers: int, lua: str, backends: list[int], backend_pid: int, duration: float,
            warmup: float, pythonpath: str | None) -> dict[str, float]:
    (gw,) = _free_ports(1)
    env = dict(os.environ, PYTHONPATH=pythonpath or str(ROOT))
    coord = subprocess.Popen(
        [sys.executable, "-m", "motor", "--log-level", "warning", "coordinator", "--host",
         "127.0.0.1", "--port", str(gw), "--workers", str(workers), "--backend",
         *[f"http://127.0.0.1:{p}" for p in backends]],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        _wait(f"http://127.0.0.1:{gw}/readiness", coord)
        w, _ = _wrk(gw, lua, warmup)
        w.communicate()
        time.sleep(0.5)
        tree = _descendants(coord.pid)
        bpids = _descendants(backend_pid)
        c0, b0, m0 = _stat(tree), _stat(bpids), _busy_cores()
        w, _ = _wrk(gw, lua, duration)
        out, _ = w.communicate()
        c1, b1, m1 = _stat(tree), _stat(bpids), _busy_cores()
        n = _requests(out)
    finally:
        os.killpg(coord.pid, signal.SIGTERM)
        coord.wait(30)
    wall = m1[1] - m0[1]
    ours = (c1[0] - c0[0]) + (c1[1] - c0[1]) + (b1[0] - b0[0]) + (b1[1] - b0[1])
    ncpu = os.cpu_count() or 1
    # busy cores beyond the coordinator and the backends: wrk and anything foreign
    foreign = (m1[0] - m0[0]) - ours
    return {"req_s": n / duration, "us_req": 1e6 * ((c1[0] - c0[0]) + (c1[1] - c0[1])) / n,
            "user_us": 1e6 * (c1[0] - c0[0]) / n, "sys_us": 1e6 * (c1[1] - c0[1]) / n,
            "vcs_req": (c1[2] - c0[2]) / n, "ics_req": (c1[3] - c0[3]) / n,
            "backend_us": 1e6 * ((b1[0] - b0[0]) + (b1[1] - b0[1])) / n,
            "rest_cores": foreign / (wall / ncpu)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--stream-only", action="store_true")
    ap.add_argument("--nonstream-only", action="store_true")
    ap.add_argument("--pythonpath", metavar="DIR", help="also measure motor of DIR ('old')")
    ap.add_argument("--connections", type=int, default=64, metavar="N",
                    help="wrk's connections (default 64)")
    a = ap.parse_args(argv)
    global CONNECTIONS
    if a.connections < 2:
        ap.error(f"--connections is expected to be >= 2 (wrk -t2), got {a.connections}")
    CONNECTIONS = a.connections
    if shutil.which("wrk") is None:
        print("wrk not found", file=sys.stderr)
        return 2
    modes = [False, True]
    if a.stream_only:
        modes = [True]
    elif a.nonstream_only:
        modes = [False]
    variants = [("new", None)] + ([("old", a.pythonpath)] if a.pythonpath else [])
    ports = _free_ports(2)
    backend = subprocess.Popen([sys.executable, str(HERE / "fast_backend.py"), *map(str, ports)],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    tmp = tempfile.mkdtemp(prefix="motor-wcpu-")
    results: dict[tuple[str, bool, int], list[dict[str, float]]] = {}
    try:
        time.sleep(1.0)
        for rep in range(a.reps):
            order = [(v, pp, s, w) for v, pp in variants for s in modes for w in (1, 2)]
            if rep % 2:
                order.reverse()
            for v, pp, stream, w in order:
                lua = os.path.join(tmp, f"post-{int(stream)}.lua")
                with open(lua, "w") as f:
                    f.write(LUA % ("x" * 1024, ',"stream":true' if stream else ""))
                r = one_run(w, lua, ports, backend.pid, a.duration, a.warmup, pp)
                results.setdefault((v, stream, w), []).append(r)
                print(f"rep {rep} {v} {'stream' if stream else 'nonstream'} workers={w}: "
                      + " ".join(f"{k} {x:.2f}" for k, x in r.items()), flush=True)
    finally:
        os.killpg(backend.pid, signal.SIGTERM)
        backend.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nmedians:")
    keys = ["req_s", "us_req", "user_us", "sys_us", "vcs_req", "ics_req", "backend_us"]
    print(f"{'variant':<22}" + "".join(f"{k:>11}" for k in keys) + f"{'w2/w1':>8}")
    for v, _ in variants:
        for s in modes:
            base = None
            for w in (1, 2):
                rs = results[(v, s, w)]
                med = {k: statistics.median(r[k] for r in rs) for k in keys}
                base = med["us_req"] if w == 1 else base
                ratio = "" if w == 1 else f"{med['us_req'] / base:.3f}"
                print(f"{v + (' stream' if s else ' nonstream') + f' w={w}':<22}"
                      + "".join(f"{med[k]:>11.2f}" for k in keys) + f"{ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

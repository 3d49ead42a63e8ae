"""Counted instructions per request of a coordinator with 1 and with N workers.

Not a pytest suite: a command (``issue 13 item 4``). The whole process tree of
``motor coordinator --workers N`` (supervisor, feed and workers; one process with 1 worker)
runs under ``valgrind --tool=callgrind --trace-children=yes`` in front of the two fast
fake backends (``bench/fast_backend.py``); after a warm-up every process of the tree is
switched on with ``callgrind_control -i on PID``, ``--requests`` requests run at
concurrency 8 (``bench/cost_gate.py``'s client), and every process is switched off again.
Then the same wall time passes with no request (the *idle* window): what the tree
executes then is its timers (the rings' polling, the supervisor's child checks), and
``idle`` gives it per second. Health probes are off during both windows (as in
``cost_gate.py``).

Printed per process role (supervisor, feed, worker i): instructions per request in the
load window, instructions per second in the idle window, and per request with the idle
rate taken out (the request's own work). Counted instructions do not depend on what else
the machine does; the timers' share does (valgrind is ~50x slower, so a timer's share per
request is ~50x what it is natively): compare the "net" column.

Use::

    .venv/bin/python bench/workers_cost.py                 # 1 and 2 workers, non-stream
    .venv/bin/python bench/workers_cost.py --stream --workers 2 --requests 1000
    .venv/bin/python bench/workers_cost.py --keep DIR      # keep the callgrind files
    .venv/bin/python bench/workers_cost.py --pythonpath OLD   # motor of OLD (git archive)

Needs ``valgrind`` and ``callgrind_control`` (Debian package ``valgrind``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_gate import (FAST_BACKEND, GateError, _env, _free_port, _load,  # noqa: E402
                       _wait_ready, stop_groups)

WARMUP = 300


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _roles(pids: list[int]) -> dict[int, str]:
    """pid -> role: the supervisor (or the one process with 1 worker), the resource
    tracker, then the feed and worker 0, 1, ... in the order the supervisor starts them."""
    out, kids = {}, []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        if "resource_tracker" in cmd:
            out[p] = "resource tracker"
        elif "multiprocessing" in cmd:
            kids.append(p)
        else:
            out[p] = "supervisor" if len(pids) > 1 else "coordinator"
    for i, p in enumerate(sorted(kids)):
        out[p] = "feed" if i == 0 else f"worker {i - 1}"
    return out


def _toggle(pids: list[int], on: bool) -> None:
    for p in pids:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(p)],
                       capture_output=True, timeout=120)


def _dump(pids: list[int], label: str) -> None:
    for p in pids:
        subprocess.run(["callgrind_control", "--dump=" + label, str(p)], capture_output=True,
                       timeout=120)


def _file_totals(tmp: str) -> dict[tuple[int, int], int]:
    """(pid, dump number: 1 load, 2 idle) -> instructions, from the callgrind part files
    (``cg.PID.1``, ``cg.PID.2``: one per ``--dump``, counters reset at each)."""
    out: dict[tuple[int, int], int] = {}
    for f in Path(tmp).glob("cg.*.*"):
        _, pid, part = f.name.split(".")[:3]
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith(("totals:", "summary:")):
                out[(int(pid), int(part))] = int(line.split()[1])
                break
    return out


def measure(python: str, workers: int, stream: bool, n: int, keep: str | None,
            pythonpath: str | None = None) -> None:
    b1, b2, gw = _free_port(), _free_port(), _free_port()
    body = (b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 1024
            + b'"}],"max_tokens":16,"stream":' + (b"true" if stream else b"false") + b"}")
    tmp = keep or tempfile.mkdtemp(prefix="motor-wcost-")
    os.makedirs(tmp, exist_ok=True)
    cfg = os.path.join(tmp, "coordinator.yaml")
    with open(cfg, "w") as f:
        f.write("coordinator:\n  health_check_interval_s: 86400\n")
    backend = subprocess.Popen([sys.executable, str(FAST_BACKEND), str(b1), str(b2)],
                               env=_env(), start_new_session=True)
    env = _env()
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    coord = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
         f"--callgrind-out-file={tmp}/cg.%p", python, "-m", "motor", "--log-level", "warning",
         "coordinator", "-c", cfg, "--workers", str(workers), "--port", str(gw), "--backend",
         f"http://127.0.0.1:{b1}", f"http://127.0.0.1:{b2}"],
        env=env, start_new_session=True, stderr=subprocess.DEVNULL, cwd=tmp)
    try:
        _wait_ready(gw, coord, 600)
        asyncio.run(_load(gw, body, WARMUP))
        pids = _descendants(coord.pid)
        roles = _roles(pids)
        _toggle(pids, True)
        t0 = time.monotonic()
        ok = asyncio.run(_load(gw, body, n))
        wall = time.monotonic() - t0
        _dump(pids, "load")
        time.sleep(wall)
        _dump(pids, "idle")
        _toggle(pids, False)
        if ok != n:
            raise GateError(f"{n - ok} request(s) failed")
    finally:
        stop_groups((coord, backend), 300)
    tot = _file_totals(tmp)
    print(f"workers={workers} {'stream' if stream else 'non-stream'}: {n} requests in "
          f"{wall:.1f} s under valgrind (+ {wall:.1f} s idle)")
    print(f"{'process':<24}{'load instr/req':>16}{'idle instr/s':>14}{'net instr/req':>15}")
    s_load = s_net = 0.0
    for p in pids:
        load, idle = tot.get((p, 1), 0), tot.get((p, 2), 0)
        net = (load - idle) / n
        s_load += load / n
        s_net += net
        print(f"{roles[p] + ' ' + str(p):<24}{load / n:>16,.0f}{idle / wall:>14,.0f}"
              f"{net:>15,.0f}")
    print(f"{'all':<24}{s_load:>16,.0f}{'':>14}{s_net:>15,.0f}")
    if keep is None:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind files in DIR/workers=N")
    ap.add_argument("--pythonpath", metavar="DIR",
                    help="PYTHONPATH of the coordinator (e.g. an exported older commit)")
    a = ap.parse_args(argv)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} not found", file=sys.stderr)
            return 2
    for w in a.workers:
        measure(a.python, w, a.stream, a.requests,
                None if a.keep is None else os.path.join(a.keep, f"workers={w}"), a.pythonpath)
    return 0


if __name__ == "__main__":
    sys.exit(main())

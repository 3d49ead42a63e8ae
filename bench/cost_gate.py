"""The counted-cost gate: instructions of the hot path for fixed inputs, against a baseline.

Not a pytest suite: a command. Wall-clock figures on a shared machine move by 10-15 % from
run to run; instruction counts under ``valgrind --tool=callgrind`` do not depend on what
else the machine does, so a few percent can be seen. Figures (instructions):

=============================  =============================================================
``hashing.block_hashes``       one ``block_hashes`` of 32768 tokens, block size 16
``radix.match``                one ``PrefixIndex.match`` of 2048 blocks, 1 M stored blocks
``scoring.pick``               one ``pick`` over 64 candidates
``ring.push_pop``              10 000 ``push`` + 10 000 ``pop`` of 64-byte records
``proxy.request.nonstream``    one proxied chat request (1 KB prompt), per request, in the
                               coordinator process (1 worker, round robin, 2 fast backends)
``proxy.request.stream``       the same streamed (16 SSE events)
``proxy.request.stream_paced`` the same with the engine's events 5 ms apart (each reaches
                               the coordinator in a read of its own, as tokens do)
``proxy.request.kv_chat``      one chat request with ``kv_affinity`` and ``motor sim``'s
                               tokenizer: the peer harness's body (a ~1 KB system prompt
                               shared by all, a unique user turn: tokenized, hashed, matched
                               and inserted anew every request; ``bench/kv_proxy_cost.py``)
=============================  =============================================================

The compiled figures count only inside the measured function (``--toggle-collect`` on its
Cython wrapper, argument parsing included; ``bench/cost_work.py``). The proxy figures count
the coordinator process while ``PROXY_REQUESTS`` requests run at concurrency 8, after a
warm-up (``callgrind_control -i on/off``), divided by the request count, with the health
probes off during the count (no timer's work in the figure); they vary by about 0.3 %
between runs (event-loop batching), the compiled ones not at all.

Use::

    .venv/bin/python bench/cost_gate.py                 # check against bench/cost_baseline.json
    .venv/bin/python bench/cost_gate.py --update        # refresh the baseline (intended change)
    .venv/bin/python bench/cost_gate.py --only radix    # figures whose name starts so
    .venv/bin/python bench/cost_gate.py --against-python OLD/.venv/bin/python
                                                        # two venvs (commits) side by side

Exit status: 0 when no figure grew by more than ``--threshold`` percent (default 5), 1 when
one did, 2 for a usage error or a measurement that failed. The table is printed either way.
The counts also depend on the CPU model (libc picks code paths per CPU), Python, numpy, the
Cython that generated the extensions and valgrind: the baseline records them
(``measured_with``), and a baseline measured with others is compared but not enforced
(refresh it there with ``--update``).
Needs ``valgrind`` (Debian package ``valgrind``) and ``callgrind_control`` (same package).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "cost_baseline.json"
WORK = HERE / "cost_work.py"
FAST_BACKEND = HERE / "fast_backend.py"
THRESHOLD_PCT = 5.0
PROXY_REQUESTS = 1000
PROXY_WARMUP = 200
PROXY_CONCURRENCY = 8

COMPILED = ("hashing.block_hashes", "radix.match", "scoring.pick", "ring.push_pop")
PROXY = ("proxy.request.nonstream", "proxy.request.stream", "proxy.request.stream_paced",
         "proxy.request.kv_chat")
#: milliseconds between a paced stream's events (``proxy.request.stream_paced``): far longer
#: than the coordinator takes for one under callgrind, so that nearly every event is a read
PACE_MS = 5
FIGURES = COMPILED + PROXY


class GateError(Exception):
    """A measurement could not be made (exit status 2)."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def identity(python: str) -> dict[str, str]:
    """What the counts depend on besides motor's code: CPU model, Python, numpy, the Cython
    that generated the extensions (read from the generated C of ``python``'s motor)."""
    code = ("import os, platform, numpy, motor._fast as f; "
            "print(platform.python_version()); print(numpy.__version__); "
            "print(os.path.dirname(f.__file__))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=_env(),
                       timeout=120)
    if r.returncode != 0:
        raise GateError(f"{python} cannot import motor: {r.stderr.strip()[-500:]}")
    py, np_version, fast = r.stdout.split("\n")[:3]
    cython = "unknown"
    try:
        with open(os.path.join(fast, "hashing.c")) as f:
            head = f.readline()      # /* Generated by Cython 3.x.y */
        if "Cython" in head:
            cython = head.split("Cython", 1)[1].strip(" */\n")
    except OSError:
        pass
    return {"cpu": cpu_model(), "python": py, "numpy": np_version, "cython": cython}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("PYTHONPATH", None)     # motor as the given interpreter has it installed
    env.pop("PYTHONASYNCIODEBUG", None)
    return env


def _totals(out_prefix: str) -> int:
    """Instructions collected: the ``totals:`` of every callgrind part file."""
    total = 0
    found = False
    for f in Path(out_prefix).parent.glob(Path(out_prefix).name + "*"):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
                found = True
    if not found:
        raise GateError(f"no callgrind totals in {out_prefix}*")
    return total


def measure_compiled(python: str, figure: str, fast_dir: str | None) -> int:
    """Instructions of one run of ``cost_work.py FIGURE`` inside its counted function."""
    sys.path.insert(0, str(HERE))
    try:
        from cost_work import TOGGLES
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory(prefix="motor-cost-") as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        cmd += [f"--toggle-collect={t}" for t in TOGGLES[figure]]
        cmd += [python, str(WORK), figure]
        if fast_dir:
            cmd += ["--fast-dir", fast_dir]
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise GateError(f"{figure}: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
        return _totals(out)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _wait_ready(port: int, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GateError(f"the coordinator exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise GateError(f"the coordinator on 127.0.0.1:{port} was not ready in {deadline_s:g} s")


async def _load(port: int, body: bytes | Callable[[int], bytes], n: int, first: int = 0) -> int:
    """Send ``n`` requests at :data:`PROXY_CONCURRENCY` over keep-alive connections; the
    count of 200 answers. ``body``: the request body, or a function of the request's number
    (``first`` .. ``first + n - 1``) that makes it."""
    from motor.http.client import Pool
    pool = Pool("127.0.0.1", port, max_connections=PROXY_CONCURRENCY)
    sent = ok = 0

    async def worker() -> None:
        nonlocal sent, ok
        while sent < n:
            b = body if isinstance(body, bytes) else body(first + sent)
            sent += 1
            r = await pool.request(b"POST", b"/v1/chat/completions", b,
                                   ((b"content-type", b"application/json"),))
            await r.read()
            ok += r.status == 200
    try:
        await asyncio.gather(*(worker() for _ in range(PROXY_CONCURRENCY)))
    finally:
        pool.close()
    return ok


#: the peer harness's system prompt (``post.lua``: ``string.rep(..., 16)``, 992 characters)
HARNESS_SYSTEM = "You are a helpful assistant. Answer concisely and accurately. " * 16


def harness_chat_body(n: int, stream: bool = False) -> bytes:
    """The peer harness's chat body number ``n``: its shared system prompt and a unique user
    turn (model ``m``, the one ``bench/fast_backend.py`` serves)."""
    user = (f"Question 1-{n}: please summarise the following text about routers and gateways "
            f"in two sentences.")
    return (b'{"model":"m","messages":[{"role":"system","content":"' + HARNESS_SYSTEM.encode()
            + b'"},{"role":"user","content":"' + user.encode() + b'"}],"max_tokens":16,'
            b'"temperature":0,"stream":' + (b"true" if stream else b"false") + b"}")


def kv_config(tokenizer: str) -> str:
    """:func:`count_coordinator`'s config lines for ``kv_affinity`` with the routing
    tokenizer of the model directory ``tokenizer`` for every model."""
    return f"  policy: kv_affinity\n  kv:\n    tokenizers: {{\"*\": {tokenizer}}}\n"


def measure_proxy(python: str, figure: str) -> int:
    """Instructions per request of the coordinator process (``figure``: stream or not, or
    ``kv_chat``)."""
    if figure.endswith(".kv_chat"):
        with tempfile.TemporaryDirectory(prefix="motor-cost-tok-") as tmp:
            from motor.sim.tokenizer import write_model_dir
            tok = str(write_model_dir(Path(tmp)))
            return count_coordinator(python, harness_chat_body, PROXY_REQUESTS, PROXY_WARMUP,
                                     config=kv_config(tok), label=figure)
    paced = figure.endswith(".stream_paced")
    stream = paced or figure.endswith(".stream")
    body = (b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 1024
            + b'"}],"max_tokens":16,"stream":' + (b"true" if stream else b"false") + b"}")
    return count_coordinator(python, body, PROXY_REQUESTS, PROXY_WARMUP, label=figure,
                             backend_args=["--pace-ms", str(PACE_MS)] if paced else [])


def count_coordinator(python: str, body: bytes | Callable[[int], bytes], requests: int,
                      warmup: int, *, config: str = "", env: dict[str, str] | None = None,
                      out_dir: str | None = None, label: str = "proxy",
                      backend_args: list[str] | None = None) -> int:
    """Instructions per request of a coordinator (1 worker, 2 fast backends) run by
    ``python`` under callgrind: ``warmup`` requests, then ``requests`` counted (``body``:
    :func:`_load`'s). ``config``: YAML lines added under ``coordinator:`` (2-space indent);
    ``env``: the coordinator's environment (default :func:`_env`); ``out_dir``: where the
    callgrind file stays (default a temporary folder); ``backend_args``: options of
    ``fast_backend.py`` before its ports. Raises :class:`GateError` when a request fails."""
    b1, b2, gw = _free_port(), _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="motor-cost-") as tmp:
        out = os.path.join(out_dir or tmp, f"cg.{label}.out")
        # no health probe during the count (one round at start): the figure is the requests'
        # own work, not a timer's, however long valgrind takes on a loaded machine
        cfg = os.path.join(tmp, "coordinator.yaml")
        with open(cfg, "w") as f:
            f.write("coordinator:\n  health_check_interval_s: 86400\n" + config)
        backend = subprocess.Popen([sys.executable, str(FAST_BACKEND), *(backend_args or ()),
                                    str(b1), str(b2)], env=_env(), start_new_session=True)
        coord = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={out}", python, "-m", "motor", "--log-level", "warning",
             "coordinator", "-c", cfg, "--port", str(gw), "--backend",
             f"http://127.0.0.1:{b1}", f"http://127.0.0.1:{b2}"],
            env=env if env is not None else _env(), start_new_session=True,
            stderr=subprocess.DEVNULL, cwd=tmp)
        try:
            _wait_ready(gw, coord, 300)
            if asyncio.run(_load(gw, body, warmup)) != warmup:
                raise GateError(f"{label}: warm-up request(s) failed")
            subprocess.run(["callgrind_control", "-i", "on", str(coord.pid)], check=True,
                           capture_output=True, timeout=60)
            ok = asyncio.run(_load(gw, body, requests, warmup))
            subprocess.run(["callgrind_control", "-i", "off", str(coord.pid)], check=True,
                           capture_output=True, timeout=60)
            if ok != requests:
                raise GateError(f"{label}: {requests - ok} request(s) failed")
        finally:
            stop_groups((coord, backend), 120)
        return round(_totals(out) / requests)


def stop_groups(procs: tuple[subprocess.Popen[bytes], ...], wait_s: float) -> None:
    """SIGTERM the process group of each of ``procs`` still running, wait up to ``wait_s``
    seconds for each, then SIGKILL its group."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def measure(python: str, names: list[str], fast_dir: str | None) -> dict[str, int]:
    out = {}
    for name in names:
        out[name] = measure_proxy(python, name) if name in PROXY else \
            measure_compiled(python, name, fast_dir)
        print(f"  measured {name}: {out[name]:,}", file=sys.stderr, flush=True)
    return out


def table(old: dict[str, int], new: dict[str, int], threshold: float,
          old_label: str = "baseline") -> tuple[str, list[str]]:
    """The old / new / change table and the figures that grew past ``threshold`` %."""
    rows = [f"{'figure':<26} {old_label:>14} {'now':>14} {'change':>9}"]
    grew = []
    for name, v in new.items():
        o = old.get(name)
        if o is None:
            rows.append(f"{name:<26} {'-':>14} {v:>14,} {'new':>9}")
            continue
        pct = 100.0 * (v - o) / o if o else 0.0
        mark = "  <- grew" if pct > threshold else ("  (faster: --update)" if pct < -threshold
                                                   else "")
        rows.append(f"{name:<26} {o:>14,} {v:>14,} {pct:>+8.1f}%{mark}")
        if pct > threshold:
            grew.append(name)
    return "\n".join(rows), grew


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="cost_gate.py", description="Instructions of motor's hot path for fixed inputs, "
        "compared with a baseline (valgrind --tool=callgrind).")
    ap.add_argument("--baseline", default=str(BASELINE), help="baseline file (default %(default)s)")
    ap.add_argument("--update", action="store_true", help="measure and write the baseline")
    ap.add_argument("--threshold", type=float, default=THRESHOLD_PCT,
                    help="percent a figure may grow (default %(default)s)")
    ap.add_argument("--only", nargs="+", metavar="PREFIX", help="figures starting with these")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter whose motor is measured (default: this one)")
    ap.add_argument("--against-python", metavar="PYTHON",
                    help="measure the same figures with this interpreter (another venv, e.g. "
                         "another commit's) as the old side, instead of the baseline")
    ap.add_argument("--fast-dir", help="load motor._fast extension modules from this folder")
    ap.add_argument("--json", metavar="FILE", help="also write the figures measured")
    args = ap.parse_args(argv)
    if args.threshold < 0:
        ap.error(f"--threshold is expected to be >= 0, got {args.threshold:g}")
    names = [f for f in FIGURES if not args.only or any(f.startswith(p) for p in args.only)]
    if not names:
        ap.error(f"--only matches no figure (figures: {', '.join(FIGURES)})")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"cost_gate: {tool} not found (Debian package valgrind)", file=sys.stderr)
            return 2
    try:
        if args.against_python:
            old = measure(args.against_python, names, None)
            new = measure(args.python, names, args.fast_dir)
            text, grew = table(old, new, args.threshold, "old")
            print(text)
            enforce = True
        else:
            new = measure(args.python, names, args.fast_dir)
            path = Path(args.baseline)
            base = json.loads(path.read_text()) if path.exists() else {"figures": {}}
            ident = identity(args.python)
            ident["valgrind"] = subprocess.run(["valgrind", "--version"], capture_output=True,
                                               text=True).stdout.strip()
            if args.update:
                figs = dict(base.get("figures", {}))
                figs.update(new)
                path.write_text(json.dumps({
                    "unit": "instructions (valgrind --tool=callgrind)", "measured_with": ident,
                    "figures": {k: figs[k] for k in FIGURES if k in figs}}, indent=2) + "\n")
                print(f"cost_gate: wrote {path}")
            text, grew = table(base.get("figures", {}), new, args.threshold)
            print(text)
            was = base.get("measured_with", ident)
            differ = {k: (was.get(k), v) for k, v in ident.items() if was.get(k) != v}
            enforce = not differ
            if differ:
                print("cost_gate: the baseline was measured with other "
                      + ", ".join(f"{k} ({a!r}, now {b!r})" for k, (a, b) in differ.items())
                      + ": compared, not enforced (refresh it there with --update)")
    except GateError as e:
        print(f"cost_gate: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(new, indent=2) + "\n")
    if grew and enforce and not args.update:
        print(f"cost_gate: {len(grew)} figure(s) grew by more than {args.threshold:g} %: "
              f"{', '.join(grew)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Counted instructions per request of the coordinator with ``kv_affinity`` and a tokenizer,
beside round robin, on the peer harness's chat body.

Not a pytest suite: a command (issue 13 item 3: "kv_affinity, 1 worker, 1 KB chat prompts:
proxy CPU per request <= 1.3x round robin"). The body is the one of the peer harness's
``post.lua``: a ~1 KB system prompt shared by every request and a unique ~110-character
user turn, so the system prompt's token ids are in the piece cache after the warm-up and
the user turn is encoded, hashed and inserted anew by every request (the harness's case;
``bench/cost_gate.py``'s ``proxy.request.nonstream`` sends one fixed body).

The coordinator (1 worker, 2 fast fake backends: ``bench/fast_backend.py``) runs under
``valgrind --tool=callgrind --instr-atstart=no``; after a warm-up, collection is switched on
for ``--requests`` requests at concurrency 8 and off again (``callgrind_control``), and the
process's instructions are divided by the request count. Health probes are off during the
count (as in ``cost_gate.py``). Figures are printed per policy, and their ratio.

Use::

    .venv/bin/python bench/kv_proxy_cost.py                    # rr and kv, 1000 requests
    .venv/bin/python bench/kv_proxy_cost.py --policy kv --keep /tmp/kvcg   # keep cg files
    .venv/bin/python bench/kv_proxy_cost.py --tokenizer /tmp/bpe-tokdir    # another model dir
    .venv/bin/python bench/kv_proxy_cost.py --pythonpath OLD   # OLD/motor: another revision

``--tokenizer`` (default: the directory ``motor sim`` writes, created in a temporary folder
when not given) is a HF model directory (``tokenizer.json`` + ``tokenizer_config.json``).
Needs ``valgrind`` and ``callgrind_control`` (Debian package ``valgrind``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_gate import (GateError, _env, count_coordinator, harness_chat_body,  # noqa: E402
                       kv_config)

WARMUP = 200


def body(n: int, stream: bool = False) -> bytes:
    """The peer harness's chat body number ``n`` (:func:`cost_gate.harness_chat_body`)."""
    return harness_chat_body(n, stream)


def measure(python: str, policy: str, tokenizer: str, requests: int, stream: bool,
            keep: str | None, pythonpath: str | None = None) -> int:
    """Instructions per request of the coordinator process with ``policy`` (rr or kv);
    ``pythonpath``: the coordinator imports motor from there (another tree's)."""
    env = _env()
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    config = kv_config(tokenizer) if policy == "kv" else ""
    return count_coordinator(python, lambda i: body(i, stream), requests, WARMUP,
                             config=config, env=env, out_dir=keep, label=policy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv_proxy_cost.py", description=__doc__.split("\n")[0])
    ap.add_argument("--policy", nargs="+", choices=("rr", "kv"), default=["rr", "kv"])
    ap.add_argument("--tokenizer", help="model directory (default: motor sim's, written to a "
                                        "temporary folder)")
    ap.add_argument("--requests", type=int, default=1000, help="counted requests (>= 1)")
    ap.add_argument("--stream", action="store_true", help="stream the answers (16 events)")
    ap.add_argument("--python", default=sys.executable, help="interpreter whose motor runs")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind files in DIR")
    ap.add_argument("--pythonpath", metavar="DIR",
                    help="the coordinator imports motor from DIR (e.g. a copy of another "
                         "revision's motor/ with its built extensions)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests is expected to be >= 1, got {args.requests}")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"kv_proxy_cost: {tool} not found (Debian package valgrind)", file=sys.stderr)
            return 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="motor-kvtok-") as tmp:
        tok = args.tokenizer
        if tok is None:
            from motor.sim.tokenizer import write_model_dir
            tok = str(write_model_dir(Path(tmp)))
        got: dict[str, int] = {}
        try:
            for p in args.policy:
                got[p] = measure(args.python, p, tok, args.requests, args.stream, args.keep,
                                 args.pythonpath)
                print(f"  {p}: {got[p]:,} instructions/request", file=sys.stderr, flush=True)
        except GateError as e:
            print(f"kv_proxy_cost: {e}", file=sys.stderr)
            return 2
    for p, v in got.items():
        print(f"{p:<4} {v:>12,} instructions/request")
    if "rr" in got and "kv" in got:
        print(f"kv / rr = {got['kv'] / got['rr']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

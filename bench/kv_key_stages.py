"""Counted instructions per call of each stage of ``kv_affinity``'s routing key and decision,
in one process, on the peer harness's chat bodies (``bench/kv_proxy_cost.py``'s).

Not a pytest suite: a command. Where ``bench/kv_proxy_cost.py`` gives the whole request's
figure, this splits the routing key's part: for each stage, a process under
``valgrind --tool=callgrind --instr-atstart=no`` prepares ``--requests`` bodies (after 300
warm-up ones, so the system prompt's pieces, prefix and words are cached, as in the
coordinator), switches collection on (``callgrind_control``), runs the stage once per body,
switches it off; the figure is the process's instructions divided by the count. Stages:

=============  ===========================================================================
``key``        ``Tokenizers.warm`` + ``block_key`` (what ``KvAffinity.prepare`` runs)
``render``     ``RoutingTokenizer.render_chat`` (the chat template's jinja render)
``plan``       ``chat_plan`` (the rendered text cut at the added tokens)
``plan_chat``  ``plan_chat`` (the plan from the splice's segments, no text: both above)
``chat_key``   a chat's request key (``_chat_key``: JSON of the template's inputs; since
               2026-12-06 only ``token_ids`` and tokenizers that do not cut chats make it)
``plan_key``   ``plan_key`` (the hash chain after the cached prefix, the new turn's ids)
``new_turn``   ``encode_piece`` of the user turn (its words; one new word per request)
``pick``       ``KvAffinity.pick`` over 2 endpoints (match, columns, cost)
``routed``     ``pick`` + ``routed`` (the approximate index's insertion)
=============  ===========================================================================

Use::

    .venv/bin/python bench/kv_key_stages.py                  # every stage, 1000 calls
    .venv/bin/python bench/kv_key_stages.py render key       # some

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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cost_gate import _env, _totals  # noqa: E402
STAGES = ("key", "render", "plan", "plan_chat", "chat_key", "plan_key", "new_turn", "pick", "routed")
WARMUP = 300


def _toggle(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True,
                   capture_output=True, timeout=60)


def run_stage(stage: str, n: int, tokdir: str) -> None:
    """In the counted process: prepare, count ``stage`` over ``n`` bodies."""
    import orjson

    from kv_proxy_cost import body

    from motor.config.schema import KvRoutingConfig, Role
    from motor.coordinator.endpoints import EndpointState
    from motor.coordinator.kv.router import KvRouter
    from motor.coordinator.policy import RequestInfo
    from motor.coordinator.policy.kv_affinity import KvAffinity
    from motor.coordinator.tokenize import _chat_key

    pol = KvAffinity(KvRouter(KvRoutingConfig.model_validate({"tokenizers": {"*": tokdir}})))
    toks = pol.router.tokenizers
    bodies = [orjson.loads(body(i)) for i in range(n + WARMUP)]
    tok = toks.get("m")
    eps = [EndpointState(k, "m", Role.UNION, "127.0.0.1", 1, 0, pool=None)  # type: ignore[arg-type]
           for k in ("a", "b")]
    infos = []
    for b in bodies[:WARMUP]:
        info = RequestInfo("m", 1, 16)
        pol.prepare(info, "chat", b)
        pol.routed(pol.pick(eps, info) or eps[0], info)
    todo = bodies[WARMUP:]
    texts = [tok.render_chat(b) for b in todo]
    plans: list[Any] = [tok.chat_plan(t) for t in texts]
    turns = [p[-5] for p in plans]          # [..., 257, "user\n...", 258, "\n", 257, "assistant\n"]
    if stage in ("pick", "routed"):
        for b in todo:
            info = RequestInfo("m", 1, 16)
            pol.prepare(info, "chat", b)
            infos.append(info)
    if stage not in ("pick", "routed"):
        _toggle("on")
    if stage == "key":
        for b in todo:
            toks.warm("chat", b)
            toks.block_key("chat", b, 16)
    elif stage == "render":
        for b in todo:
            tok.render_chat(b)
    elif stage == "plan":
        for t in texts:
            tok.chat_plan(t)
    elif stage == "plan_chat":
        for b in todo:
            tok.plan_chat(b)
    elif stage == "chat_key":
        for b in todo:
            _chat_key(tok.source, b)
    elif stage == "plan_key":
        for p in plans:
            tok.plan_key(p, 16, 0)
    elif stage == "new_turn":
        for u in turns:
            tok.encode_piece(u)
    else:
        # on a running loop, as in the coordinator: ``KvRouter.update_gauges`` (called by
        # ``routed``) schedules its trailing refresh there once per 0.5 s; without a loop it
        # raised and caught a RuntimeError on every call (~1.5 k instructions)
        # (the loop made and closed outside the count)
        async def decide() -> None:
            _toggle("on")
            for info in infos:
                ep = pol.pick(eps, info)
                if stage == "routed" and ep is not None:
                    pol.routed(ep, info)
            _toggle("off")
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(decide())
        finally:
            loop.close()
        return
    _toggle("off")


def count(stage: str, n: int, tokdir: str, python: str) -> int:
    """Instructions per call of ``stage`` (a callgrind run of this script)."""
    with tempfile.TemporaryDirectory(prefix="motor-kvstage-") as tmp:
        out = os.path.join(tmp, "cg.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={out}", python, __file__, "--run", stage,
                        "--requests", str(n), "--tokenizer", tokdir],
                       check=True, capture_output=True, timeout=1800, env=_env())
        return round(_totals(out) / n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv_key_stages.py", description=__doc__.split("\n")[0])
    ap.add_argument("stages", nargs="*", help=f"some of {', '.join(STAGES)} (default: all)")
    ap.add_argument("--requests", type=int, default=1000, help="counted calls (>= 1)")
    ap.add_argument("--tokenizer", help="model directory (default: motor sim's, written to a "
                                        "temporary folder)")
    ap.add_argument("--run", choices=STAGES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests is expected to be >= 1, got {args.requests}")
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {', '.join(bad)}: expected some of {', '.join(STAGES)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("kv_key_stages: valgrind / callgrind_control not found (Debian package "
              "valgrind)", file=sys.stderr)
        return 2
    if args.run:
        run_stage(args.run, args.requests, args.tokenizer)
        return 0
    with tempfile.TemporaryDirectory(prefix="motor-kvtok-") as tmp:
        tok = args.tokenizer
        if tok is None:
            from motor.sim.tokenizer import write_model_dir
            tok = str(write_model_dir(Path(tmp)))
        for s in args.stages or STAGES:
            print(f"{s:<10} {count(s, args.requests, tok, sys.executable):>10,} "
                  f"instructions/call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

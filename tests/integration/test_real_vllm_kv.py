"""KV-cache-aware routing with two REAL vLLM CPU engines (issue 4): ``motor up`` with two
``kind: vllm`` engines publishing KV events on ZMQ (``--kv-events-config``), the coordinator
in ``kv_affinity`` with the approximate index off, so routing follows the engines' own
``BlockStored`` events only.

The two engines use the two publisher directions of vLLM (``ZmqEventPublisher``):

* engine ``a``: ``ipc://...`` (vLLM binds, the coordinator connects), with a replay endpoint;
* engine ``b``: ``tcp://127.0.0.1:P`` (an explicit host: vLLM **connects**, the coordinator
  binds; registered as ``bind:tcp://127.0.0.1:P`` by the node manager).

Checked:

(a) the coordinator's routing tokenizer (``coordinator.kv.tokenizers`` -> the model directory)
    computes the same token ids as the engine: vLLM's ``/tokenize`` (chat with template,
    ``add_generation_prompt``, ``continue_final_message``, completions text with special-token
    strings and non-ASCII) and ``return_token_ids`` of requests through the coordinator;
(b) per shared prefix (a long completions prefix, a long chat system prompt): the first
    request lands on one engine (the completions one through the coordinator; the chat one
    is sent straight to the other engine, so only that engine's KV events can tell the
    coordinator where it is), its KV events reach the coordinator's exact index, and the
    following requests sharing the prefix all go to that engine: its
    ``vllm:prefix_cache_hits_total`` grows by the shared whole blocks per request,
    ``usage.prompt_tokens_details.cached_tokens`` says the same (``--enable-prompt-tokens-details``),
    the other engine sees none of them; the coordinator's KV metrics show the applied events.

Slow lane (``-m real_engine``); reuses the real-engine helpers of ``test_real_vllm.py``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from motor.config.load import parse_config
from motor.coordinator.tokenize import Tokenizers
from motor.cluster import Cluster, StartError
from tests.integration.test_real_vllm import (ENGINE_ENV, ENGINE_FLAGS, LAUNCHER_MODULE, SERVED,
                                              engine_metric, http, tail_logs, vllm_python,
                                              wait_for, write_tiny_llama)
from tests.support.procs import free_ports

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

BLOCK = ENGINE_FLAGS["block_size"]          # 32, the engines' block size
MOTOR_BLOCK = 16                            # the coordinator's: engine blocks are split in 2
HITS = "vllm:prefix_cache_hits_total"
DONE = "vllm:request_success_total"
PREFIX = "".join(f"Shared system prompt, line {i:02d}: answer briefly and politely.\n"
                 for i in range(12))       # ~700 bytes = tokens (byte tokenizer)
SYSTEM = "".join(f"You are assistant number {i}; keep the answers short and kind.\n"
                 for i in range(10))


def _engine(name: str, port: int, model: Path, py: str, kv_events: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "kind": "vllm", "model": str(model), "served_model_name": SERVED,
            "count": 1, "base_port": port, "launcher": [py, "-m", LAUNCHER_MODULE],
            "env": ENGINE_ENV,
            "engine_config": {**ENGINE_FLAGS, "enable_prefix_caching": True,
                              "enable_prompt_tokens_details": True,
                              "kv_events_config": {"enable_kv_cache_events": True,
                                                   "publisher": "zmq", "topic": "kv",
                                                   **kv_events}},
            "health_interval_s": 0.5, "startup_timeout_s": 300, "stop_timeout_s": 20,
            "virtual_inference": {"enabled": False}}


def _metric(url: str, name: str, **labels: str) -> float:
    st, text = http(url + "/metrics")
    assert st == 200
    total = 0.0
    for line in str(text).splitlines():
        head = line.split(" ")[0]
        if (head == name or head.startswith(name + "{")) and \
                all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompt_ids(doc: dict[str, Any]) -> list[int] | None:
    ids = doc.get("prompt_token_ids")
    if ids is None and doc.get("choices"):
        ids = doc["choices"][0].get("prompt_token_ids")
    return ids


def test_real_vllm_kv_affinity_follows_real_kv_events(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        msg = ("no vLLM CPU venv (set MOTOR_VLLM_PY or MOTOR_VLLM_VENV, or run the real-engine "
               "lane of .ci/run)")
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    model = write_tiny_llama(tmp_path / "tiny-llama")
    logs = tmp_path / "logs"
    sock_dir = tempfile.mkdtemp(prefix="motor-kv-", dir="/tmp")   # ipc paths stay short
    ctl, gw, ea, eb, kb = free_ports(5)
    ipc = f"ipc://{sock_dir}/a.sock"
    cfg = parse_config({
        "controller": {"port": ctl, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "coordinator": {"port": gw, "policy": "kv_affinity",
                        "kv": {"block_size": MOTOR_BLOCK, "tokenizers": {SERVED: str(model)},
                               "approximate": {"mode": "off"}}},
        "nodes": [{"name": "n0", "log_dir": str(logs / "engines"), "engines": [
            _engine("a", ea, model, py, {"endpoint": ipc,
                                         "replay_endpoint": f"ipc://{sock_dir}/a-replay.sock"}),
            _engine("b", eb, model, py, {"endpoint": f"tcp://127.0.0.1:{kb}"})]}],
    }, "test")
    cluster = Cluster(cfg, str(logs))
    url = cluster.url
    engines = {"a": ea, "b": eb}
    t0 = time.monotonic()
    try:
        try:
            cluster.start(360)
        except StartError as e:
            pytest.fail(f"cluster not ready: {e}\n{tail_logs(logs)}")
        print(f"\ntwo vLLM engines with KV events ready behind the coordinator in "
              f"{time.monotonic() - t0:.1f} s")
        # the registered subscriber addresses: connect to the ipc publisher, bind for the tcp one
        st, table = http(f"http://127.0.0.1:{ctl}/v1/instances")
        assert st == 200
        addrs = {i["id"]: i.get("kv_events") for i in table["instances"]}
        assert addrs == {"n0/a/0": f"{ipc};replay=ipc://{sock_dir}/a-replay.sock",
                         "n0/b/0": f"bind:tcp://127.0.0.1:{kb}"}, addrs
        wait_for(lambda: _metric(url, "motor_coordinator_kv_event_subscriptions") >= 2, 30,
                 "both KV-event subscriptions", logs)
        time.sleep(1.5)   # ZMQ slow joiner: the subscriptions / connections settle

        # ---- (a) the coordinator's token ids == the engine's
        toks = Tokenizers({SERVED: str(model)})
        chat_bodies: list[dict[str, Any]] = [
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Grüße, 世界! <|im_end|> tokens?"},
                          {"role": "assistant", "content": "Sure."},
                          {"role": "user", "content": "again"}]},
            {"messages": [{"role": "user", "content": "no prompt"}],
             "add_generation_prompt": False},
            {"messages": [{"role": "user", "content": "complete"},
                          {"role": "assistant", "content": "The answer is"}],
             "add_generation_prompt": False, "continue_final_message": True},
        ]
        for body in chat_bodies:
            mine = toks.token_ids("chat", {"model": SERVED, **body})
            st, doc = http(f"http://127.0.0.1:{ea}/tokenize", {"model": SERVED, **body})
            assert st == 200, doc
            assert doc["tokens"] == mine, (body, doc["tokens"], mine)
        for prompt in ["Hello world", "ünïcødé ✓ <|endoftext|> and <|im_start|>x", PREFIX]:
            mine = toks.token_ids("completions", {"model": SERVED, "prompt": prompt})
            st, doc = http(f"http://127.0.0.1:{eb}/tokenize", {"model": SERVED, "prompt": prompt})
            assert st == 200, doc
            assert doc["tokens"] == mine, (prompt, doc["tokens"], mine)
        # and what the engines compute for requests routed through the coordinator
        for route, path, body in [
                ("completions", "/v1/completions", {"prompt": "ünïcødé <|im_start|> route"}),
                ("chat", "/v1/chat/completions", chat_bodies[1])]:
            full = {"model": SERVED, "max_tokens": 2, "temperature": 0, "return_token_ids": True,
                    **body}
            st, doc = http(url + path, full, timeout=60)
            assert st == 200, doc
            ids = _prompt_ids(doc)
            assert ids == toks.token_ids(route, full), (route, ids)
        print(f"tokenization: {len(chat_bodies)} chat + 3 completions bodies equal vLLM /tokenize, "
              f"2 routed requests equal return_token_ids")

        # ---- (b) a shared prefix goes to the engine holding it
        def step(path: str, body: dict[str, Any], base: str = url
                 ) -> tuple[str, dict[str, Any], dict[str, float]]:
            done0 = {n: engine_metric(p, DONE) for n, p in engines.items()}
            hits0 = {n: engine_metric(p, HITS) for n, p in engines.items()}
            st, doc = http(base + path, {"model": SERVED, "max_tokens": 4, "temperature": 0,
                                         **body}, timeout=60)
            assert st == 200, doc
            served = [n for n, p in engines.items() if engine_metric(p, DONE) > done0[n]]
            assert len(served) == 1, served
            hits = {n: engine_metric(p, HITS) - hits0[n] for n, p in engines.items()}
            return served[0], doc["usage"], hits

        groups = [
            ("completions", "/v1/completions",
             [{"prompt": PREFIX + f"Question {q}: what is {q} + {q}?"} for q in range(4)]),
            ("chat", "/v1/chat/completions",
             [{"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"Tell me about the number {q}."}]}
              for q in range(4)]),
        ]
        report = []
        holders: list[str] = []
        for gi, (route, path, bodies) in enumerate(groups):
            ids = [toks.token_ids(route, {"model": SERVED, **b}) for b in bodies]
            shared = min(_common(ids[0], x) for x in ids[1:])
            whole = shared // BLOCK * BLOCK
            assert whole >= 10 * BLOCK, shared
            stored0 = _metric(url, "motor_coordinator_kv_events_applied_total", kind="stored")
            blocks0 = _metric(url, "motor_coordinator_kv_index_blocks", index="exact")
            if gi == 0:   # through the coordinator: nothing cached anywhere, either engine
                holder, usage, hits = step(path, bodies[0])
            else:         # sent to the other engine directly: its events alone say where it is
                other = "b" if holders[0] == "a" else "a"
                holder, usage, hits = step(path, bodies[0], f"http://127.0.0.1:{engines[other]}")
                assert holder == other
            holders.append(holder)
            assert usage["prompt_tokens"] == len(ids[0])
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
            # the holder's BlockStored events reach the coordinator's exact index
            want = blocks0 + len(ids[0]) // BLOCK * (BLOCK // MOTOR_BLOCK)
            end = time.monotonic() + 20
            while _metric(url, "motor_coordinator_kv_index_blocks", index="exact") < want:
                if time.monotonic() > end:
                    st, text = http(url + "/metrics")
                    kv = "\n".join(ln for ln in str(text).splitlines()
                                   if ln.startswith("motor_coordinator_kv"))
                    pytest.fail(f"{route}: the first request's blocks never reached the exact "
                                f"index (want {want:g} blocks)\n{kv}\n{tail_logs(logs)}")
                time.sleep(0.1)
            stored = _metric(url, "motor_coordinator_kv_events_applied_total",
                             kind="stored") - stored0
            assert stored >= 1
            cached, grown = [], []
            for b, _x in zip(bodies[1:], ids[1:]):
                served, usage, hits = step(path, b)
                assert served == holder, (route, served, holder)
                c = usage["prompt_tokens_details"]["cached_tokens"]
                assert c >= whole and c % BLOCK == 0, (route, usage, whole)
                assert hits[holder] == c and sum(hits.values()) == c, (hits, c)
                cached.append(c)
                grown.append(hits[holder])
                time.sleep(0.3)   # this request's own stores reach the index
            report.append(f"{route}: first request -> engine {holder}"
                          f"{' (sent there directly)' if gi else ''} "
                          f"({len(ids[0])} prompt tokens, {stored:g} BlockStored event(s) "
                          f"applied); {len(cached)} followers sharing {shared} tokens -> "
                          f"engine {holder}, cached_tokens {cached}, {HITS} +{grown}")
        # interleaved: each prefix still goes to its own holder (one per engine)
        assert sorted(holders) == ["a", "b"]
        for (_route, path, bodies), holder in zip(groups, holders):
            served, usage, hits = step(path, {**bodies[1], "max_tokens": 2})
            assert served == holder and usage["prompt_tokens_details"]["cached_tokens"] > 0
        report.append(f"interleaved: completions -> {holders[0]}, chat -> {holders[1]}")
        for line in report:
            print(line)

        applied = {k: _metric(url, "motor_coordinator_kv_events_applied_total", kind=k)
                   for k in ("stored", "removed", "cleared")}
        dropped = _metric(url, "motor_coordinator_kv_events_dropped_total")
        batches = _metric(url, "motor_coordinator_kv_event_batches_total")
        gaps = _metric(url, "motor_coordinator_kv_event_gaps_total")
        prompt = _metric(url, "motor_coordinator_kv_prompt_tokens_total")
        matched = _metric(url, "motor_coordinator_kv_matched_tokens_total")
        blocks = _metric(url, "motor_coordinator_kv_index_blocks", index="exact")
        print(f"coordinator: {batches:g} event batches, applied {applied}, dropped {dropped:g}, "
              f"gaps {gaps:g}, exact index {blocks:g} blocks, matched {matched:g} of "
              f"{prompt:g} prompt tokens")
        assert applied["stored"] >= 2 and batches >= 2 and dropped == 0 and gaps == 0
        assert matched > 0
    finally:
        cluster.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)

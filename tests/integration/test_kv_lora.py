"""Adapter-aware KV routing end to end: two real ``motor sim`` processes with a LoRA adapter
loaded at run time, publishing KV events whose ``BlockStored`` name the adapter
(``lora_name``), behind a standalone coordinator (``--policy kv_affinity``, ``--kv-events``).
The adapter's requests follow the instance holding their prefix *under the adapter*; the
same prompt for the base model is credited nothing (its blocks hash apart, in the sims and
in motor's index: case N12).

All processes on 127.0.0.1, each in its own process group, stopped by pid.
"""
from __future__ import annotations

import json
import time
import urllib.request

from tests.integration.test_kv_routing import PREFIX, SIM, metric, post, served, wait_until
from tests.support.procs import free_ports, spawn, stop, wait_http


def load_adapter(port: int) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                                 data=json.dumps({"lora_name": "sql-lora",
                                                  "lora_path": "/adapters/sql"}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200      # vLLM answers plain text


def complete(gw: int, model: str, prompt: str) -> dict:
    return post(gw, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2})


def test_adapter_blocks_route_apart_from_the_base_models(tmp_path):
    gw, s1, k1, s2, k2 = free_ports(5)
    sims = [s1, s2]
    procs = [spawn(["sim", "--port", str(s), "--kv-events-endpoint", f"tcp://127.0.0.1:{k}",
                    "--seed", str(i)] + SIM, str(tmp_path / f"sim{i}.log"))
             for i, (s, k) in enumerate(((s1, k1), (s2, k2)))]
    try:
        for s in sims:
            wait_http(f"http://127.0.0.1:{s}/health")
            load_adapter(s)
        procs.append(spawn(["coordinator", "--port", str(gw), "--policy", "kv_affinity",
                            "--backend", *(f"http://127.0.0.1:{s}" for s in sims),
                            "--kv-events", f"http://127.0.0.1:{s1}=tcp://127.0.0.1:{k1}",
                            "--kv-events", f"http://127.0.0.1:{s2}=tcp://127.0.0.1:{k2}"],
                           str(tmp_path / "coordinator.log")))
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        wait_until(lambda: metric(gw, "motor_coordinator_kv_event_subscriptions") >= 2, 20,
                   "both KV-event subscriptions")
        time.sleep(0.5)  # ZMQ slow joiner
        # the adapter is routable once the coordinator has read the sims' model lists
        wait_until(lambda: _serves(gw), 20, "the adapter routable")

        before = served(sims)
        first = complete(gw, "sql-lora", PREFIX + "question 0?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        holder = [a - b for a, b in zip(served(sims), before)].index(1)
        wait_until(lambda: metric(gw, "motor_coordinator_kv_index_blocks", index="exact") >= 20,
                   20, "the adapter's blocks in the exact index")
        for q in range(1, 5):
            before = served(sims)
            out = complete(gw, "sql-lora", PREFIX + f"question {q}?")
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PREFIX) - 16
            assert [a - b for a, b in zip(served(sims), before)].index(1) == holder
        # the base model finds nothing of the adapter's blocks, in motor's index or the sims
        matched = metric(gw, "motor_coordinator_kv_matched_tokens_total")
        out = complete(gw, "motor-sim", PREFIX + "question 1?")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(gw, "motor_coordinator_kv_matched_tokens_total") == matched
    finally:
        for p in procs:
            stop(p)


def _serves(gw: int) -> bool:
    try:
        complete(gw, "sql-lora", "warm-up, no shared prefix " + str(time.monotonic()))
        return True
    except Exception:  # noqa: BLE001 - 404 until the coordinator has the adapter
        return False

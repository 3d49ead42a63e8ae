"""The simulator's runtime LoRA API (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): listed on /v1/models with the base model as parent, served
under its name, vLLM's wording for the errors."""
from __future__ import annotations

import json

from .helpers import get_json, post_json, request


def test_load_serve_and_unload_an_adapter(sim):
    status, _, out = request(sim.port, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "sql-lora", "lora_path": "/adapters/sql"})
    assert status == 200 and out == b"Success: LoRA adapter 'sql-lora' added successfully."
    try:
        models = {m["id"]: m for m in get_json(sim.port, "/v1/models")["data"]}
        assert models["sql-lora"]["parent"] == "motor-sim"
        assert models["sql-lora"]["root"] == "/adapters/sql"
        assert models["motor-sim"]["parent"] is None and models["motor-sim"]["max_model_len"]
        status, d = post_json(sim.port, "/v1/completions",
                              {"model": "sql-lora", "prompt": "x", "max_tokens": 2})
        assert status == 200 and d["model"] == "sql-lora"
        status, _, out = request(sim.port, "POST", "/v1/load_lora_adapter",
                                 {"lora_name": "sql-lora", "lora_path": "/adapters/sql"})
        err = json.loads(out)["error"]
        assert status == 400 and err["message"] == \
            "The lora adapter 'sql-lora' has already been loaded."
    finally:
        status, _, out = request(sim.port, "POST", "/v1/unload_lora_adapter",
                                 {"lora_name": "sql-lora"})
    assert status == 200 and out == b"Success: LoRA adapter 'sql-lora' removed successfully."
    assert "sql-lora" not in {m["id"] for m in get_json(sim.port, "/v1/models")["data"]}
    status, d = post_json(sim.port, "/v1/completions",
                          {"model": "sql-lora", "prompt": "x", "max_tokens": 2})
    assert status == 404
    status, _, out = request(sim.port, "POST", "/v1/unload_lora_adapter",
                             {"lora_name": "sql-lora"})
    assert status == 404 and json.loads(out)["error"]["type"] == "NotFoundError"
    status, _, out = request(sim.port, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in json.loads(out)["error"]["message"]

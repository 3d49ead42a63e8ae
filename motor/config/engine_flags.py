"""The engine flags motor sets itself, per engine kind: one table for the config schema (which
refuses them in ``engine_config`` at load time) and the node manager's engine backends (which
set them, and refuse them again when they build an engine's argv).

Flag names are compared in the canonical spelling of :func:`flag_key` (``max_model_len``,
``max-model-len`` and ``--max-model-len`` are one flag). This module imports nothing of motor,
so both :mod:`motor.config.schema` and :mod:`motor.node_manager.engines` can use it.
"""
from __future__ import annotations

from collections.abc import Mapping

#: engine kind -> {managed flag (canonical spelling) -> the engine config field motor sets it from}.
#: A flag is listed when the kind's backend sets it for some engine (``data-parallel-size`` only
#: with ``dp_size > 1``, SGLang's ``disaggregation-mode`` only for the prefill / decode roles):
#: the field is the one place to choose it either way. Flags that are only motor *defaults*
#: (vLLM ``kv-transfer-config``, ``data-parallel-address``, SGLang
#: ``disaggregation-bootstrap-port``, ...) are not listed: ``engine_config`` may replace them.
MANAGED_FLAGS: Mapping[str, Mapping[str, str]] = {
    "vllm": {
        "host": "host",
        "port": "base_port",
        "model": "model",
        "served-model-name": "served_model_name",
        "tensor-parallel-size": "tp_size",
        "data-parallel-size": "dp_size",
        "data-parallel-rank": "dp_size",
    },
    "sglang": {
        "host": "host",
        "port": "base_port",
        "model-path": "model",
        "served-model-name": "served_model_name",
        "tp-size": "tp_size",
        "dp-size": "dp_size",
        "disaggregation-mode": "role",
    },
    "sim": {
        "host": "host",
        "port": "base_port",
        "model": "model",
        "role": "role",
        "dp-rank": "dp_size",
    },
}


def flag_key(key: str) -> str:
    """Canonical spelling of a flag name: ``max_model_len`` / ``--max-model-len`` -> ``max-model-len``."""
    return key.strip().lstrip("-").replace("_", "-")


def managed_flags(kind: str) -> Mapping[str, str]:
    """The managed flags of engine ``kind`` (``vllm``, ``sglang``, ``sim``): canonical flag ->
    the engine config field motor sets it from; empty for an unknown kind."""
    return MANAGED_FLAGS.get(kind, {})


__all__ = ["MANAGED_FLAGS", "flag_key", "managed_flags"]

"""Generate the configuration reference (``docs/configuration.md``) from the schema.

``python -m motor.config.doc > docs/configuration.md``; a test checks the file is current.
"""
from __future__ import annotations

import enum
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from motor.config import schema

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("controller", schema.ControllerConfig),
    ("controller.tls", schema.ControlPlaneTlsConfig),
    ("coordinator", schema.CoordinatorConfig),
    ("coordinator.timeouts", schema.TimeoutConfig),
    ("coordinator.retries", schema.RetryConfig),
    ("coordinator.breaker", schema.BreakerConfig),
    ("coordinator.failover", schema.FailoverConfig),
    ("coordinator.kv", schema.KvRoutingConfig),
    ("coordinator.kv.tier_credit", schema.KvTierCreditConfig),
    ("coordinator.kv.ttft", schema.KvTtftConfig),
    ("coordinator.kv.session", schema.KvSessionConfig),
    ("coordinator.kv.events", schema.KvEventsConfig),
    ("coordinator.kv.approximate", schema.KvApproximateConfig),
    ("coordinator.pd", schema.PdConfig),
    ("coordinator.pd.joint", schema.PdJointConfig),
    ("coordinator.pd.joint.transfer_us_per_token", schema.PdTransferConfig),
    ("coordinator.tls", schema.TlsServerConfig),
    ("coordinator.upstream_tls", schema.TlsClientConfig),
    ("coordinator.api_keys[] (mapping form)", schema.ApiKeyConfig),
    ("coordinator.limits", schema.LimitsConfig),
    ("coordinator.limits.default, coordinator.limits.keys.<name>", schema.KeyLimitConfig),
    ("coordinator.admission", schema.AdmissionConfig),
    ("coordinator.tracing", schema.TracingConfig),
    ("coordinator.gc", schema.GcConfig),
    ("nodes[]", schema.NodeConfig),
    ("nodes[].npu", schema.NpuConfig),
    ("nodes[].engines[]", schema.EngineConfig),
    ("nodes[].engines[].restart", schema.RestartConfig),
    ("nodes[].engines[].virtual_inference", schema.VirtualInferenceConfig),
    ("nodes[].engines[].tls", schema.EngineTlsConfig),
]


def _type(ann: object) -> str:
    if typing.get_origin(ann) is typing.Annotated:   # validators / tags: the base type
        return _type(typing.get_args(ann)[0])
    if typing.get_origin(ann) is list:
        return f"list[{_type(typing.get_args(ann)[0])}]"
    if typing.get_origin(ann) is dict:
        k, v = typing.get_args(ann)
        val = v.__name__ if isinstance(v, type) and issubclass(v, BaseModel) else _type(v)
        return f"dict[{_type(k)}, {val}]"
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) not in args:
        return " \\| ".join(_type(a) for a in args)
    if args and type(None) in args:  # Optional[X] -> "X or null"
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _type(inner[0]) + " \\| `null`"
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    s = repr(ann) if not isinstance(ann, type) else ann.__name__
    return s.replace("typing.", "").replace("|", "\\|")


def _default(field: typing.Any) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is not None:
            v = field.default_factory()
            return "(see section)" if isinstance(v, BaseModel) else f"`{v!r}`"
        return "**required**"
    v = field.default
    if isinstance(v, enum.Enum):
        v = v.value
    return f"`{v!r}`" if v is not None else "`null`"


def render() -> str:
    out = ["# Configuration reference", "",
           "Generated from `motor/config/schema.py` by `python -m motor.config.doc`; do not edit.",
           "Unknown keys are errors. Units are in the names (`_s` seconds, `_bytes` bytes).", "",
           "## Rules across fields", "",
           "Checked when a config is loaded (`motor up`, `controller`, `coordinator`, "
           "`node-manager`: exit 2 before anything starts); the message names the field(s), "
           "what was expected and what was received. A config without engines (controller "
           "or coordinator only) has no role to check.", "",
           "| fields | rule |", "|---|---|"]
    out += [f"| {fields} | {rule} |" for fields, rule in schema.CROSS_FIELD_RULES]
    out.append("")
    for name, model in SECTIONS:
        out += [f"## `{name}`", ""]
        if model.__doc__:
            out += [" ".join(model.__doc__.split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, f in model.model_fields.items():
            desc = (f.description or "").replace("|", "\\|")
            out.append(f"| `{key}` | {_type(f.annotation)} | {_default(f)} | {desc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")

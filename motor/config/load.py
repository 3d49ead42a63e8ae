"""Loading a cluster config from YAML / JSON with errors that name the field."""
from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import yaml
from pydantic import ValidationError

from motor.config.schema import ClusterConfig
from motor.errors import ConfigError

DEFAULT_CONFIG = "default.yaml"


def _loc(loc: tuple[Any, ...], data: Any) -> str:
    """Render a pydantic error location as ``nodes[0].engines[1].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _format(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        field = _loc(e["loc"], None)
        got = e.get("input")
        got_s = repr(got) if not isinstance(got, dict) else "a mapping"
        if len(got_s) > 80:
            got_s = got_s[:77] + "..."
        msg = e["msg"]
        if not e["loc"] and e["type"] == "value_error":
            # a check across fields: its message starts with the field it names
            lines.append("  " + msg.removeprefix("Value error, "))
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown field (expected one of the documented keys)"
        elif e["type"] == "missing":
            lines.append(f"  {field}: required field is missing")
            continue
        lines.append(f"  {field}: {msg}, got {got_s}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<mapping>") -> ClusterConfig:
    """Validate a mapping into a :class:`ClusterConfig`.

    Raises
    ------
    ConfigError
        naming each bad field (``nodes[0].engines[0].role``), what was expected and what was received.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level, "
                          f"got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Load a YAML (``.yaml``/``.yml``) or JSON file.

    Raises
    ------
    ConfigError
        if the file cannot be read, is not valid YAML/JSON, or does not match the schema.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") from None
    return parse_config(data, path)


EMBEDDED = {"union": DEFAULT_CONFIG, "pd": "pd.yaml"}


def load_default_config(mode: str = "union") -> ClusterConfig:
    """An embedded cluster of simulated engines on loopback (used by ``motor up`` and ``motor demo``).

    Parameters
    ----------
    mode : str
        ``union`` (two union engines, the default) or ``pd`` (two prefill + two decode engines,
        ``pd_prefill_first``).

    Raises
    ------
    ConfigError
        for another ``mode``.
    """
    name = EMBEDDED.get(mode)
    if name is None:
        raise ConfigError(f"embedded config mode is expected to be one of {sorted(EMBEDDED)}, "
                          f"got {mode!r}")
    text = resources.files("motor.config").joinpath(name).read_text(encoding="utf-8")
    return parse_config(yaml.safe_load(text), f"<embedded {name}>")

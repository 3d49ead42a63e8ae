"""Loading a cluster config from YAML / JSON with errors that name the field."""
from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from motor.config.schema import ClusterConfig
from motor.errors import ConfigError

DEFAULT_CONFIG = "default.yaml"


def _loc(loc: tuple[Any, ...], data: Any = None) -> str:
    """Render a pydantic error location as ``nodes[0].engines[1].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _unwrap(ann: Any) -> Any:
    """``X | None`` -> ``X``."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) in (types.UnionType, typing.Union) and len(args) == 1:
        return args[0]
    return ann


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema section at ``loc`` (``("nodes", 0, "engines", 1)`` -> EngineConfig)."""
    cur: Any = ClusterConfig
    for part in loc:
        cur = _unwrap(cur)
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            if not isinstance(part, str) or part not in cur.model_fields:
                return None
            cur = cur.model_fields[part].annotation
        elif typing.get_origin(cur) in (list, dict) and typing.get_args(cur):
            cur = typing.get_args(cur)[-1]   # an item of a list, a value of a dict
        else:
            return None
    cur = _unwrap(cur)
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _annotation(loc: tuple[Any, ...]) -> Any:
    """The declared type of the field at ``loc`` (None when not a model's field)."""
    model = _model_at(loc[:-1])
    f = model.model_fields.get(str(loc[-1])) if model is not None and loc else None
    return _unwrap(f.annotation) if f is not None else None


def _unknown(loc: tuple[Any, ...]) -> str:
    """``unknown field, expected one of the keys of coordinator (did you mean 'port'?)``."""
    parent = _loc(loc[:-1]) if loc[:-1] else "the top level"
    model = _model_at(loc[:-1])
    keys = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6) if keys else []
    if close:
        hint = f" (did you mean {close[0]!r}?)"
    elif 0 < len(keys) <= 12:
        hint = ": " + ", ".join(keys)
    else:
        hint = " (docs/configuration.md lists them)"
    return f"unknown field, expected one of the keys of {parent}{hint}, got {str(loc[-1])!r}"


def _got(value: Any) -> str:
    """The received value, short: a mapping is not dumped, a long repr is cut."""
    if isinstance(value, dict):
        return "a mapping"
    s = repr(value)
    return s if len(s) <= 80 else s[:77] + "..."


#: pydantic's bound errors -> (operator, the key of the bound in the error's ctx)
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
_SHOULD = re.compile(r"(String|List|Dictionary|Tuple|Set|Value) should (match|have|be) (.*)", re.S)
_VERB = {"match": "matching", "have": "with", "be": "that is"}


_AT_LEAST = re.compile(r"(List|Dictionary|Tuple|Set|Value) should have at least (\d+) "
                       r"items? after validation, not \d+")


def _expected(msg: str) -> str:
    """pydantic's ``Input should be X`` -> ``expected X``; ``String should match pattern P``
    -> ``expected a string matching pattern P`` (and the like for lists, dicts, ...)."""
    if msg.startswith("Input should be "):
        # "a valid integer, unable to parse string as an integer" -> "a valid integer"
        return "expected " + msg.removeprefix("Input should be ").split(", unable to")[0]
    m = _AT_LEAST.fullmatch(msg)
    if m:
        n = int(m.group(2))
        return f"expected a {m.group(1).lower()} of at least {n} item{'s' if n > 1 else ''}"
    m = _SHOULD.fullmatch(msg)
    if m:
        return f"expected a {m.group(1).lower()} {_VERB[m.group(2)]} {m.group(3)}"
    return msg


def _format(err: ValidationError, source: str) -> str:
    """One line per error: ``<field>: expected ..., got ...``.

    A check's own ``ValueError`` (one field's or one across fields, raised at any depth)
    already words what it expected and received: its text is used as it is, after the field
    path of the section that raised it (none for the checks of the whole cluster, whose text
    starts with the field it names).
    """
    lines = [f"invalid config {source}:"]
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        field = _loc(loc)
        kind = e["type"]
        msg = e["msg"]
        if kind in ("value_error", "assertion_error"):
            text = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            lines.append(f"  {field}: {text}" if loc else f"  {text}")
        elif kind == "extra_forbidden":
            lines.append(f"  {field}: {_unknown(loc)}")
        elif kind == "missing":
            lines.append(f"  {field}: expected a value (a required field), got it missing")
        elif kind in _BOUNDS:
            op, key = _BOUNDS[kind]
            got = e.get("input")
            noun = "an integer" if _annotation(loc) is int else "a number"
            lines.append(f"  {field}: expected {noun} {op} {(e.get('ctx') or {}).get(key)}, "
                         f"got {_got(got)}")
        else:
            msg = _expected(msg)
            lines.append(f"  {field}: {msg}, got {_got(e.get('input'))}")
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
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path}: expected valid JSON, got {e.msg} at line "
                          f"{e.lineno}, column {e.colno}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path}: expected valid YAML, got {what}{where}") from None
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

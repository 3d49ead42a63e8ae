"""The controller's OpenAPI document: served, equal to docs/openapi/controller.json, and
listing every route the controller's router serves."""
from __future__ import annotations

import json
from pathlib import Path

from motor.config.schema import ControllerConfig
from motor.controller.openapi import document
from motor.controller.server import ControllerServer

DOC = Path(__file__).resolve().parents[3] / "docs" / "openapi" / "controller.json"


def test_docs_copy_is_current() -> None:
    want = json.dumps(document(), indent=2, sort_keys=True) + "\n"
    assert DOC.read_text() == want, (
        "docs/openapi/controller.json is stale: regenerate with "
        "`.venv/bin/python -m motor.controller.openapi > docs/openapi/controller.json`")


def test_every_route_is_documented() -> None:
    router = ControllerServer(ControllerConfig())._route()
    paths = document()["paths"]
    served = {(m.decode().lower(), p) for p, by in router._routes.items() for m in by}
    served |= {(m.decode().lower(), p + "{id}/{action}") for p, by in router._prefixes
               for m in by}
    documented = {(m, p) for p, ops in paths.items() for m in ops}
    assert served == documented

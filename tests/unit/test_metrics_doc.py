"""docs/metrics.md lists exactly the metrics the components register: name, type, labels and
the component's section (the registries are read, as `/metrics` renders them)."""
from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry

from motor.config.schema import NodeConfig
from motor.controller import engine_metrics
from motor.controller.server import _Metrics
from motor.coordinator import metrics as coordinator_metrics
from motor.node_manager.agent import NodeAgent
from tests.support import metrics_doc


def _registered(reg: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{series name as scraped: (type, label names)} of every collector of ``reg``."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for collector in list(reg._collector_to_names):
        labels = tuple(collector._labelnames)
        for fam in collector.describe():
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            out[name] = (fam.type, labels)
    return out


def _live() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    agent = NodeAgent(NodeConfig(name="n0"), "http://127.0.0.1:1")
    return {"coordinator": _registered(coordinator_metrics.REGISTRY),
            "controller": _registered(_Metrics().registry),
            "engines": _registered(engine_metrics.scrape_registry()[0]),
            "node_manager": _registered(agent._metrics)}


def test_the_doc_lists_every_registered_metric_and_nothing_else():
    rows = metrics_doc.rows()
    live = _live()
    assert all(live.values())
    doc: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {c: {} for c in live}
    for r in rows:
        assert r.name not in doc[r.component], f"{r.name} listed twice"
        doc[r.component][r.name] = (r.type, r.labels)
    for component, registered in live.items():
        missing = sorted(set(registered) - set(doc[component]))
        extra = sorted(set(doc[component]) - set(registered))
        assert not missing, f"docs/metrics.md lacks {component} metrics: {missing}"
        assert not extra, f"docs/metrics.md lists {component} metrics it does not have: {extra}"
        for name, (typ, labels) in registered.items():
            assert doc[component][name] == (typ, labels), \
                f"{name}: docs/metrics.md says {doc[component][name]}, registered {(typ, labels)}"


def test_rows_are_well_formed():
    rows = metrics_doc.rows()
    assert len(rows) >= 50
    for r in rows:
        assert re.fullmatch(r"motor_[a-z0-9_]+", r.name), r.name
        assert r.type in metrics_doc.TYPES, r
        assert r.present in metrics_doc.PRESENCE, r
        assert r.unit and r.meaning, r
        assert (r.type == "counter") == r.name.endswith("_total"), r
        base = r.name.removesuffix("_total")
        for suffix in ("seconds", "bytes", "celsius", "watts", "percent"):
            if base.endswith("_" + suffix):
                assert r.unit == suffix, f"{r.name}: unit {r.unit!r}, name says {suffix}"
        if r.unit in ("seconds", "bytes", "celsius", "watts", "percent"):
            assert base.endswith("_" + r.unit), f"{r.name}: unit {r.unit} not in the name"


@pytest.mark.parametrize("component", ["coordinator", "controller", "engines", "node_manager"])
def test_every_component_has_always_present_metrics(component):
    assert any(r.component == component and r.present == "always"
               for r in metrics_doc.rows())

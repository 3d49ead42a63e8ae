"""deploy/grafana/motor.json and deploy/prometheus/motor-rules.yaml query only metrics that
docs/metrics.md lists, with labels those metrics have."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import yaml

from tests.support import metrics_doc

DASHBOARD = os.path.join(metrics_doc.ROOT, "deploy", "grafana", "motor.json")
RULES = os.path.join(metrics_doc.ROOT, "deploy", "prometheus", "motor-rules.yaml")

_HIST = ("_bucket", "_sum", "_count")
#: labels Prometheus adds to every scraped series (the metric's own `instance` label is
#: stored as `exported_instance`, docs/metrics.md)
_TARGET = {"job", "instance"}
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _queries(node: object) -> Iterator[str]:
    """Every ``expr`` of the dashboard's panels and every templating query."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            else:
                yield from _queries(v)
    elif isinstance(node, list):
        for v in node:
            yield from _queries(v)


def _documented() -> dict[str, set[str]]:
    """{series name: labels it has in Prometheus} for every documented series."""
    out: dict[str, set[str]] = {}
    for r in metrics_doc.rows():
        labels = {"exported_instance" if lab == "instance" else lab for lab in r.labels}
        labels |= _TARGET | ({"pid"} if r.component == "coordinator" else set())
        if r.type == "histogram":
            for suffix in _HIST:
                out[r.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        else:
            out[r.name] = labels
    return out


def _recorded() -> set[str]:
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def _selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names matched) of each selector of ``expr`` naming a motor
    metric or a recorded series."""
    for m in _SELECTOR.finditer(expr):
        name = m.group(1)
        if not (name.startswith("motor_") or ":" in name):
            continue
        matchers = _STRING.sub('""', m.group(2) or "")
        yield name, set(_MATCHER.findall(matchers))


def _check(exprs: list[str]) -> set[str]:
    documented, recorded = _documented(), _recorded()
    used: set[str] = set()
    for expr in exprs:
        found = list(_selectors(expr))
        assert found, f"no motor metric in {expr!r}"
        for name, labels in found:
            used.add(name)
            if ":" in name:
                assert name in recorded, f"{name} is not recorded by motor-rules.yaml"
                continue
            assert name in documented, f"{name} (in {expr!r}) is not in docs/metrics.md"
            assert labels <= documented[name], \
                f"{name} has no label(s) {sorted(labels - documented[name])} ({expr!r})"
    return used


def test_every_dashboard_query_uses_documented_metrics():
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    exprs = list(_queries(dash["panels"])) + list(_queries(dash["templating"]))
    assert len(exprs) >= 8
    used = _check(exprs)
    # the panels the dashboard promises
    for name in ("motor_coordinator_requests_total",
                 "motor_coordinator_time_to_first_token_seconds_bucket",
                 "motor_coordinator_inflight_requests", "motor_coordinator_breaker_state",
                 "motor_coordinator_kv_matched_tokens_total",
                 "motor_coordinator_kv_prompt_tokens_total"):
        assert name in used, name
    titles = [p["title"] for p in dash["panels"]]
    assert len(titles) == len(set(titles))
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]


def test_every_rule_uses_documented_metrics():
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    exprs = [r["expr"] for g in doc["groups"] for r in g["rules"]]
    # `up` is Prometheus's own series (MotorTargetDown)
    _check([e for e in exprs if not e.startswith("up{")])
    alerts = {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert {"MotorTargetDown", "MotorHighErrorRatio", "MotorTTFTBudgetBurnFast",
            "MotorBreakerOpen"} <= alerts


def test_the_checker_catches_an_unknown_metric_and_label():
    for bad in ('rate(motor_coordinator_request_total[1m])',
                'motor_coordinator_breaker_state{instance="x", state="open"}',
                'job:motor_not_recorded:rate1m'):
        try:
            _check([bad])
        except AssertionError:
            continue
        raise AssertionError(f"{bad!r} passed")

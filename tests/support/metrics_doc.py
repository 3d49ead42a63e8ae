"""docs/metrics.md's tables, parsed (the metrics-doc test, the dashboard test and the
Prometheus lane read them)."""
from __future__ import annotations

import os
import re
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "metrics.md")

#: the doc's section headings, one per component
SECTIONS = {"Coordinator": "coordinator", "Controller": "controller",
            "Engines (re-exported by the controller)": "engines",
            "Node manager": "node_manager"}
#: the values of the "present" column (explained in the doc)
PRESENCE = {"always", "kv_affinity", "kv_events", "pd", "edge", "event",
            "virtual_inference", "npu", "etcd"}
TYPES = {"counter", "gauge", "histogram"}


class Row(NamedTuple):
    component: str
    name: str
    type: str
    labels: tuple[str, ...]
    unit: str
    present: str
    meaning: str

    def series(self) -> str:
        """A series name that has samples whenever the metric exists (``_count`` of a
        histogram)."""
        return self.name + "_count" if self.type == "histogram" else self.name


def rows(path: str = DOC) -> list[Row]:
    """Every metric row of the doc's component sections, in order."""
    out: list[Row] = []
    component = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("## "):
                component = SECTIONS.get(line[3:].strip())
                continue
            if component is None or not line.startswith("| `"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 6:
                raise ValueError(f"{path}: expected 6 cells, got {len(cells)}: {line}")
            name, typ, labels, unit, present, meaning = cells
            labels_t = tuple(re.findall(r"`([^`]+)`", labels))
            out.append(Row(component, name.strip("`"), typ, labels_t, unit, present, meaning))
    return out


def names(path: str = DOC) -> set[str]:
    return {r.name for r in rows(path)}

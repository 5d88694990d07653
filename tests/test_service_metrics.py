"""The metric list, the table in docs/service.md and the Grafana dashboard stay in step (pure)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serving.metrics import SPECS

ROOT = Path(__file__).resolve().parents[1]


def test_every_metric_is_documented_and_on_the_dashboard() -> None:
    readme = (ROOT / "docs" / "service.md").read_text()
    dashboard = json.loads((ROOT / "cluster" / "grafana-compaction.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    used = set(re.findall(r"ray_(compaction_\w+?)(?:_total|_bucket|_sum|_count)?\b", exprs))
    names = {spec.name for spec in SPECS}
    for spec in SPECS:
        assert f"| `{spec.name}` | {spec.kind} | {', '.join(spec.tags)} |" in readme, spec.name
        if spec.kind == "histogram":
            assert spec.boundaries == tuple(sorted(spec.boundaries)) and spec.boundaries[0] > 0
    assert used == names, used ^ names

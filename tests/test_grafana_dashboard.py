"""The Grafana dashboard (docs/grafana/hpc-run.json) asks only for metrics hpc exports: a renamed metric fails here,
not on an operator's blank panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_every_panel_queries_a_metric_hpc_exports():
    dashboard = json.loads((ROOT / "docs/grafana/hpc-run.json").read_text())
    source = "\n".join(p.read_text() for p in (ROOT / "hpc").rglob("*.py"))
    names = {m for panel in dashboard["panels"] for t in panel["targets"]
             for m in re.findall(r"hpc_(?:frontend|worker)_[a-z_]+", t["expr"])}
    assert len(names) >= 10
    for name in sorted(names):
        key = re.sub(r"^hpc_(frontend|worker)_", "", name).removesuffix("_bucket")
        assert f'"{key}"' in source or f"_{key}\"" in source or f'"{key}' in source, name

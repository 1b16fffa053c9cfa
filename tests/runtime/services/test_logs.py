"""Operators' view of a run: JSON log lines (runtime.log_format), the recipe's log level for TensorRT-LLM too, and
the Prometheus file-SD targets a run directory holds once it is ready."""

from __future__ import annotations

import json
import logging
import os
from urllib.parse import urlsplit

import pytest

from hpc.checks.probe import get_text, metric_values
from hpc.runtime.services.logs import JsonLines, setup_logging
from tests.runtime.conftest import stack_fixture

json_stack = stack_fixture("tiny-agg", "--set", "runtime.log_format=json", "--set", "runtime.log_level=debug")


@pytest.mark.unit
def test_a_json_line_carries_run_component_and_the_request_it_names(monkeypatch):
    record = logging.LogRecord("hpc.x", logging.WARNING, "f.py", 1, "request %s failed: %s", 
                               ("chatcmpl-3f2a9c0d11aa", "boom"), None)
    line = json.loads(JsonLines("run-1", "frontend").format(record))
    assert line | {"ts": 0} == {"ts": 0, "level": "WARNING", "run": "run-1", "component": "frontend",
                                "logger": "hpc.x", "message": "request chatcmpl-3f2a9c0d11aa failed: boom",
                                "request_id": "chatcmpl-3f2a9c0d11aa"}
    monkeypatch.delenv("TLLM_LOG_LEVEL", raising=False)
    setup_logging("decode-0", "run-1", "warning", "text")
    assert os.environ["TLLM_LOG_LEVEL"] == "WARNING" and logging.getLogger().level == logging.WARNING
    setup_logging("decode-0", "run-1", "debug", "text")
    assert logging.getLogger("hpc").level == logging.DEBUG and logging.getLogger().level == logging.INFO
    setup_logging("x", level="info")  # leave the test process as it was


@pytest.mark.integration
def test_a_run_logs_json_lines_and_lists_its_scrape_targets(json_stack):
    lines = [line for line in (json_stack.run.logs / "frontend.log").read_text().splitlines() if line.startswith("{")]
    parsed = [json.loads(line) for line in lines]
    assert parsed and {p["component"] for p in parsed} == {"frontend"}
    assert {p["run"] for p in parsed} == {json_stack.run.path.name}
    worker = [json.loads(line) for line in (json_stack.run.logs / "agg-0.log").read_text().splitlines()
              if line.startswith("{")]
    assert worker and {p["component"] for p in worker} == {"agg-0"}
    targets = json.loads((json_stack.run.path / "prometheus-targets.json").read_text())
    by = {t["labels"]["component"]: t for t in targets}
    assert set(by) == {"frontend", "agg-0"} and {t["labels"]["run"] for t in targets} == {json_stack.run.path.name}
    for target in targets:  # each one answers Prometheus at /metrics
        text = get_text(f"http://{target['targets'][0]}/metrics")
        assert text.startswith("#") or "hpc_" in text
    assert urlsplit(json_stack.url).netloc == by["frontend"]["targets"][0]
    assert metric_values(get_text(f"http://{by['agg-0']['targets'][0]}/metrics"), "hpc_worker_engine_load_seconds") > 0

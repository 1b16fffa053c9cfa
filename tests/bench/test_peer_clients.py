"""The lightest of the field's clients in CI: MLPerf LoadGen's Server scenario, installed at its pinned release in a
virtualenv of its own, against the tiny stack (benchmarks/peer_clients.py runs all four: AIPerf, GuideLLM, lm-eval
and LoadGen). LoadGen judges the run itself: VALID needs its TTFT and TPOT bounds at p99, its query count and its
early-stopping test met; an HTTP error anywhere fails the harness."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.checks.probe import get_text
from tests.runtime.conftest import stack_fixture

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

agg = stack_fixture("tiny-agg")


def _release(tool: str) -> str:
    spec = importlib.util.spec_from_file_location("peer_clients", ROOT / "benchmarks" / "peer_clients.py")
    assert spec and spec.loader
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module.RELEASES[tool]


def _errors(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in get_text(url + "/metrics").splitlines()
               if line.startswith("hpc_frontend_errors_total"))


def test_mlperf_loadgen_server_scenario_is_valid_with_no_error(agg, tmp_path):
    venv = tmp_path / "loadgen"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", _release("loadgen")], check=True)
    before = _errors(agg.url)
    done = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "benchmarks" / "peers" / "mlperf_server.py"),
                           "--url", agg.url, "--model", agg.model, "--qps", "20", "--seconds", "25"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["result"] == "VALID", result
    assert result["http_errors"] == 0 and _errors(agg.url) == before
    assert result["samples_per_s"] >= 0.9 * 20 and result["tokens_per_s"] > 0

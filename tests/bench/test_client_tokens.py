"""benchmarks/client_tokens.py drives the real load generator against its paced fake server and counts every
token it streamed (else it exits with the count)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "client_tokens.py"


def test_the_client_parses_every_streamed_token_and_reports_its_cpu():
    out = subprocess.run([sys.executable, str(SCRIPT), "--concurrency", "2", "--output-tokens", "8", "--requests",
                          "12", "--rounds", "1", "--step-ms", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    per_token = float(re.search(r"client CPU µs a token\s+([\d.]+)", out.stdout).group(1))
    tokens_s = float(re.search(r"tokens/s ([\d,]+)", out.stdout).group(1).replace(",", ""))
    assert 0 < per_token < 10_000 and tokens_s > 0

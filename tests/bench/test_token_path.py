"""benchmarks/token_path.py runs the real output path: every token reaches the socket, in either mode."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import token_path  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("one", [token_path.one_round, token_path.one_link_round], ids=["worker", "link"])
def test_every_token_reaches_the_connection(one):
    scheduler_us, _, bytes_per_token = asyncio.run(one(4, 20))
    # a token's output is a few bytes at least (its id, its key or stream id, framing); the emit costs some time
    assert 0 < scheduler_us < 10_000 and 5 < bytes_per_token < 500

"""hpc bench's client processes run their event loop on uvloop where it is installed, on asyncio's own otherwise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from hpc.bench.clients import run_client

pytestmark = pytest.mark.unit


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_a_client_process_runs_on_uvloop_where_installed_else_on_asyncio(monkeypatch):
    pytest.importorskip("uvloop")
    assert run_client(_loop_module()).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: the import raises ImportError
    assert run_client(_loop_module()).startswith("asyncio")

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


def test_a_client_process_writes_its_samples_whole_to_the_named_file_not_to_its_stdout(tmp_path):
    """A level's samples are hundreds of kB; on the GPU machines a client's stdout arrived cut at 192 kB (exit
    status 0), so the samples go to a file, renamed into place once written: whole or absent."""
    import json
    import subprocess

    out = tmp_path / "client-0.json"
    script = ("import sys, hpc.bench.clients as c\n"
              "async def big(work):\n"
              "    return {'samples': [{'ok': True, 'itls': [0.001] * 64}] * 4000, 'start': 1.0}\n"
              "c._client = big\n"
              "sys.exit(c.main())\n")
    work = json.dumps({"out": str(out)}) + "\n"
    done = subprocess.run([sys.executable, "-c", script], input=work.encode(), stdout=subprocess.DEVNULL,
                          timeout=60)
    assert done.returncode == 0 and out.stat().st_size > 1_000_000
    result = json.loads(out.read_text())
    assert len(result["samples"]) == 4000 and result["samples"][-1]["itls"] == [0.001] * 64
    assert [p.name for p in tmp_path.iterdir()] == ["client-0.json"]  # no part file left behind

    failing = script.replace("return {", "raise RuntimeError('no server'); return {")
    gone = tmp_path / "client-1.json"
    done = subprocess.run([sys.executable, "-c", failing], input=json.dumps({"out": str(gone)}).encode() + b"\n",
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    assert done.returncode != 0 and not gone.exists() and not gone.with_suffix(".json.part").exists()

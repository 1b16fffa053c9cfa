"""Dynamo's --extra-engine-args / --override-engine-args on hpc's command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.cli.main import main

pytestmark = pytest.mark.unit
DYNAMO = Path(__file__).parent / "dynamo"
TRTLLM_TINY = ["-r", "tiny-disagg", "--set", "backend=trtllm"]


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def _manifest(runs: Path) -> dict:
    (run,) = list(runs.iterdir())
    return json.loads((run / "manifest.json").read_text())


def test_dynamo_engine_configs_work_unchanged_per_role(runs, capsys):
    code = main(["launch", "-c", "dev", *TRTLLM_TINY, "--dry-run",
                 "--extra-engine-args", f"prefill={DYNAMO / 'prefill.yaml'}",
                 "--extra-engine-args", f"decode={DYNAMO / 'decode.yaml'}",
                 "--override-engine-args", 'decode={"max_batch_size": 32}'])
    assert code == 0, capsys.readouterr().err
    m = _manifest(runs)
    decode, prefill = m["engine_args"]["decode"], m["engine_args"]["prefill"]
    assert decode["cuda_graph_config"]["batch_sizes"][-1] == 64 and decode["kv_cache_config"]["dtype"] == "fp8"
    assert decode["max_batch_size"] == 32  # the override JSON sits above the YAML
    assert prefill["max_batch_size"] == 4 and prefill["enable_chunked_prefill"] is True
    assert m["engine_config_files"]["decode"] == str(DYNAMO / "decode.yaml")
    assert decode["kv_cache_config"]["event_buffer_max_size"] > 0  # the forced layer still on top


def test_without_a_role_a_flag_applies_to_every_role(runs, capsys):
    code = main(["launch", "-c", "dev", *TRTLLM_TINY, "--dry-run",
                 "--override-engine-args", '{"cache_transceiver_config": {"backend": "NIXL"}, "max_num_tokens": 512}'])
    assert code == 0, capsys.readouterr().err
    m = _manifest(runs)
    for role in ("prefill", "decode"):
        assert m["engine_args"][role]["cache_transceiver_config"] == {"backend": "NIXL"}
        assert m["engine_args"][role]["max_num_tokens"] == 512


@pytest.mark.parametrize("flag, value, message", [
    ("--extra-engine-args", "draft=x.yaml", "has no role 'draft' (its roles: prefill, decode)"),
    ("--override-engine-args", "agg={}", "has no role 'agg'"),
    ("--override-engine-args", "decode={max_batch_size: 3}", "malformed JSON"),
    ("--override-engine-args", "[1, 2]", "must be a JSON object"),
    ("--extra-engine-args", "decode=/nonexistent/decode.yaml", "engine config not found"),
    ("--override-engine-args", 'decode={"kv_cache_config": {"dtyp": "fp8"}}', "did you mean 'dtype'"),
])
def test_bad_flags_are_one_line_exit_2_and_nothing_written(runs, capsys, flag, value, message):
    code = main(["launch", "-c", "dev", *TRTLLM_TINY, "--dry-run", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert err.startswith(f"error: {flag}") and f"{flag}: {flag}" not in err, err  # the flag first, once
    assert not runs.exists() or not any(runs.iterdir())


def test_a_typo_in_a_flag_yaml_names_that_file(tmp_path, capsys):
    bad = tmp_path / "decode.yaml"
    bad.write_text((DYNAMO / "decode.yaml").read_text().replace("free_gpu_memory_fraction", "free_gpu_mem_fraction"))
    code = main(["validate", "-c", "dev", *TRTLLM_TINY, "--extra-engine-args", f"decode={bad}"])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "free_gpu_memory_fraction" in err


def test_forced_values_that_replace_a_users_choice_are_warned_about(capsys):
    code = main(["validate", "-c", "dev", *TRTLLM_TINY, "--override-engine-args",
                 '{"kv_cache_config": {"event_buffer_max_size": 0}, "cache_transceiver_config": {"backend": "UCX"}}'])
    captured = capsys.readouterr()
    assert code == 0
    assert "warning: prefill: the runtime sets kv_cache_config.event_buffer_max_size: 0 -> 100000" in captured.err

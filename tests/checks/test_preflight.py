"""The preflight step's checks, on this machine's Python (the container tests run it in images)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc.resolve import resolve
from hpc.checks.preflight import check

pytestmark = pytest.mark.unit


def _manifest(tmp_path, cluster="dev-containers", recipe="tiny-disagg", *sets) -> dict:
    r = resolve(cluster, recipe, list(sets))
    import datetime as dt

    m = r.manifest(tmp_path / "run", "run", dt.datetime(2026, 1, 1))
    return json.loads(m.model_dump_json())


def test_ok_names_the_python_and_the_engine(tmp_path):
    m = _manifest(tmp_path)
    m["cluster"]["container"]["python_version"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    ok, line = check(m)
    assert ok and ": ok (Python 3." in line and "torch=" in line


def test_a_wrong_python_is_one_line_with_the_fix(tmp_path):
    m = _manifest(tmp_path)
    m["cluster"]["container"]["python_version"] = "3.99"
    ok, line = check(m)
    assert not ok and "runs Python 3." in line and 'set container.python_version: "3.' in line


def test_a_missing_engine_is_named(tmp_path):
    m = _manifest(tmp_path, "dev-containers", "tiny-agg", "backend=trtllm")
    m["cluster"]["container"]["python_version"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    ok, line = check(m)
    assert not ok and "tensorrt_llm is not installed in the image (a TensorRT-LLM worker needs it)" in line


def test_the_entry_point_exits_3_with_one_line(tmp_path):
    m = _manifest(tmp_path)
    m["cluster"]["container"]["python_version"] = "3.99"
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(m))
    done = subprocess.run([sys.executable, "-m", "hpc.checks.preflight", str(path)], capture_output=True, text=True)
    assert done.returncode == 3 and len(done.stdout.strip().splitlines()) == 1 and "hpc preflight on" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "hpc.checks.preflight", str(tmp_path / "nope.json")],
                             capture_output=True, text=True)
    assert missing.returncode == 3 and "cannot read the manifest" in missing.stdout


@pytest.mark.parametrize("node, records", [("n0", True), ("n1", False)])
def test_the_first_node_records_the_job_once_its_checks_passed(tmp_path, monkeypatch, capsys, node, records):
    """The first of the job's nodes (the script's NODES, exported as HPC_JOB_NODES: a heterogeneous job's
    preflight is a step per component, each with a task 0 of its own)."""
    from hpc import rundir
    from hpc.checks.preflight import main
    from hpc.render.sbatch import render_sbatch

    run = rundir.create(resolve("dev-containers", "tiny-disagg"), render_sbatch, root=tmp_path)
    m = json.loads(run.manifest_path.read_text())
    m["cluster"]["container"]["python_version"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    m["cluster"]["preflight"]["hardware"] = False  # no peer to meet here
    run.manifest_path.write_text(json.dumps(m))
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("HPC_JOB_NODES", "n0 n1")
    monkeypatch.setenv("SLURMD_NODENAME", node)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert main([str(run.manifest_path)]) == 0
    assert (run.job_id() == "77") is records and run.job_path.is_file() is records
    assert ("hpc: job 77 serves" in capsys.readouterr().out) is records


def test_the_models_directories_are_checked_where_the_job_sees_them(tmp_path):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    model = tmp_path / "models" / "My Model $(x)"

    def outcome(cluster="dev-containers", **fields):
        m = _manifest(tmp_path, cluster, "tiny-agg")
        if m["cluster"].get("container"):
            m["cluster"]["container"]["python_version"] = here
        m["recipe"]["model"].update({"generate": None, **fields})
        return check(m)

    ok, line = outcome(path=str(model))
    assert not ok and f"the model directory {model} (recipe model.path) is not there; mount it (the cluster " \
        "profile's container.mounts), or fix the path" in line
    ok, line = outcome("dev", path=str(model))  # a job without a container: the node's own filesystems
    assert not ok and "put it on a filesystem every node mounts, or fix the path" in line
    model.mkdir(parents=True)
    ok, line = outcome(path=str(model))
    assert not ok and "(recipe model.path) has no config.json" in line
    (model / "config.json").write_text("{}")
    ok, line = outcome(path=str(model))
    assert not ok and "(recipe model.path) has no tokenizer.json, the fast tokenizer's file that hpc's frontend " \
        "reads" in line
    (model / "tokenizer.json").write_text("{}")
    assert outcome(path=str(model))[0]
    ok, line = outcome(path=str(model), tokenizer=str(tmp_path / "tok"))
    assert not ok and "(recipe model.tokenizer) is not there" in line
    (tmp_path / "tok").mkdir()
    ok, line = outcome(path=str(model), tokenizer=str(tmp_path / "tok"))  # the tokenizer's own directory is read
    assert not ok and "(recipe model.tokenizer) has no tokenizer.json" in line
    assert outcome(path="deepseek-ai/DeepSeek-R1")[0]  # a hub id: the engine's to fetch
    ok, _ = outcome(path=str(tmp_path / "not built yet"), generate="tiny")  # the job builds it
    assert ok


def test_a_draft_models_directory_is_checked_too(tmp_path):
    m = _manifest(tmp_path, "eos", "llama4-eagle")
    m["recipe"]["model"]["path"] = "meta-llama/Llama-4-Maverick-17B-128E-Instruct"  # a hub id: not checked
    from hpc.checks.preflight import model_problem

    assert model_problem(m) == ("the model directory /models/Llama-4-Maverick-17B-128E-Eagle3 (the agg engine "
                                "config's speculative_config.speculative_model) is not there; mount it (the cluster "
                                "profile's container.mounts), or fix the path")
    draft = tmp_path / "eagle3"
    draft.mkdir()
    m["engine_args"]["agg"]["speculative_config"]["speculative_model"] = str(draft)
    assert model_problem(m) is None


def test_a_diffusion_pipelines_directory_is_known_by_its_model_index(tmp_path):
    from hpc.checks.preflight import model_problem

    m = _manifest(tmp_path, "eos", "wan2.1-t2v-eos")
    pipeline = tmp_path / "Wan2.1-T2V"
    pipeline.mkdir()
    m["recipe"]["model"]["path"] = str(pipeline)
    assert "has no model_index.json" in model_problem(m)
    (pipeline / "model_index.json").write_text("{}")  # diffusers' layout: no config.json at the top
    assert model_problem(m) is None


def test_trtllm_ranks_need_its_launcher_on_the_nodes(tmp_path, monkeypatch):
    from pathlib import Path

    fake = Path(__file__).resolve().parents[1] / "fakes" / "trtllm"
    monkeypatch.syspath_prepend(str(fake))  # tensorrt_llm importable: the launcher is what is checked
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    m = _manifest(tmp_path, "dev", "tiny-agg", "backend=trtllm", "roles.agg.tensor_parallel_size=2")
    m["recipe"]["model"]["path"] = m["recipe"]["model"]["tokenizer"] = None  # the model is not what is checked
    ok, line = check(m)
    assert not ok and line.endswith("trtllm-llmapi-launch is not on PATH (agg-0 has 2 ranks, which start under "
                                    "it); use an image with TensorRT-LLM's launcher")
    monkeypatch.setenv("PATH", f"{fake / 'bin'}:/usr/bin:/bin")
    assert "trtllm-llmapi-launch" not in check(m)[1]
    one = _manifest(tmp_path, "dev", "tiny-agg", "backend=trtllm")  # one rank: no launcher needed
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert "trtllm-llmapi-launch" not in check(one)[1]


FAKE_TRTLLM = __import__("pathlib").Path(__file__).resolve().parents[1] / "fakes" / "trtllm"


@pytest.mark.parametrize("found, passes", [("1.3.0rc11", True), ("1.1.0rc5", False)])
def test_an_image_with_another_trtllm_than_validated_ends_the_job_in_one_line(tmp_path, monkeypatch, found, passes):
    """dev-containers with the profile declaring 1.3.0rc11; the fake TensorRT-LLM in the image says `found`."""
    monkeypatch.syspath_prepend(str(FAKE_TRTLLM))
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", found)
    m = _manifest(tmp_path, "dev-containers", "tiny-agg", "backend=trtllm")
    m["trtllm_versions"] = ["1.3.0rc11"]
    m["cluster"]["trtllm_version"] = "1.3.0rc11"
    m["cluster"]["container"]["python_version"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    from hpc.checks.preflight import installed_trtllm_version, trtllm_version_problem

    assert installed_trtllm_version() == f"{found}+hpcfake"  # read from its version.py, the package not imported
    assert "tensorrt_llm" not in sys.modules
    problem = trtllm_version_problem(m)
    assert (problem is None) is passes
    if not passes:
        assert problem == (f"the image {m['cluster']['container']['image']} holds TensorRT-LLM 1.1.0rc5+hpcfake, "
                           "but the job was validated against 1.3.0rc11 (the profile's trtllm_version); set "
                           'trtllm_version: "1.1.0rc5" in the cluster profile and validate '
                           "again, or use an image with 1.3.0rc11")
        ok, line = check(m)
        assert not ok and "\n" not in line and line.endswith(problem)


def test_a_job_of_unknown_version_is_not_held_to_one(tmp_path):
    m = _manifest(tmp_path, "dev-containers", "tiny-agg", "backend=trtllm")
    from hpc.checks.preflight import trtllm_version_problem

    assert m["trtllm_versions"] == [] and trtllm_version_problem(m) is None  # a squashfs of no known tag

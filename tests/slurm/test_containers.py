"""pyxis + enroot on the dev cluster (hpc dev-cluster up --containers): the same job, every component in a
container of a stock image that has no hpc, and images that cannot run it failing in preflight with one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from hpc.cli.main import main
from hpc.rundir import list_runs
from hpc.checks.probe import post_json
from hpc.spec.catalog import project_root
from tests.slurm.conftest import DEV, frontend_port

pytestmark = pytest.mark.slurm
LAB = Path(DEV["slurm_conf"]).parents[1]
PROFILE = yaml.safe_load((project_root() / "clusters" / "dev-containers.yaml").read_text())
IMAGES = Path(PROFILE["container"]["image"]).parent


@pytest.fixture(autouse=True)
def containers_up():
    settings = LAB / "settings"
    if not settings.is_file() or "containers" not in settings.read_text():
        pytest.skip("the dev cluster runs without containers (hpc dev-cluster up --containers)")


def _profile(tmp_path: Path, image: str) -> str:
    data = {**PROFILE, "name": f"dev-{Path(image).stem}", "container": {**PROFILE["container"], "image": image}}
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_tiny_disagg_runs_every_component_in_a_container(slurm_env, model_cache, capsys):
    # each worker's engine in a process of its own, as on a GPU node (runtime.engine_process auto there)
    code = main(["launch", "--cluster", "dev-containers", "--recipe", "tiny-disagg",
                 "--set", f"model.path={model_cache / 'tiny'}", "--set", frontend_port(),
                 "--set", "runtime.engine_process=own"])
    out = capsys.readouterr()
    run = list_runs()[0]
    try:
        assert code == 0, out.out[-3000:] + out.err[-3000:]
        assert "smoke: PASSED" in out.out
        states = run.component_states()
        components = ["etcd", "nats", "frontend", "prefill-0", "decode-0"]
        for name in components:
            # The image's Debian interpreter, not this machine's: the component ran inside the container.
            assert states[name]["python"].startswith("/usr/bin/python3 3.11."), (name, states[name]["python"])
        assert {states[n]["node"] for n in ("prefill-0", "decode-0")} == {"node2", "node3"}  # spread recipe
        for worker in ("prefill-0", "decode-0"):
            assert states[worker].get("engine_pid") not in (None, states[worker]["pid"]), states[worker]
        preflight = (run.logs / "preflight.log").read_text()
        assert preflight.count(": ok (Python 3.11") == 3  # one per node, before anything started
        # its first task recorded the job hpc launch submitted, inside the container, before the services
        assert run.job() | {"started_at": 0} == {"job_id": run.run_info().job_id, "started_at": 0,
                                                 "submitted_by": "hpc launch"}
        assert preflight.count("hpc: job ") == 1
        # the image unpacked at most once per node, by the preflight (the first step; none when an earlier job
        # left the named container: pyxis's container_scope global), every later step reusing it
        job = run.run_info().job_id
        for node in ("node1", "node2", "node3"):
            lines = [ln for ln in (LAB / "log" / f"slurmd-{node}.log").read_text().splitlines() if f"[{job}." in ln]
            created = [ln for ln in lines if "pyxis: creating container filesystem" in ln]
            reused = [ln for ln in lines if "pyxis: reusing existing container filesystem" in ln]
            assert len(created) <= 1 and all(f"[{job}.0]" in ln for ln in created), (node, created)
            assert len(reused) >= 1 + (node == "node1") - len(created), node  # node1: etcd, nats, frontend too
        url = run.frontend_url()
        status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "Hello", "temperature": 0, "max_tokens": 5})
        assert status == 200 and body["usage"]["completion_tokens"] == 5
    finally:
        main(["cancel", run.path.name, "--grace", "2"])


@pytest.mark.parametrize("image, expected", [
    ("nohpc.sqsh", "pydantic is not installed in the image (the manifest needs it)"),
    ("nopython.sqsh", "python3"),
])
def test_a_broken_image_fails_in_preflight_with_one_line(slurm_env, model_cache, tmp_path, capsys, image, expected):
    t0 = time.monotonic()
    code = main(["launch", "--cluster", _profile(tmp_path, str(IMAGES / image)), "--recipe", "tiny-agg",
                 "--set", f"model.path={model_cache / 'tiny'}", "--set", frontend_port(), "--no-smoke"])
    err = capsys.readouterr().err
    run = list_runs()[0]
    if code == 0:
        main(["cancel", run.path.name, "--grace", "1"])
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert len(lines) == 1 and expected in lines[0], err
    assert time.monotonic() - t0 < 60
    assert not (run.state / "etcd.json").exists()  # nothing started after preflight


def test_a_tp2_worker_runs_its_mpi_ranks_in_containers_on_two_nodes(slurm_env, model_cache, tmp_path, capsys):
    """srun --mpi=pmix inside pyxis (enroot's PMI hook): two ranks on two nodes, one container each."""
    one_gpu_nodes = _profile(tmp_path, PROFILE["container"]["image"])
    data = yaml.safe_load(Path(one_gpu_nodes).read_text())
    Path(one_gpu_nodes).write_text(yaml.safe_dump({**data, "gpus_per_node": 1}))
    code = main(["launch", "--cluster", one_gpu_nodes, "--recipe", "tiny-agg", "--no-smoke",
                 "--set", f"model.path={model_cache / 'tiny'}", "--set", frontend_port(), "--set", "roles.agg.tensor_parallel_size=2"])
    out = capsys.readouterr()
    run = list_runs()[0]
    try:
        assert code == 0, out.out[-2000:] + out.err[-2000:]
        states = {p.stem: json.loads(p.read_text()) for p in run.state.glob("agg-0*.json")}
        assert {s["node"] for s in states.values()} == {"node2", "node3"}
        assert {s.get("world") for s in states.values() if "world" in s} == {2}
        assert all(s["python"].startswith("/usr/bin/python3 3.11.") for s in states.values())
        url = run.frontend_url()
        status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "Hi", "temperature": 0, "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        main(["cancel", run.path.name, "--grace", "2"])


def test_an_image_whose_trtllm_differs_from_the_profiles_ends_the_job_in_its_preflight(slurm_env, model_cache,
                                                                                         tmp_path, capsys,
                                                                                         monkeypatch):
    """The stock image with the fake TensorRT-LLM mounted into its site-packages, run as 1.1.0rc5; the profile
    declares 1.3.0rc11: one line from the preflight in the containers, before etcd, NATS or any worker."""
    fake = Path(__file__).resolve().parents[1] / "fakes" / "trtllm" / "tensorrt_llm"
    data = yaml.safe_load(Path(_profile(tmp_path, PROFILE["container"]["image"])).read_text())
    data["container"]["mounts"] = [f"{fake}:/usr/local/lib/python3.11/dist-packages/tensorrt_llm:ro"]
    data["trtllm_version"] = "1.3.0rc11"
    path = tmp_path / "dev-trtllm.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.1.0rc5")
    t0 = time.monotonic()
    code = main(["launch", "--cluster", str(path), "--recipe", "tiny-agg", "--set", "backend=trtllm",
                 "--set", f"model.path={model_cache / 'tiny'}", "--set", "model.generate=null",
                 "--set", frontend_port(), "--no-smoke"])
    err = capsys.readouterr().err
    run = list_runs()[0]
    if code == 0:
        main(["cancel", run.path.name, "--grace", "1"])
    assert code == 1, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert len(lines) == 1, err
    assert "holds TensorRT-LLM 1.1.0rc5+hpcfake, but the job was validated against 1.3.0rc11" in lines[0]
    assert not (run.state / "etcd.json").exists()  # nothing started after preflight
    assert time.monotonic() - t0 < 60

"""TensorRT-LLM's way of starting ranks, on the dev cluster: a TP2 worker under trtllm-llmapi-launch (the strict
fakes of tests/fakes/trtllm: its launcher, mgmn_leader_node, mgmn_worker_node and the LLM), through srun
--mpi=pmix; and the job's time limit, before which Slurm asks every process of every step to drain (SIGUSR1)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hpc.checks.probe import post_json
from hpc.cli.main import main
from hpc.waiting import wait_until
from tests.slurm.test_serving_on_slurm import _complete, _launch, _url

pytestmark = pytest.mark.slurm
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "trtllm"


def _fake_trtllm(monkeypatch, tmp_path: Path) -> Path:
    """The job's processes find the fakes first (the nodes share this filesystem and environment); returns the
    log they write their events to."""
    log = tmp_path / "fake-trtllm.jsonl"
    monkeypatch.setenv("PATH", f"{FAKE / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAKE), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    return log


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_trtllm_ranks_under_its_launcher_drain_before_the_time_limit_and_end_by_it(slurm_env, monkeypatch,
                                                                                   tmp_path, capsys):
    log = _fake_trtllm(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_TRTLLM_TRANSCEIVER_DIR", str(tmp_path / "transceiver"))
    run = _launch("-c", "dev", "-r", "tiny-agg", "--set", "backend=trtllm", "--set",
                  "roles.agg.tensor_parallel_size=2", "--set", "time_limit=00:10:00", "--set",
                  "drain_before_end_s=60")
    script = (run.path / "job.sbatch").read_text()
    assert "#SBATCH --signal=USR1@60" in script and "--mpi-launcher trtllm-llmapi-launch" in script
    url = _url(run)
    assert _complete(url, "hpc/tiny")
    events = _events(log)
    # the LLM bound to the ranks the job's srun started (no pool of its own), through rank 0's comm session
    assert [(e["mpi_session"], e["n_workers"]) for e in events if e["event"] == "init"] == [("comm", 2)]
    assert [(e["world"], e["ok"]) for e in events if e["event"] == "mgmn_leader_attach"] == [(2, True)]
    assert [e["rank"] for e in events if e["event"] == "mgmn_worker_start"] == ["1"]
    assert "serves:   until the time limit 00:10:00; its workers drain from 60 s before" in capsys.readouterr().out
    assert main(["status", run.job_id()]) == 0
    assert "time left 9:" in capsys.readouterr().out

    # Bring the end near: Slurm's warning is due at once (60 s before an end at most a minute away).
    job = run.job_id()
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"], check=True, env=os.environ)
    wait_until(lambda: run.component_states()["agg-0"]["phase"] == "drained", 90,
               "agg-0 drained by Slurm's warning signal")
    phases = run.component_states()["agg-0"]["phases"]
    assert phases["registered"] < phases["draining"] <= phases["drained"]

    def refused():  # once the frontend's etcd watch saw it leave (a request just before still gets served)
        status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "late", "max_tokens": 4})
        return body if status == 503 else None

    body = wait_until(refused, 10, "the frontend refusing new requests")
    # refused up front, not cut off at the end, and saying why
    assert body["error"]["message"] == ("no live agg worker (1 draining: the job is being cancelled or is near its "
                                        "time limit)")
    # the launcher's ranks outlived the signal (they end with the job): the nodes share this machine's PIDs
    ranks = [e["pid"] for e in _events(log) if e["event"] in ("mgmn_leader_start", "mgmn_worker_start")]
    assert len(ranks) == 2 and all(_running(pid) for pid in ranks)

    from hpc.cli.runtime_commands import _slurm_state

    wait_until(lambda: _slurm_state(run)["state"] == "TIMEOUT", 150, "the job's time limit")
    wait_until(lambda: len([e for e in _events(log) if e["event"].endswith("_exit")]) == 2, 30,
               "the launcher's ranks ending")
    exits = [e for e in _events(log) if e["event"] in ("mgmn_leader_exit", "mgmn_worker_exit")]
    assert sorted((e["event"], e["signal"]) for e in exits) == [("mgmn_leader_exit", "SIGTERM"),
                                                                ("mgmn_worker_exit", "SIGTERM")]
    capsys.readouterr()
    main(["status", job])
    out = capsys.readouterr().out
    assert "state: TIMEOUT" in out
    assert ("the job reached its time limit 00:10:00; its workers drained from 60 s before the end. For longer "
            "serving, set time_limit in the recipe") in out
    main(["cancel", job, "--remove"])


def test_a_failed_trtllm_worker_under_its_launcher_restarts_all_its_ranks(slurm_env, monkeypatch, tmp_path):
    """trtllm-llmapi-launch would swallow the failure (it stops its comm server once the worker ends and exits 0):
    the worker ends its rank's launcher, the step fails, and the job script restarts the ranks together."""
    from tests.slurm.test_serving_on_slurm import _cancel_and_check_clean

    log, fail = _fake_trtllm(monkeypatch, tmp_path), tmp_path / "fail-now"
    monkeypatch.setenv("FAKE_TRTLLM_FAIL_FILE", str(fail))
    run = _launch("-c", "dev", "-r", "tiny-agg", "--set", "backend=trtllm", "--set",
                  "roles.agg.tensor_parallel_size=2", "--set", "roles.agg.failure.on_failure=restart", "--set",
                  "roles.agg.failure.max_restarts=1")
    url = _url(run)
    fail.touch()  # the next request finds the executor dead, as when one of its MPI ranks dies
    status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "x", "max_tokens": 4})
    assert status >= 500 and not fail.exists(), body

    def serving_again():
        inits = [e for e in _events(log) if e["event"] == "init"]
        if len(inits) < 2 or run.component_states()["agg-0"].get("phase") not in ("registered", "first_token"):
            return None
        status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "y", "max_tokens": 4})
        return body if status == 200 else None

    assert wait_until(serving_again, 120, "agg-0 serving again after its restart")["choices"][0]["text"]
    job_out = (run.logs / "job.out").read_text()
    assert "hpc: agg-0 ended with status" in job_out and "restarting all its ranks (1 of 1)" in job_out
    worker_log = (run.logs / "agg-0.log").read_text()
    assert "the worker failed (exit 1): ending its rank's trtllm-llmapi-launch" in worker_log
    inits = [e for e in _events(log) if e["event"] == "init"]
    assert [(e["mpi_session"], e["n_workers"]) for e in inits] == [("comm", 2), ("comm", 2)]  # a whole new unit
    assert len({e["pid"] for e in _events(log) if e["event"] == "mgmn_worker_start"}) == 2
    _cancel_and_check_clean(run)


@pytest.mark.parametrize("found, ends", [("1.1.0rc5", True), ("1.3.0rc11", False)])
def test_an_image_with_another_trtllm_than_the_profile_declares_ends_the_job_in_its_preflight(
        slurm_env, monkeypatch, tmp_path, capsys, found, ends):
    """The profile says 1.3.0rc11; the nodes' TensorRT-LLM (the fake, run as `found`) says otherwise: one line,
    before etcd, NATS or any worker starts. The same TensorRT-LLM serves."""
    from tests.slurm.conftest import dev_cluster_file, frontend_port

    _fake_trtllm(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", found)
    monkeypatch.setenv("FAKE_TRTLLM_TRANSCEIVER_DIR", str(tmp_path / "transceiver"))
    profile = dev_cluster_file(tmp_path, trtllm_version="1.3.0rc11")
    args = ["launch", "-c", profile, "-r", "tiny-agg", "--set", "backend=trtllm", "--set", frontend_port(),
            "--no-smoke"]
    code = main(args)
    err = capsys.readouterr().err
    from hpc.rundir import list_runs

    (run,) = list_runs()
    if not ends:
        try:
            assert code == 0, err[-2000:]
        finally:
            main(["cancel", run.path.name, "--grace", "2"])
        return
    if code == 0:  # it served after all: stop it before failing
        main(["cancel", run.path.name, "--grace", "1"])
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("preflight failed: ")]
    assert len(lines) == 1, err
    assert "holds TensorRT-LLM 1.1.0rc5+hpcfake, but the job was validated against 1.3.0rc11 (the profile's " \
           "trtllm_version); set trtllm_version: \"1.1.0rc5\"" in lines[0]
    assert sorted(p.name for p in run.logs.iterdir()) == ["job.out", "preflight.log"]  # no server started
    assert not (run.state / "etcd.json").exists()

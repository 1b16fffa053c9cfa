"""Where run directories go: HPC_RUNS_DIR, else the cluster profile's runs_dir, else ./runs; and where status,
logs and cancel find them again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from hpc.cli.main import main
from hpc.rundir import Endpoint, RunDir, RunLayout, write_json

pytestmark = pytest.mark.unit

EOS = Path(__file__).resolve().parents[1] / "clusters" / "eos.yaml"


def _site(tmp_path: Path, runs_dir: str) -> Path:
    """A working directory whose clusters/site.yaml is eos's profile with a runs_dir of its own."""
    work = tmp_path / "work"
    (work / "clusters").mkdir(parents=True)
    profile = yaml.safe_load(EOS.read_text()) | {"name": "site", "runs_dir": runs_dir}
    (work / "clusters" / "site.yaml").write_text(yaml.safe_dump(profile))
    return work


def test_a_profiles_runs_dir_holds_its_runs_and_status_finds_them_there(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HPC_RUNS_DIR", raising=False)
    (tmp_path / "lustre").mkdir()
    shared = tmp_path / "lustre" / "runs"  # made by the launch: its parent exists
    monkeypatch.chdir(_site(tmp_path, str(shared)))
    assert main(["launch", "-c", "site", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    (run,) = shared.iterdir()
    assert not Path("runs").exists()  # nothing under the working directory
    script = (run / "job.sbatch").read_text()
    assert f"--output={run}/logs/job.out" in script and f"{run}:{run}" in script  # the job's log and mount
    capsys.readouterr()
    assert main(["status"]) == 0 and run.name in capsys.readouterr().out
    assert main(["logs", run.name]) == 0  # found by name, not by path

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "mine"))  # the environment wins over the profile
    assert main(["launch", "-c", "site", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    assert len(list((tmp_path / "mine").iterdir())) == 1 and len(list(shared.iterdir())) == 1


def test_runs_of_a_profile_given_as_a_path_are_found_by_status_logs_and_cancel_anywhere(tmp_path, monkeypatch,
                                                                                       capsys):
    """A profile outside clusters/ (-c path/to/mine.yaml): its runs_dir is in no place status would look, so the
    launch remembers it (XDG state), once however many runs go there."""
    monkeypatch.delenv("HPC_RUNS_DIR", raising=False)
    profile = _site(tmp_path, str(tmp_path / "lustre"))
    (tmp_path / "lustre").mkdir()
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["launch", "-c", str(profile / "clusters" / "site.yaml"), "-r", "tiny-agg", "--dry-run"]) == 0
    first, second = sorted((tmp_path / "lustre").iterdir())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["status", first.name]) == 0 and f"run {first.name}" in capsys.readouterr().out
    assert main(["status"]) == 0 and {first.name, second.name} <= set(capsys.readouterr().out.split())
    assert (Path(os.environ["XDG_STATE_HOME"]) / "hpc" / "runs-roots").read_text() == f"{tmp_path / 'lustre'}\n"

    shutil.rmtree(tmp_path / "lustre")  # a remembered directory that is gone is passed over
    assert main(["status", first.name]) == 2 and "no run" in capsys.readouterr().err


def test_a_launch_whose_state_cannot_be_written_still_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.parametrize("runs_dir, says", [
    ("relative/runs", "is relative; give an absolute path"),
    ("/lustre/a:b/runs", "contains ',' or ':'"),
])
def test_a_runs_dir_nodes_cannot_share_is_one_line_naming_the_profile(tmp_path, monkeypatch, capsys, runs_dir,
                                                                       says):
    monkeypatch.delenv("HPC_RUNS_DIR", raising=False)
    monkeypatch.chdir(_site(tmp_path, runs_dir))
    assert main(["validate", "-c", "site", "-r", "deepseek-r1-disagg"]) == 2
    err = capsys.readouterr().err
    assert "clusters/site.yaml: runs_dir:" in err and says in err and "Traceback" not in err


def test_a_runs_dir_on_a_filesystem_not_mounted_here_is_an_error_and_nothing_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HPC_RUNS_DIR", raising=False)
    missing = tmp_path / "lustre" / "fsw" / "runs"  # /lustre/fsw not mounted on this login node
    monkeypatch.chdir(_site(tmp_path, str(missing)))
    assert main(["launch", "-c", "site", "-r", "deepseek-r1-disagg", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "clusters/site.yaml: runs_dir: runs directory" in err and "does not exist on this machine" in err
    assert not (tmp_path / "lustre").exists() and not Path("runs").exists()


def test_cancels_drain_tier_waits_only_for_workers_that_serve(tmp_path, monkeypatch):
    """Registered or draining workers may hold requests; one still loading or restarting has nothing to finish,
    so hpc cancel does not spend its grace period on it."""
    from hpc.rundir import RunDir, write_json

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    assert main(["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    (path,) = tmp_path.iterdir()
    run = RunDir(path)
    workers = [w.name for w in run.manifest().plan.workers]
    assert len(workers) >= 2
    run.state.mkdir(parents=True, exist_ok=True)

    def phases(*values: str) -> list[str]:
        for name, phase in zip(workers, values):
            write_json(run.state / f"{name}.json", {"component": name, "phase": phase})
        return run.workers_serving()

    assert phases("weights_loaded", "restarting") == []
    assert phases("drained", "registered") == [workers[1]]
    assert phases("draining", "stopped") == [workers[0]]
    assert phases("first_token", "registered") == workers[:2]
    assert phases("drained", "failed") == []
    write_json(run.state / "frontend.json", {"component": "frontend", "phase": "ready"})  # not a worker
    assert run.workers_serving() == []


def test_the_remembered_runs_directories_drop_the_gone_and_keep_the_newest(tmp_path):
    from hpc import rundir

    roots = [tmp_path / f"runs-{i}" for i in range(rundir.MAX_KNOWN_ROOTS + 8)]
    for root in roots:
        root.mkdir()
        rundir.remember_root(root)
    assert rundir.known_roots() == roots[-rundir.MAX_KNOWN_ROOTS:]  # bounded: the newest
    roots[-2].rmdir()
    rundir.remember_root(roots[0])  # remembered again: last now, the gone one dropped
    kept = rundir.known_roots()
    assert kept[-1] == roots[0] and roots[-2] not in kept and len(kept) <= rundir.MAX_KNOWN_ROOTS


@pytest.mark.parametrize("ref, says", [("None", "no run 'None'"), ("x" * 10_000, "... (10000 characters)"),
                                       ("42\nrm -rf /", "'42\\nrm -rf /' is not a run id"),
                                       ("\x1b[31mred", "\\x1b[31mred"), ("", "is not a run id"),
                                       ("../../etc", "is not a run id")])
def test_a_malformed_or_unknown_run_id_is_one_line_and_never_matches_a_run_without_a_job(tmp_path, monkeypatch,
                                                                                        ref, says):
    from hpc.errors import UserError
    from hpc.rundir import RunDir, find_run

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    local = tmp_path / "tiny-disagg-20261202-000000"  # a local run: no Slurm job id ("job_id": null)
    local.mkdir()
    (local / "manifest.json").write_text("{}")
    RunDir(local).update_run_info(scheduler="local", job_id=None)
    with pytest.raises(UserError) as refused:
        find_run(ref)
    line = refused.value.render()
    assert says in line and "\n" not in line and len(line) < 400
    assert find_run(local.name).path == local


@pytest.mark.parametrize("written, read", [
    ({"host": "n1", "port": 8000, "url": "http://n1:8000"}, Endpoint("n1", 8000, "http://n1:8000")),
    ({"host": "n1", "port": 2379, "health": "http://n1:2379/health"},
     Endpoint("n1", 2379, None, "http://n1:2379/health")),
    ({"url": "http://n1:8000"}, None),  # no host and port: not one a service wrote
    ({"host": "n1", "port": "8000"}, None),
    ({"host": "n1", "port": True}, None),
    ([1, 2], None),
    (None, None),  # not written yet, or not JSON
])
def test_an_endpoint_is_read_into_one_record_or_none(tmp_path, written, read):
    layout = RunLayout.of(tmp_path)
    if written is not None:
        write_json(layout.endpoint("frontend"), written)
    assert layout.read_endpoint("frontend") == read
    assert RunDir(tmp_path).frontend_url() == (read.url if read else None)
    if read is not None:
        assert Endpoint.parse(read.to_json()) == read

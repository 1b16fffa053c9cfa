"""hpc launch --chain: its checks before anything is written, the chain's directory, and where status, cancel
and the endpoint find each link."""

from __future__ import annotations

import json
import subprocess

import pytest

from hpc.cli.main import main
from hpc.launch.chain import chain_lines
from hpc.launch.endpoint import Follow
from hpc.rundir import ChainDir, find_run, list_runs

pytestmark = pytest.mark.unit

DEV = ["launch", "-c", "dev", "-r", "tiny-agg", "--dry-run"]


@pytest.fixture
def runs(monkeypatch, tmp_path):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


@pytest.mark.parametrize("argv, says", [
    (["launch", "-c", "local", "-r", "tiny-agg", "--chain", "3"], "--chain: a chain of jobs needs Slurm"),
    ([*DEV, "--chain", "3", "--handover", "1200"], "--handover: the handover (1200 s) must be shorter than the time limit (1200 s)"),
    ([*DEV, "--chain", "3", "--handover", "100"], "drain_before_end_s: the handover (100 s) must be longer than drain_before_end_s (120 s)"),
    ([*DEV, "--chain", "1"], "argument --chain: must be from 2 to 1,000"),
    ([*DEV, "--handover", "60"], "--handover: --handover is the handover of a chain of jobs"),
    ([*DEV, "--chain", "2", "--set", "placement=hetjob"], "placement: a chain of heterogeneous jobs is not supported"),
])
def test_a_bad_chain_is_one_line_exit_2_and_nothing_written(runs, capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not runs.exists() or not any(runs.iterdir())


def test_a_chain_is_a_directory_of_links_each_script_queueing_the_next(runs, capsys):
    assert main([*DEV, "--chain", "3", "--handover", "300"]) == 0
    (chain_path,) = runs.iterdir()
    chain = ChainDir(chain_path)
    assert chain.record["links"] == 3 and chain.record["handover_s"] == 300
    links = chain.links()
    assert [link.name for link in links] == [f"{chain_path.name}.{k}" for k in (1, 2, 3)]
    for k, link in enumerate(links, start=1):
        m = link.manifest()
        assert (m.chain.index, m.chain.links, m.run_dir) == (k, 3, str(link.path))
        script = link.script_path.read_text()
        assert f'"link": {k},' not in script  # the link number is printf's argument, quoted
        assert "serving.json" in script
        assert (f"links/{k + 1}/job.sbatch" in script) == (k < 3)  # the last link queues nothing
        subprocess.run(["shellcheck", "-x", str(link.script_path)], check=True)
    # later links run their own smoke checks: nobody follows them from the login node
    assert links[0].run_info().smoke_via is None and links[1].run_info().smoke_via == "job"
    assert "sbatch " + str(links[0].script_path) in capsys.readouterr().out


def test_status_cancel_and_the_endpoint_find_the_link_that_serves(runs, capsys):
    assert main([*DEV, "--chain", "3", "--handover", "300"]) == 0
    (chain_path,) = runs.iterdir()
    chain = ChainDir(chain_path)
    one, two, three = chain.links()
    assert find_run(chain_path.name).path == one.path  # nothing queued yet: the first link
    assert {run.path for run in list_runs()} == {one.path, two.path, three.path}

    (one.path / "job.json").write_text(json.dumps({"job_id": "41", "started_at": 1.0}))
    (two.path / "queued.json").write_text(json.dumps({"job_id": "42", "from_job": "41", "at": 2.0}))
    assert find_run(chain_path.name).path == two.path  # queued, the newest
    assert find_run("42").path == two.path and two.job_id() == "42" and two.submitted()
    (chain_path / "serving.json").write_text(json.dumps({"link": 1, "job_id": "41", "at": 3.0}))
    assert find_run(chain_path.name).path == one.path
    assert find_run(f"{chain_path.name}.2").path == two.path

    assert Follow(chain).url() is None  # link 1 serves, but its frontend has not said where it listens
    (one.path / "endpoints").mkdir()
    (one.path / "endpoints" / "frontend.json").write_text(json.dumps({"host": "10.0.0.1", "port": 8000,
                                                                 "url": "http://10.0.0.1:8000"}))
    assert Follow(chain).url() == "http://10.0.0.1:8000"

    lines = chain_lines(chain, {"41": "RUNNING", "42": "PENDING"}.get)
    assert lines[0] == "chain: chain of 3 jobs, handover 300 s before each end"
    assert lines[1:] == ["  link 1 job 41 RUNNING (serving)", "  link 2 job 42 PENDING", "  link 3 not queued yet"]

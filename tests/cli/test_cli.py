import json

import socket

import pytest

from hpc.cli.main import main

pytestmark = pytest.mark.unit


def test_validate_ok(capsys):
    assert main(["validate", "-c", "dev", "-r", "tiny-disagg"]) == 0
    assert "ok: tiny-disagg on dev: 3 node(s)" in capsys.readouterr().out


def test_bad_input_exits_2_with_one_message_and_no_traceback(capsys):
    assert main(["validate", "-c", "dev", "-r", "tiny-disagg", "--set", "roles.decode.count=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "roles.decode.count" in err and "Traceback" not in err
    assert main(["plan", "-c", "nowhere", "-r", "tiny-agg"]) == 2
    assert main(["plan", "--bogus-flag"]) == 2


def test_plan_json(capsys):
    assert main(["plan", "-c", "eos", "-r", "deepseek-r1-disagg", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["job_nodes"] == 4 and len(data["workers"]) == 3


def test_dry_run_writes_run_dir_and_submits_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    assert main(["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    (run,) = list(tmp_path.iterdir())
    assert (run / "manifest.json").is_file() and (run / "job.sbatch").is_file() and (run / "logs").is_dir()
    assert (run / "engine_configs" / "decode.yaml").is_file()
    assert json.loads((run / "run.json").read_text())["submitted"] is False
    assert "dry run: nothing submitted" in capsys.readouterr().out


def test_bad_input_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    assert main(["launch", "-c", "dev", "-r", "deepseek-r1-disagg", "--dry-run"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_listing(capsys):
    assert main(["recipes"]) == 0 and "tiny-epd" in capsys.readouterr().out
    assert main(["clusters"]) == 0 and "eos" in capsys.readouterr().out


def test_the_run_directory_and_script_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.stat().st_mode & 0o777 == 0o700 and (run / "job.sbatch").stat().st_mode & 0o777 == 0o700
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.endswith(".partial")]


def test_a_missing_secret_stops_the_launch_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import yaml

    from hpc.spec.catalog import project_root

    data = yaml.safe_load((project_root() / "clusters" / "local.yaml").read_text())
    data["env"] = {"HF_TOKEN": {"from_env": "HPC_TEST_UNSET_TOKEN"}}
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("HPC_TEST_UNSET_TOKEN", raising=False)
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    with socket.socket() as s:  # a port nothing holds: what stops the launch must be the secret alone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["launch", "-c", str(cluster), "-r", "mock-agg", "--set", f"frontend.port={port}"]) == 2
    err = capsys.readouterr().err
    assert f"{cluster}: env.HF_TOKEN: secret HF_TOKEN: the environment variable HPC_TEST_UNSET_TOKEN is not set" in err
    assert not (tmp_path / "runs").exists()


def test_the_launcher_imports_no_serving_stack_and_builds_no_model(tmp_path):
    """The login node needs none of torch/transformers: a generated model is built by the job, not by launch."""
    import subprocess
    import sys

    model = tmp_path / "model"
    probe = (
        "import sys\n"
        "from hpc.cli.main import main\n"
        "import hpc.launch.slurm, hpc.launch.local, hpc.launch.follow\n"
        f"code = main(['launch', '-c', 'dev', '-r', 'tiny-disagg', '--dry-run', '--set', 'model.path={model}'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'tokenizers', 'safetensors') if m in sys.modules)\n"
        "print('heavy', heavy, 'code', code)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "HPC_RUNS_DIR": str(tmp_path / "runs")})
    assert "heavy [] code 0" in out.stdout, out.stdout + out.stderr
    assert not model.exists()


def test_an_8b_recipe_on_a_machine_without_a_gpu_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine shows no GPU, whatever it has
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    with socket.socket() as s:  # a port nothing holds: what stops the launch must be the GPU alone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["launch", "-r", "llama8b-agg", "--set", f"frontend.port={port}"]) == 2
    err = capsys.readouterr().err
    assert "llama8b-agg.yaml: model.generate: llama-8b-shape needs a GPU" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    # a dry run only writes the script, for a GPU cluster: no GPU is asked of this machine
    assert main(["launch", "-r", "llama8b-agg", "-c", "eos", "--dry-run"]) == 0


@pytest.mark.parametrize("layout, says", [
    (None, "is not there; build or copy it there, or fix the path"),
    ({}, "(recipe model.path) has no config.json"),
    ({"config.json": "{}"}, "(recipe model.path) has no tokenizer.json"),
])
def test_a_local_launch_of_a_model_directory_that_lacks_its_files_stops_before_anything_starts(
        tmp_path, monkeypatch, capsys, layout, says):
    """This machine is the job's node: the preflight's model check runs at launch, one line, exit 2, no run
    directory (before: etcd and NATS started, then the frontend's tokenizer traceback)."""
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    model = tmp_path / "my model $(x)"
    if layout is not None:
        model.mkdir()
        for name, text in layout.items():
            (model / name).write_text(text)
    assert main(["launch", "-r", "tiny-agg", "--set", "model.generate=null", "--set", f"model.path={model}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tiny-agg.yaml: " in err and f"{model} " in err and says in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_the_gpu_check_asks_only_what_needs_one(monkeypatch):
    from hpc.launch.local import check_local_gpu
    from hpc.errors import UserError
    from hpc.resolve import resolve

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserError, match="llama-8b-shape needs a GPU"):
        check_local_gpu(resolve("local", "llama8b-disagg"))
    check_local_gpu(resolve("local", "tiny-disagg"))  # the tiny model runs on the CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    check_local_gpu(resolve("local", "llama8b-disagg"))


def test_status_gives_readiness_as_the_steps_in_the_order_they_came():
    from hpc.cli.runtime_commands import _readiness

    seconds = {"decode-0 registered": 8.595, "etcd healthy": 2.002, "frontend up": 8.375, "ready": 8.616}
    assert _readiness({"phase": "ready", "seconds": seconds, "ready": True}) == \
        "ready in 8.6 s (etcd healthy 2.0 s, frontend up 8.4 s, decode-0 registered 8.6 s)"
    # still waiting, or given up: the last step reached
    waiting = {"phase": "frontend up", "seconds": {"etcd healthy": 2.0, "frontend up": 8.4}, "ready": False}
    assert _readiness(waiting) == "not ready (last step reached: frontend up) (etcd healthy 2.0 s, frontend up 8.4 s)"
    assert _readiness({}) == "not ready (last step reached: none)"


def test_a_tables_rows_are_cut_to_a_terminals_width_and_whole_elsewhere():
    from hpc.show import table

    rows = [["tiny-agg", "short"], ["tiny-pools", "a description far longer than the terminal is wide " * 3]]
    whole = table(["RECIPE", "DESCRIPTION"], rows)
    assert max(len(line) for line in whole.splitlines()) > 100  # a pipe or a file gets every cell whole
    cut = table(["RECIPE", "DESCRIPTION"], rows, width=60).splitlines()
    assert max(len(line) for line in cut) == 60 and cut[2].endswith("…") and cut[1].endswith("short")


def test_a_local_runs_status_names_this_host_and_stops_its_clock_when_cancelled(tmp_path):
    import subprocess

    from hpc.cli.runtime_commands import _slurm_state
    from hpc.rundir import RunDir, write_json

    finished = subprocess.Popen(["true"])
    finished.wait()  # a pid that no longer runs
    run = RunDir(tmp_path)
    write_json(tmp_path / "local.json", {"pids": {"frontend": [finished.pid]}})
    run.update_run_info(submitted=True, scheduler="local", submitted_at=1000.0, cancelled_at=1042.4)
    assert _slurm_state(run) == {"state": "STOPPED", "processes": "0/1", "elapsed": "42s",
                                 "nodes": socket.gethostname()}
    run.update_run_info(cancelled_at=None)  # stopped some other way: how long it ran is not known
    assert _slurm_state(run)["elapsed"] == "-"


def test_status_shows_what_a_component_that_failed_for_good_said_last(tmp_path, monkeypatch, capsys):
    from hpc import rundir
    from hpc.render.sbatch import render_sbatch
    from hpc.resolve import resolve

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    run = rundir.create(resolve("dev", "tiny-disagg"), render_sbatch, root=tmp_path)
    run.update_run_info(submitted=True, scheduler="local", submitted_at=1.0, cancelled_at=2.0)
    rundir.write_json(run.state / "decode-0.json", {"phase": "failed"})
    rundir.write_json(run.state / "prefill-0.json", {"phase": "failed", "restarting": True})  # coming back
    (run.logs / "decode-0.log").write_text("".join(f"line {i}\n" for i in range(20)) + "CUDA out of memory\n")
    assert main(["status", str(run.path)]) == 0
    out = capsys.readouterr().out
    assert f"decode-0 failed; the last lines of its log (hpc logs {run.path.name} --component decode-0):" in out
    assert "    CUDA out of memory" in out and "    line 13" in out and "line 12" not in out
    assert "prefill-0 failed" not in out


def test_logs_knows_the_runs_components_and_follows_a_log_its_step_rewrites(tmp_path, monkeypatch, capsys):
    import threading
    import time

    from hpc import rundir
    from hpc.cli.runtime_commands import _follow
    from hpc.render.sbatch import render_sbatch
    from hpc.resolve import resolve

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    run = rundir.create(resolve("dev", "tiny-disagg"), render_sbatch, root=tmp_path)
    assert main(["logs", str(run.path), "--component", "decode-7"]) == 2
    assert "no component 'decode-7'" in capsys.readouterr().err  # a typo is not waited for, even with -f
    assert main(["logs", str(run.path), "--component", "decode"]) == 2
    assert "no log yet for 'decode-0'" in capsys.readouterr().err

    log = run.logs / "decode-0.log"
    log.write_text("attempt 0: loading\n")
    threading.Thread(target=_follow, args=(log,), daemon=True).start()
    time.sleep(0.3)
    with log.open("a") as f:
        f.write("attempt 0: failed\n")
    time.sleep(0.5)
    log.write_text("attempt 1\n")  # the restarted step's srun truncates its log
    deadline = time.monotonic() + 5
    seen = ""
    while "attempt 1" not in seen and time.monotonic() < deadline:
        time.sleep(0.2)
        seen += capsys.readouterr().out
    assert seen.splitlines() == ["attempt 0: failed", "attempt 1"]


def test_the_run_list_asks_slurm_once_for_all_of_a_clusters_jobs(tmp_path, monkeypatch, capsys):
    import datetime as dt

    from hpc import rundir
    from hpc.launch import slurm
    from hpc.render.sbatch import render_sbatch
    from hpc.resolve import resolve
    from tests.slurm_unit.test_slurm_client import SACCT_FAILED, SQUEUE_PENDING, SQUEUE_RUNNING, FakeSlurm

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path))
    fake = FakeSlurm()
    fake.queue.update({"6": SQUEUE_RUNNING, "7": SQUEUE_PENDING})
    fake.acct["9"] = SACCT_FAILED
    confs = []
    monkeypatch.setattr(slurm, "runner_for_conf", lambda conf: confs.append(conf) or fake)
    for minute, job in enumerate(["6", "7", "9", None]):
        run = rundir.create(resolve("dev", "tiny-agg"), render_sbatch, root=tmp_path,
                            now=dt.datetime(2026, 1, 1, 0, minute))
        if job:
            run.update_run_info(submitted=True, scheduler="slurm", job_id=job)
    assert main(["status"]) == 0
    assert [call[0] for call in fake.calls] == ["squeue", "sacct"] and confs == ["/tmp/hpc-devcluster/etc/slurm.conf"]
    assert fake.calls[0][fake.calls[0].index("-j") + 1].split(",") == ["9", "7", "6"]  # newest run first
    states = {line.split()[2]: line.split()[3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert states == {"6": "RUNNING", "7": "PENDING", "9": "FAILED", "-": "NOT"}  # NOT SUBMITTED


def test_validate_all_checks_every_recipe_against_one_cluster(capsys):
    from hpc.spec.catalog import available

    assert main(["validate", "-c", "eos", "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(available('recipes'))} of {len(available('recipes'))} recipes validate on eos"
    assert main(["validate", "-c", "dev", "--all"]) == 2  # three 2-GPU nodes: the big recipes do not fit
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert rows["tiny-disagg"] == "ok" and rows["deepseek-r1-wide-ep"] == "FAIL"
    assert main(["validate", "-c", "eos"]) == 2
    assert "name a recipe (--recipe NAME) or check them all (--all)" in capsys.readouterr().err
    assert main(["validate", "-c", "eos", "--all", "--set", "roles.agg.count=2"]) == 2
    assert "--all: checks the recipes as they are" in capsys.readouterr().err
    assert main(["validate", "-c", "nope", "--all"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown cluster" in err


@pytest.mark.parametrize("argv, says", [
    (["logs", "x", "--lines", "-1"], "--lines: must be from 1"),
    (["logs", "x", "--lines", "0"], "--lines: must be from 1"),
    (["logs", "x", "--request", ""], "is not a request id"),
    (["logs", "x", "--request", " "], "is not a request id"),
    (["logs", "x", "--request", "\x1b[2Jcmpl"], "\\x1b[2Jcmpl"),  # escaped, never echoed raw
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", "1,,2"], "an empty value"),
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", "1000000000"], "from 1 to 1,000,000"),
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", "1" + "0" * 23], "from 1 to 1,000,000"),
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", ",".join(["1"] * 20000)], "at most 64"),
    (["bench", "--url", "http://x", "--model", "m", "--requests", "-5"], "--requests"),
    (["bench", "--url", "http://x", "--model", "m", "--rate", "nan"], "--rate: must be above 0"),
    (["bench", "--url", "http://x", "--model", "m", "--rate", "inf"], "--rate: must be above 0"),
    (["profile", "-r", "tiny-disagg", "--isl", "8", "--osl", "8", "--ttft", "1", "--itl", "1", "--tp", "1,,2"],
     "an empty value"),
])
def test_malformed_flags_are_one_line_and_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err and "\x1b" not in err

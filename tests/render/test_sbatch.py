"""Golden scripts for every shipped recipe x cluster pair, linted; hostile values stay inert."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve
from hpc.spec.base import parse_model
from hpc.spec.catalog import available, load_cluster, load_recipe
from hpc.spec.cluster import ClusterProfile
from hpc.resolve import resolve_specs
from tests.conftest import HOSTILE

pytestmark = pytest.mark.unit
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
FIXED_TIME = dt.datetime(2026, 1, 2, 3, 4, 5)
PAIRS = [(c, r) for c in available("clusters") for r in available("recipes")]


def _render(cluster: str, recipe: str) -> str | None:
    try:
        resolved = resolve(cluster, recipe)
    except UserError:
        return None
    return render_sbatch(resolved.manifest(Path(f"/runs/{recipe}"), recipe, FIXED_TIME))


def _shellcheck() -> str | None:
    return shutil.which("shellcheck")


@pytest.mark.parametrize("cluster,recipe", PAIRS, ids=[f"{c}-{r}" for c, r in PAIRS])
def test_golden(cluster, recipe, update_golden, tmp_path):
    golden = GOLDEN / f"{cluster}__{recipe}.sbatch"
    text = _render(cluster, recipe)
    if text is None:  # the recipe does not fit this cluster: it must stay that way, and no golden exists
        assert not golden.exists(), f"{golden.name} exists but {recipe} no longer validates on {cluster}"
        return
    if update_golden:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden.name}; run pytest --update-golden to create it"
    assert text == golden.read_text(), (
        f"{golden.name} differs from the rendered script; if the change is intended, rerun with --update-golden")
    subprocess.run(["bash", "-n", str(golden)], check=True)
    if _shellcheck():
        subprocess.run([_shellcheck(), "-s", "bash", str(golden)], check=True)


def test_every_recipe_has_a_golden_somewhere():
    goldens = {p.name.split("__")[1].removesuffix(".sbatch") for p in GOLDEN.glob("*.sbatch")}
    assert set(available("recipes")) <= goldens


def _fake_bin(tmp_path: Path) -> Path:
    """Fake srun/scontrol/python that record their argv, one NUL-separated record per call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    record.mkdir()
    for name in ("srun", "python3"):  # one file per call: concurrent background steps cannot interleave
        (bin_dir / name).write_text(
            f"#!/bin/bash\nprintf '%s\\0' {name} \"$@\" > \"$(mktemp {str(record)!r}/call.XXXXXX)\"\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'node-%s\\n' a b c\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run_script(path: Path, tmp_path: Path, **extra_env: str) -> list[list[str]]:
    """Run a generated script against the fake srun/scontrol/python; the argv of every call they got."""
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x",
           "SLURM_JOB_ID": "1", **extra_env}
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return [f.read_text().split("\0")[:-1] for f in (tmp_path / "calls").iterdir()]


def test_run_dir_with_newline_is_a_user_error(weird_tmp_path):
    resolved = resolve("dev", "tiny-agg")
    with pytest.raises(UserError, match="HPC_RUNS_DIR: the run directory"):
        render_sbatch(resolved.manifest(weird_tmp_path, "run", FIXED_TIME))


# a mount pyxis can read (a newline or comma in one is refused when the profile loads) with shell in both paths
MOUNT = "/m/$(touch${IFS}PWNED_mount)`touch${IFS}PWNED_tick2`:/d;touch${IFS}PWNED_semi2:ro"


def test_hostile_values_render_inert(tmp_path):
    weird = tmp_path / "we ird 'q' \"dq\" $(touch PWNED) `x` ;y"
    weird.mkdir()
    hostile = "\n".join(HOSTILE)
    cluster = parse_model(ClusterProfile, {
        "name": "h", "nodes_available": 4, "gpus_per_node": 8, "partition": HOSTILE[3], "account": HOSTILE[4],
        "env": {"HOSTILE": hostile}, "srun_args": [HOSTILE[5]],
        "container": {"image": HOSTILE[1], "mounts": [MOUNT], "workdir": HOSTILE[2]}}, file="c.yaml")
    recipe, recipe_path = load_recipe("tiny-disagg", [f"model.path={HOSTILE[3]}"])
    resolved = resolve_specs(cluster, Path("c.yaml"), recipe, recipe_path)
    script = render_sbatch(resolved.manifest(weird, "run", FIXED_TIME))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if _shellcheck():  # SC2016 ("expressions don't expand in single quotes") is the point here
        subprocess.run([_shellcheck(), "-s", "bash", "-e", "SC2016", str(path)], check=True)
    calls = _run_script(path, tmp_path)
    assert not list(tmp_path.rglob("PWNED*")) and not list(weird.parent.rglob("PWNED*"))
    srun_calls = [c for c in calls if c[0] == "srun"]
    # preflight (which records the job), etcd, nats, frontend, prefill, decode, ready, smoke: all in the container
    assert sorted(next(a for a in c if a.startswith("--job-name=")) for c in srun_calls) == [
        f"--job-name={n}" for n in ("decode-0", "etcd", "frontend", "nats", "prefill-0", "preflight", "ready", "smoke")]
    # Each hostile value arrives as exactly one argument, byte for byte.
    assert all(f"--container-image={HOSTILE[1]}" in c for c in srun_calls)
    mounts = [a for c in srun_calls for a in c if a.startswith("--container-mounts=")]
    assert len(mounts) == 8 and all(a.startswith(f"--container-mounts={MOUNT},{weird}:{weird},") for a in mounts)
    assert all(HOSTILE[5] in c for c in srun_calls)
    manifest_arg = str(weird / "manifest.json")
    assert all(manifest_arg in c for c in calls)
    assert f"#SBATCH --partition={HOSTILE[3]}" not in script  # quoted, not raw


def test_container_jobs_mount_the_run_dir_and_the_runtime_and_check_first(tmp_path):
    resolved = resolve("dev-containers", "tiny-disagg")
    script = render_sbatch(resolved.manifest(tmp_path / "run", "run", FIXED_TIME))
    run = str(tmp_path / "run")
    bundle = str(tmp_path / ".hpc-runtime" / "py3.11")
    assert f"export PYTHONPATH={bundle}" in script
    # the container's flags are written once (SRUN_COMMON) and every step gets them
    assert script.count("--container-mounts=") == 1 and script.count('"${SRUN_COMMON[@]}"') == 8
    # preflight first (its first task records the job; no step of its own), then the services
    assert script.index("hpc.checks.preflight") < script.index("--service etcd") and "hpc.checks.jobstart" not in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    (tmp_path / "run").mkdir()
    steps = [c for c in _run_script(path, tmp_path) if c[0] == "srun"]
    assert len(steps) == 8
    for step in steps:
        mounts = next(a for a in step if a.startswith("--container-mounts="))
        assert f"{run}:{run}," in mounts and f"{bundle}:{bundle}:ro" in mounts, step
    assert len({next(a for a in s if a.startswith("--container-name=")) for s in steps}) == 1  # one per image
    preflight = next(s for s in steps if "--job-name=preflight" in s)
    assert preflight[1:6] == ["--overlap", "--job-name=preflight", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1"]


def test_a_run_dir_pyxis_cannot_mount_is_a_user_error(tmp_path):
    resolved = resolve("dev-containers", "tiny-agg")
    with pytest.raises(UserError, match="pyxis mounts cannot carry"):
        render_sbatch(resolved.manifest(tmp_path / "a,b", "run", FIXED_TIME))


def test_secrets_by_reference_never_reach_the_script(tmp_path, monkeypatch):
    secret_file = tmp_path / "hf token"
    secret_file.write_text("file-secret-value\n")
    cluster = parse_model(ClusterProfile, {
        "name": "s", "nodes_available": 4, "gpus_per_node": 8, "env": {
            "PLAIN": "visible", "HF_TOKEN": {"from_env": "MY_HF_TOKEN"}, "API_KEY": {"from_file": str(secret_file)}}},
        file="c.yaml")
    recipe, recipe_path = load_recipe("tiny-agg")
    resolved = resolve_specs(cluster, Path("c.yaml"), recipe, recipe_path)
    manifest = resolved.manifest(tmp_path / "run", "run", FIXED_TIME)
    script = render_sbatch(manifest)
    assert "file-secret-value" not in script and "file-secret-value" not in manifest.model_dump_json()
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if _shellcheck():
        subprocess.run([_shellcheck(), "-s", "bash", "-e", "SC2016", str(path)], check=True)
    (tmp_path / "run" / "logs").mkdir(parents=True)  # the job's own log is there (sbatch --output)
    bin_dir = _fake_bin(tmp_path)
    (bin_dir / "srun").write_text("#!/bin/bash\n[ \"$HF_TOKEN\" = env-secret ] && [ \"$API_KEY\" = file-secret-value ]"
                                  " || { echo \"bad secrets: $HF_TOKEN/$API_KEY\" >&2; exit 9; }\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x", "SLURM_JOB_ID": "1",
           "MY_HF_TOKEN": "env-secret"}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    env.pop("MY_HF_TOKEN")
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "set MY_HF_TOKEN in the shell that submits this job" in done.stderr


def _failing_preflight(bin_dir: Path, line: str, bad_nodes: str = "") -> None:
    """srun as a failing preflight step: `line` in its --output, the bad nodes in the job's list, exit 3."""
    srun = bin_dir / "srun"
    srun.write_text(srun.read_text() + f"""
if [[ " $* " == *" --job-name=preflight "* ]]; then
  for a in "$@"; do [[ $a == --output=* ]] && echo {line!r} > "${{a#--output=}}"; done
  run=$(dirname "${{@: -1}}")  # the manifest's directory
  mkdir -p "$run/preflight" && printf {bad_nodes!r} > "$run/preflight/$SLURM_JOB_ID.bad-nodes"
  exit 3
fi
""")


def test_a_bare_job_runs_the_preflight_on_every_node_before_any_service_starts(tmp_path):
    script = render_sbatch(resolve("dev", "tiny-disagg").manifest(tmp_path / "run", "run", FIXED_TIME))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    calls = _run_script(path, tmp_path)
    first = min((c for c in calls if c[0] == "srun"), key=lambda c: script.index(c[2]))
    assert first[:6] == ["srun", "--overlap", "--job-name=preflight", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1"]
    assert first[-2:] == ["hpc.checks.preflight", str(tmp_path / "run" / "manifest.json")]
    assert script.index("hpc.checks.preflight") < script.index("--service etcd")

    # a failed preflight: its last line on the job's stderr, exit 3, and no service started
    _failing_preflight(tmp_path / "bin", "hpc preflight on node2: gpus: 1 visible, the plan puts 2 on this node")
    before = set((tmp_path / "calls").iterdir())
    done = subprocess.run(["bash", str(path)], cwd=tmp_path / "work", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                               "SLURM_JOB_NODELIST": "x", "SLURM_JOB_ID": "1"})
    assert done.returncode == 3 and "preflight failed, nothing was started: hpc preflight on node2: gpus: 1 " \
        "visible" in done.stderr
    (after,) = set((tmp_path / "calls").iterdir()) - before  # the preflight alone: no service
    assert "--job-name=preflight" in after.read_text()


def test_bad_nodes_are_left_out_of_one_resubmission(tmp_path):
    """preflight.on_bad_node: exclude: the script resubmits itself with sbatch --exclude of the nodes the
    preflight named, records it in resubmitted.json, and a job that is such a resubmission already fails."""
    cluster, cluster_path = load_cluster("dev")
    cluster = cluster.model_copy(update={"preflight": cluster.preflight.model_copy(update={"on_bad_node": "exclude"})})
    recipe, recipe_path = load_recipe("tiny-disagg")
    m = resolve_specs(cluster, cluster_path, recipe, recipe_path).manifest(tmp_path / "run", "run", FIXED_TIME)
    path = tmp_path / "run" / "job.sbatch"
    (tmp_path / "run" / "logs").mkdir(parents=True)
    path.write_text(render_sbatch(m))
    subprocess.run(["bash", "-n", str(path)], check=True)
    if _shellcheck():
        subprocess.run([_shellcheck(), "-s", "bash", "-e", "SC2016", str(path)], check=True)
    bin_dir = _fake_bin(tmp_path)
    _failing_preflight(bin_dir, "hpc preflight on node3: ecc: GPU 1 reports 2 uncorrected ECC errors", "node3\n")
    (bin_dir / "sbatch").write_text("#!/bin/bash\necho \"$HPC_EXCLUDED_NODES $*\" > \"$(dirname \"$0\")/../sbatch-call\"\n"
                                    "echo '4242;debug'\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x", "SLURM_JOB_ID": "41"}
    (tmp_path / "work").mkdir()
    done = subprocess.run(["bash", str(path)], cwd=tmp_path / "work", capture_output=True, text=True, env=env)
    assert done.returncode == 3 and "left out node3; resubmitted as job 4242" in done.stderr
    assert (tmp_path / "sbatch-call").read_text().split() == ["node3", "--parsable", "--exclude=node3", str(path)]
    record = json.loads((tmp_path / "run" / "resubmitted.json").read_text())
    assert record["from_job"] == "41" and record["job_id"] == "4242" and record["excluded"] == "node3"

    (tmp_path / "sbatch-call").unlink()
    done = subprocess.run(["bash", str(path)], cwd=tmp_path / "work", capture_output=True, text=True,
                          env={**env, "HPC_EXCLUDED_NODES": "node3"})
    assert done.returncode == 3 and not (tmp_path / "sbatch-call").exists()  # once, not a loop


def test_a_restarted_units_log_keeps_every_attempt_of_this_job(tmp_path):
    """srun truncates its --output unless told to append: without --open-mode=append the restart would erase
    why the first attempt failed. The job starts the log empty, then each attempt appends."""
    recipe = ["roles.agg.tensor_parallel_size=2", "roles.agg.failure.on_failure=restart",
              "roles.agg.failure.max_restarts=2"]
    script = render_sbatch(resolve("dev", "tiny-agg", recipe).manifest(tmp_path / "run", "run", FIXED_TIME))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "agg-0.log").write_text("an earlier job's lines\n")
    bin_dir = _fake_bin(tmp_path)
    # the worker's srun writes its --output as srun would (append or truncate) and fails its first attempt
    (bin_dir / "srun").write_text(r'''#!/bin/bash
out=""; mode=truncate
for a in "$@"; do case "$a" in --output=*) out="${a#--output=}";; --open-mode=*) mode="${a#--open-mode=}";; esac; done
case " $* " in *" --job-name=agg-0 "*) ;; *) exit 0;; esac
line="attempt ${*: -1}: $([ -e "$0.failed" ] && echo serving || echo 'rank 1: CUDA error')"
if [ "$mode" = append ]; then echo "$line" >> "$out"; else echo "$line" > "$out"; fi
[ -e "$0.failed" ] || { touch "$0.failed"; exit 1; }
''')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x", "SLURM_JOB_ID": "1"}
    done = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "agg-0 ended with status 1; restarting all its ranks (1 of 2)" in done.stderr
    assert (logs / "agg-0.log").read_text() == "attempt 0: rank 1: CUDA error\nattempt 1: serving\n"
    single = render_sbatch(resolve("dev", "tiny-agg").manifest(tmp_path / "r2", "r2", FIXED_TIME))
    assert "--open-mode" not in single  # one process restarts itself inside its step; the log stays open


def test_trtllm_ranks_start_under_its_launcher_through_the_worker_and_a_path_it_would_split_is_refused(tmp_path):
    resolved = resolve("eos", "qwen3-agg")  # four TP2 workers
    script = render_sbatch(resolved.manifest(tmp_path / "run", "run", FIXED_TIME))
    workers = [line for line in script.splitlines() if "hpc.runtime.worker" in line]
    assert len(workers) == 4 and all(line.strip().startswith("python3 -m hpc.runtime.worker ") and
                                     line.rstrip(" &").endswith("--mpi-launcher trtllm-llmapi-launch")
                                     for line in workers), workers
    one_rank = render_sbatch(resolve("eos", "tiny-agg", ["backend=trtllm"]).manifest(tmp_path / "o", "o", FIXED_TIME))
    assert "--role agg" in one_rank and "--mpi-launcher" not in one_rank  # one rank: the LLM needs no launcher
    for name in ("with space", "star*", "what?"):
        with pytest.raises(UserError, match=r"HPC_RUNS_DIR: the run directory .* has a space or wildcard, which "
                                            r"trtllm-llmapi-launch \(the TensorRT-LLM launcher of agg-0's ranks\)"):
            render_sbatch(resolved.manifest(tmp_path / name, "run", FIXED_TIME))
    # the torch engine's ranks are ours: any path works
    render_sbatch(resolve("eos", "tiny-agg").manifest(tmp_path / "with space", "run", FIXED_TIME))


def test_a_hetjob_has_a_component_per_role_and_each_step_runs_in_its_own(tmp_path):
    script = render_sbatch(resolve("dev", "tiny-disagg", ["placement=hetjob"]).manifest(tmp_path / "run", "run",
                                                                                       FIXED_TIME))
    headers = [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]
    parts = " ".join(headers).split(" hetjob ")
    assert len(parts) == 3 and parts[0].startswith("--job-name=") and "--output=" in parts[0]
    assert all("--nodes=1" in part and "--time=20" in part for part in parts)
    assert "--gres=gpu:2" not in parts[0] and all("--gres=gpu:2" in part for part in parts[1:])  # services: no GPU
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if _shellcheck():
        subprocess.run([_shellcheck(), "-s", "bash", "-e", "SC2016", str(path)], check=True)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    het = {f"SLURM_JOB_NODELIST_HET_GROUP_{g}": f"n{g}" for g in range(3)}
    calls = [c for c in _run_script(path, tmp_path, **het) if c[0] == "srun"]
    group = {next(a for a in c if a.startswith("--job-name=")).split("=")[1]: c[1] for c in calls
             if "--job-name=preflight" not in c}
    assert group == {"etcd": "--het-group=0", "nats": "--het-group=0", "frontend": "--het-group=0",
                     "prefill-0": "--het-group=1", "decode-0": "--het-group=2"}
    preflights = sorted(c[1] for c in calls if "--job-name=preflight" in c)
    assert preflights == ["--het-group=0", "--het-group=1", "--het-group=2"]  # a step per component

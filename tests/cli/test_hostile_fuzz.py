"""Hostile input, generated: any recipe, cluster or --set a user can write gets exit 0, or exit 2 with a message
naming the problem and nothing written, never a traceback, a hang or a half-written run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hpc.cli.main import main
from hpc.spec.catalog import project_root
from tests.conftest import HOSTILE

pytestmark = pytest.mark.unit

RECIPE = yaml.safe_load((project_root() / "recipes" / "tiny-disagg.yaml").read_text())
CLUSTER = yaml.safe_load((project_root() / "clusters" / "dev.yaml").read_text())
RECIPE_PATHS = [("name",), ("model", "path"), ("model", "served_name"), ("model", "generate"), ("backend",),
                ("time_limit",), ("frontend", "port"), ("frontend", "router"), ("frontend", "request_timeout_s"),
                ("roles", "prefill", "count"), ("roles", "decode", "count"), ("roles", "decode", "tensor_parallel_size"),
                ("roles", "decode", "expert_parallel_size"), ("roles", "prefill", "override_engine_args"),
                ("roles", "decode", "engine_config"), ("roles", "agg"), ("roles", "decode", "env"),
                ("limits", "max_input_tokens"), ("runtime", "max_file_size_mb"), ("benchmark", "concurrency"),
                ("smoke", "max_tokens"), ("placement",), ("infra", "placement"), ("unknown_key",)]
CLUSTER_PATHS = [("name",), ("partition",), ("time_limit",), ("nodes_available",), ("gpus_per_node",),
                 ("port_base",), ("env",), ("srun_args",), ("sbatch_args",), ("container",), ("python",),
                 ("memory",), ("slurm_conf",), ("bogus",)]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(HOSTILE),
    st.sampled_from(["", "00:00:00", "0", "yes", "1e309", "-1", "agg", "pytorch", "99:99:99", "\u202e", "a" * 5000]),
    st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _set(data: dict, path: tuple, value) -> dict:
    out = yaml.safe_load(yaml.safe_dump(data))
    node = out
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value
    return out


def _check(tmp_path: Path, monkeypatch, capsys, args: list[str]) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("HPC_RUNS_DIR", str(runs))
    code = main(["launch", "--dry-run", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code in (0, 2), err
    written = [p for p in runs.iterdir()] if runs.exists() else []
    if code == 2:
        assert err.startswith("error: ") and written == [], err
    else:
        assert len(written) == 1 and (written[0] / "manifest.json").is_file()


def _dump(path: Path, data) -> None:
    try:
        path.write_text(yaml.safe_dump(data, allow_unicode=True))
    except (yaml.YAMLError, ValueError):
        path.write_text(repr(data))  # not YAML-representable: the loader must refuse it cleanly


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


def _changed_file(tmp_path: Path, base: dict, changes, name: str) -> str:
    data = base
    for path, value in changes:
        data = _set(data, path, value)
    target = tmp_path / name
    _dump(target, data)
    return str(target)


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(RECIPE_PATHS), values), min_size=1, max_size=3))
def test_any_recipe(tmp_path_factory, monkeypatch, capsys, changes):
    tmp_path = tmp_path_factory.mktemp("fuzz")
    recipe = _changed_file(tmp_path, RECIPE, changes, "r.yaml")
    _check(tmp_path, monkeypatch, capsys, ["-c", "dev", "-r", recipe])


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(CLUSTER_PATHS), values), min_size=1, max_size=3))
def test_any_cluster(tmp_path_factory, monkeypatch, capsys, changes):
    tmp_path = tmp_path_factory.mktemp("fuzz")
    cluster = _changed_file(tmp_path, CLUSTER, changes, "c.yaml")
    _check(tmp_path, monkeypatch, capsys, ["-c", cluster, "-r", "tiny-disagg"])


@FUZZ
@given(assignments=st.lists(st.one_of(
    st.builds(lambda p, v: f"{'.'.join(p)}={v}", st.sampled_from(RECIPE_PATHS),
              st.one_of(st.sampled_from(HOSTILE), st.text(max_size=30), st.integers().map(str))),
    st.text(max_size=30)), min_size=1, max_size=3))
@example(assignments=["-:"])  # argparse's own error: one line too, not its usage block
def test_any_set(tmp_path_factory, monkeypatch, capsys, assignments):
    tmp_path = tmp_path_factory.mktemp("fuzz")
    args = ["-c", "dev", "-r", "tiny-disagg"]
    for item in assignments:
        args += ["--set", item]
    _check(tmp_path, monkeypatch, capsys, args)


@pytest.mark.parametrize("content, message", [
    (b"name: a\nname: b\n", "duplicate key 'name'"),
    (b"\xff\xfe\x00b\x00", "binary"),
    (b"name: caf\xe9\n", "not UTF-8 text"),
    (b"a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e]\n",
     "expands to more than"),
    (b"x: " + b"[" * 200 + b"]" * 200 + b"\n", "nested deeper than"),
    (b"name: x\n" + b"# padding\n" * 120_000, "the limit is 1 MiB"),
])
def test_hostile_files_are_one_clear_error(tmp_path, monkeypatch, capsys, content, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    code = main(["launch", "--dry-run", "-c", "dev", "-r", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and str(recipe) in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("setting, message", [
    ("time_limit=00:00:00", "Slurm reads as no limit"),
    ("roles.decode.count=yes", "expected a number, got the boolean true"),
    ("roles.decode.count=1000000000", "less than or equal to 4096"),
    ("runtime.max_file_size_mb=.inf", "finite number"),
    ("benchmark.concurrency=[0, -4]", "greater than or equal to 1"),
    ("model.served_name=", "at least 1 character"),
])
def test_values_that_used_to_pass_silently(tmp_path, monkeypatch, capsys, setting, message):
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    code = main(["validate", "-c", "dev", "-r", "tiny-disagg", "--set", setting])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.parametrize("make", ["file", "unwritable"])
def test_a_bad_runs_directory_is_one_line(tmp_path, monkeypatch, capsys, make):
    runs = tmp_path / "runs"
    if make == "file":
        runs.write_text("x")
    else:
        runs.mkdir()
        runs.chmod(0o500)
    monkeypatch.setenv("HPC_RUNS_DIR", str(runs))
    code = main(["launch", "--dry-run", "-c", "dev", "-r", "tiny-disagg"])
    err = capsys.readouterr().err
    runs.chmod(0o700) if runs.is_dir() else None
    if make == "unwritable" and code == 0:
        pytest.skip("running as root: permissions do not bind")
    assert code == 2 and "HPC_RUNS_DIR" in err and "Traceback" not in err

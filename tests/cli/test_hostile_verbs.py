"""Hostile arguments to every CLI verb, one table: each exits 2 with one line on stderr that names what is wrong
(`expect`), no traceback, no control character echoed, and nothing written or changed under the runs directory
(which holds one dry-run run for the verbs that take one) or in the working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc.cli.main import main

pytestmark = pytest.mark.unit

LONG = "a" * 300
HUGE = "b" * 10_000
ESC = "\x1b[31mred\x1b[0m"
PROFILE = ["profile", "-c", "dev", "-r", "tiny-disagg", "--isl", "64", "--osl", "16", "--ttft", "200", "--itl", "50"]
NEW = ["cluster", "new", "ok", "-p", "debug"]

CASES = [  # (argv, a part of the message)
    # run references
    (["status", "None"], "None"), (["status", ""], "RUN"), (["status", " "], "RUN"), (["status", LONG], "RUN"),
    (["status", HUGE], "RUN"), (["status", "a\nb"], "RUN"), (["status", ESC], "RUN"), (["status", "../etc"], "RUN"),
    (["status", "-1"], "-1"), (["status", "x" * 201], "RUN"),
    (["logs", "None"], "None"), (["logs", LONG], "RUN"), (["logs", "a\x00b"], "RUN"), (["logs", ESC], "RUN"),
    (["cancel", "None"], "None"), (["cancel", LONG], "RUN"), (["cancel", HUGE], "RUN"), (["cancel", "a;b"], "RUN"),
    (["cancel", "$(id)"], "RUN"), (["smoke", "None"], "None"), (["smoke", LONG], "RUN"),
    (["endpoint", LONG], "RUN"), (["bench", "None"], "None"), (["bench", LONG], "RUN"),
    # logs' options, on a run that exists
    (["logs", "@run", "--lines", "-1"], "--lines"), (["logs", "@run", "--lines", "0"], "--lines"),
    (["logs", "@run", "--lines", "abc"], "--lines"), (["logs", "@run", "--lines", "1e9"], "--lines"),
    (["logs", "@run", "--request", ""], "--request"), (["logs", "@run", "--request", " "], "--request"),
    (["logs", "@run", "--request", ESC], "--request"), (["logs", "@run", "--request", "x" * 500], "--request"),
    (["logs", "@run", "--component", "nope"], "nope"), (["logs", "@run", "--component", "../manifest"], "component"),
    (["logs", "@run", "--component", "decode", "--index", "-1"], "--index"),
    (["logs", "@run", "--component", "decode", "--index", "99"], "99"),
    # bench's lists and bounds
    (["bench", "@run", "--concurrency", "1,,2"], "--concurrency"), (["bench", "@run", "--concurrency", "0"],
                                                                     "--concurrency"),
    (["bench", "@run", "--concurrency", "-4"], "--concurrency"), (["bench", "@run", "--concurrency", "abc"],
                                                                  "--concurrency"),
    (["bench", "@run", "--concurrency", "1000000000"], "--concurrency"),
    (["bench", "@run", "--concurrency", "1" + "0" * 23], "--concurrency"),
    (["bench", "@run", "--concurrency", ",".join(["1"] * 20_000)], "--concurrency"),
    (["bench", "@run", "--requests", "-5"], "--requests"), (["bench", "@run", "--requests", "0"], "--requests"),
    (["bench", "@run", "--rate", "nan"], "--rate"), (["bench", "@run", "--rate", "inf"], "--rate"),
    (["bench", "@run", "--rate", "-1"], "--rate"),
    # profile's
    (PROFILE + ["--tp", "1,,2"], "--tp"), (PROFILE + ["--tp", "0"], "--tp"), (PROFILE + ["--tp", "3"], "--tp"),
    (PROFILE[:-8] + ["--isl", "-1", "--osl", "16", "--ttft", "200", "--itl", "50"], "--isl"),
    (PROFILE[:-8] + ["--isl", "64", "--osl", "16", "--ttft", "nan", "--itl", "50"], "--ttft"),
    # recipes, clusters and overrides
    (["validate", "-c", "nowhere", "-r", "tiny-agg"], "nowhere"), (["validate", "-c", "dev", "-r", "nothing"], "nothing"),
    (["validate", "-c", "dev", "-r", "../../etc/passwd"], "recipe"), (["validate", "-c", "../x", "-r", "tiny-agg"],
                                                                     "cluster"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "nokey"], "--set"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "roles.agg.count=-1"], "roles.agg.count"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "roles.agg.count=abc"], "roles.agg.count"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "bogus.key=1"], "bogus"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "frontend.port=70000"], "frontend.port"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--set", "limits.max_input_tokens=0"], "limits.max_input_tokens"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--trtllm-version", "9.9.9"], "9.9.9"),
    (["validate", "-c", "dev", "-r", "tiny-agg", "--trtllm-version", ESC], "trtllm"),
    (["plan", "-c", "dev", "-r", "tiny-agg", "--set", "time_limit=99:99:99"], "time_limit"),
    (["render", "-c", "dev", "-r", "tiny-agg", "--set", "roles.agg.env=5"], "env"),
    (["render", "-c", "eos", "-r", "deepseek-r1-disagg", "--extra-engine-args", "/nonexistent.yaml"],
     "nonexistent"),
    (["render", "-c", "eos", "-r", "deepseek-r1-disagg", "--override-engine-args", "{not json"], "override"),
    (["render", "-c", "eos", "-r", "deepseek-r1-disagg", "--override-engine-args", "nope={}"], "nope"),
    # launches that must write nothing
    (["launch", "-c", "dev", "-r", "deepseek-r1-disagg", "--dry-run"], "deepseek"),
    (["launch", "-r", "tiny-agg", "--chain", "0"], "--chain"), (["launch", "-r", "tiny-agg", "--chain", "1"],
                                                                "--chain"),
    (["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--chain", "2", "--handover", "-5"], "--handover"),
    (["launch", "-r", "tiny-agg", "--chain", "2", "--dry-run"], "chain"),
    (["launch", "-c", "dev", "-r", "tiny-agg", "--set", "roles.agg.count=0", "--dry-run"], "roles.agg.count"),
    # recipe convert, cluster new, endpoint, model
    (["recipe", "convert", "-c", "dev", "-r", "tiny-disagg", "--to", "bogus"], "--to"),
    (["recipe", "convert", "-c", "dev", "-r", "tiny-disagg", "--to", "agg", "--role", "nope"], "nope"),
    (["recipe", "convert", "-c", "dev", "-r", "tiny-disagg", "--to", "agg", "--tp", "0"], "--tp"),
    (["cluster", "new", "../../etc/evil"], "name"), (["cluster", "new", "$(id)"], "name"), (["cluster", "new", ESC],
                                                                                         "name"),
    (NEW + ["--out", "/nonexistent/dir/x.yaml"], "--out"),
    (NEW + ["--image", "a\nb", "--out", "x.yaml"], "image"), (NEW + ["--mount", "nocolon", "--out", "x.yaml"], "mount"),
    (["endpoint", "@run", "--port", "70000"], "--port"), (["endpoint", "@run", "--port", "-1"], "--port"),
    (["endpoint", "@run", "--port", "abc"], "--port"), (["endpoint", "@run", "--retry", "-1"], "--retry"),
    (["model", "nope", "--out", "/tmp/x"], "nope"),
    (["dev-cluster", "sideways"], "sideways"), (["nonsense-verb"], "nonsense"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("runs")
    old = os.environ.get("HPC_RUNS_DIR")
    os.environ["HPC_RUNS_DIR"] = str(root)
    try:
        assert main(["launch", "-c", "eos", "-r", "deepseek-r1-disagg", "--dry-run"]) == 0
    finally:
        os.environ.pop("HPC_RUNS_DIR") if old is None else os.environ.__setitem__("HPC_RUNS_DIR", old)
    (run,) = root.iterdir()
    return root, run.name


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("argv, expect", CASES, ids=[str(i) for i in range(len(CASES))])
def test_a_hostile_argument_exits_2_in_one_line_writing_nothing(runs, argv, expect, capsys, monkeypatch, tmp_path):
    root, run = runs
    monkeypatch.setenv("HPC_RUNS_DIR", str(root))
    monkeypatch.chdir(tmp_path)
    before = _tree(root)
    assert main([run if a == "@run" else a for a in argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "Traceback" not in err and "\x1b" not in err and len(lines[0]) <= 1000, err[-500:]
    assert expect.lower() in lines[0].lower(), lines[0]
    assert _tree(root) == before and list(tmp_path.iterdir()) == []


def test_the_cli_suite_covers_every_verb():
    verbs = {argv[0] for argv, _ in CASES}
    assert {"status", "logs", "cancel", "smoke", "endpoint", "bench", "profile", "validate", "plan", "render",
            "launch", "recipe", "cluster", "model", "dev-cluster"} <= verbs
    assert len(CASES) >= 90

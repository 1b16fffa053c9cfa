"""Generated models: their shapes known before they are built, and where hpc may build them."""

from __future__ import annotations

import pytest

from hpc.cli.main import main
from hpc.model.generated import build_place_problem, generated_config

pytestmark = pytest.mark.unit


def test_a_generated_models_layout_is_checked_at_validate_as_a_real_ones(capsys):
    assert main(["validate", "-r", "tiny-agg", "--set", "roles.agg.tensor_parallel_size=3"]) == 2
    err = capsys.readouterr().err
    assert "TP 3 does not divide the model's 4 attention heads and 2 KV heads (model.generate tiny)" in err
    assert main(["validate", "-r", "tiny-agg", "--set", "roles.agg.tensor_parallel_size=2"]) == 0


def test_the_shapes_are_the_ones_the_builder_writes(tmp_path):
    from hpc.runtime.engine.builds import build_kind

    import json

    built = json.loads((build_kind(tmp_path / "m", "tiny-moe") / "config.json").read_text())
    assert {k: built[k] for k in generated_config("tiny-moe")} == generated_config("tiny-moe")
    assert generated_config("tiny-video") is None and generated_config(None) is None


def test_a_generated_model_is_built_only_where_a_directory_exists_or_under_the_cache(tmp_path, capsys):
    assert build_place_problem(str(tmp_path / "new")) is None  # a new directory in one that exists
    assert build_place_problem(str(tmp_path)) is None  # an existing (empty) one
    assert build_place_problem("~/.cache/hpc/models/some/where/new") is None  # anywhere in the cache
    problem = build_place_problem(str(tmp_path / "no" / "such" / "model"))
    assert f"{tmp_path / 'no'} does not exist" in problem and "mkdir -p" in problem
    code = main(["launch", "-r", "tiny-disagg", "--set", f"model.path={tmp_path / 'typo' / 'model'}", "--no-wait"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()  # nothing made, nothing started

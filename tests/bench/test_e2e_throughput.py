"""benchmarks/e2e_throughput.py: the direct path serves the recipe's model with the recipe's engine args, so that a
recipe of another model (the 8B shape) compares its stack with the same engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from e2e_throughput import direct_model, quiet_recipe, recipe_role_args  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["llama8b-agg", "llama8b-disagg"])
def test_an_8b_recipe_is_compared_on_its_own_model_in_bf16(name):
    recipe = quiet_recipe(name)
    assert direct_model(recipe, None) == ("llama-8b-shape", "~/.cache/hpc/models/llama-8b-shape")
    # the recipe's dtype reaches the direct engine; batch and cache length are the levels' for both paths
    assert recipe_role_args(recipe) == {"dtype": "bfloat16"}


def test_a_tiny_recipe_keeps_the_tiny_model_unless_another_is_named():
    recipe = quiet_recipe("tiny-agg")
    assert direct_model(recipe, None) == ("tiny", "~/.cache/hpc/models/tiny")
    assert direct_model(recipe, "llama-8b-shape") == ("llama-8b-shape", "~/.cache/hpc/models/llama-8b-shape")
    assert recipe_role_args(recipe) == {}

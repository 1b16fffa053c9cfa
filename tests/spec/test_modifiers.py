"""Config modifiers: every shipped disaggregated recipe converts role by role to an aggregated one that passes the
same validation (the TensorRT-LLM field check included) and converts back to exactly the original."""

from __future__ import annotations

import pytest

from hpc.cli.main import main
from hpc.resolve import resolve_specs
from hpc.spec.catalog import available, load_cluster, load_recipe
from hpc.spec.modifiers import AGG_FROM, to_agg, to_disagg, with_parallel

pytestmark = pytest.mark.unit

DISAGG = [name for name in available("recipes") if load_recipe(name)[0].disaggregated
          and not load_recipe(name)[0].roles.prefill.pools]  # pooled: one pool at a time, below


def test_the_shipped_recipes_include_disaggregated_ones():
    assert {"deepseek-r1-disagg", "deepseek-r1-wide-ep", "gpt-oss-120b-disagg", "llava-epd", "tiny-disagg"} <= \
        set(DISAGG)


@pytest.mark.parametrize("name", DISAGG)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_converts_to_agg_and_back_exactly(name, role):
    cluster, cluster_path = load_cluster("eos")
    recipe, path = load_recipe(name)
    before = resolve_specs(cluster, cluster_path, recipe, path)
    agg = to_agg(recipe, role)
    merged = resolve_specs(cluster, cluster_path, agg, path).engine_args["agg"]  # validates like any recipe
    assert merged["cache_transceiver_config"] is None
    assert merged["kv_cache_config"]["enable_block_reuse"] is AGG_FROM[role]["kv_cache_config"]["enable_block_reuse"]
    source = before.engine_args[role]
    untouched = {k: v for k, v in source.items() if k not in AGG_FROM[role] and k != "kv_cache_config"}
    assert {k: merged[k] for k in untouched} == untouched  # everything else is the role's own engine config
    other = getattr(recipe.roles, "decode" if role == "prefill" else "prefill")
    back = to_disagg(agg, role, other)
    assert back == recipe  # name, description, roles: all as they were
    assert resolve_specs(cluster, cluster_path, back, path).engine_args == before.engine_args


def test_a_layout_is_set_in_the_recipe_and_the_engine_together():
    cluster, cluster_path = load_cluster("eos")
    recipe, path = load_recipe("deepseek-r1-disagg")
    out = with_parallel(to_agg(recipe, "decode"), "agg", tp=8, ep=8)
    role = out.roles.agg
    assert (role.tensor_parallel_size, role.expert_parallel_size, role.gpus_per_worker) == (8, 8, 8)
    merged = resolve_specs(cluster, cluster_path, out, path).engine_args["agg"]
    assert (merged["tensor_parallel_size"], merged["moe_expert_parallel_size"]) == (8, 8)  # over decode.yaml's 16


def test_recipe_convert_prints_the_recipe_and_merged_args_and_refuses_what_cannot_run(capsys):
    assert main(["recipe", "convert", "-r", "tiny-disagg", "--to", "agg", "--role", "prefill"]) == 0
    out = capsys.readouterr().out
    assert "name: tiny-disagg-prefill-agg" in out and "# agg: merged engine arguments" in out
    assert "enable_block_reuse: false" in out and "cache_transceiver_config: null" in out
    assert main(["recipe", "convert", "-r", "tiny-agg", "--to", "agg"]) == 2
    assert "roles.decode: no decode role to make aggregated" in capsys.readouterr().err
    assert main(["recipe", "convert", "-r", "deepseek-r1-disagg", "-c", "eos", "--to", "agg", "--tp", "3"]) == 2
    assert "moe_expert_parallel_size: expert-parallel size 16 does not divide TP x PP = 3" in capsys.readouterr().err


def test_a_pool_converts_on_its_own_and_a_pooled_role_needs_its_name(capsys):
    from hpc.cli.main import main

    assert main(["recipe", "convert", "-r", "tiny-pools", "--to", "agg", "--role", "decode", "--pool", "decode-fast",
                 "-c", "local"]) == 0
    out = capsys.readouterr().out
    assert "name: tiny-pools-decode-fast-agg" in out and "max_batch_size: 4" in out and "\nfrontend:" not in out
    assert main(["recipe", "convert", "-r", "tiny-pools", "--to", "agg", "-c", "local"]) == 2
    assert "roles.decode.pools: roles.decode has pools (decode-fast, decode-bulk); name the one to convert" in \
        capsys.readouterr().err


def test_the_readmes_convert_example_runs_with_its_expert_parallel_size(capsys):
    """DeepSeek-R1's decode is TP16 x EP16: at TP 8 the experts split 8 ways too, or validation refuses it."""
    args = ["recipe", "convert", "-c", "eos", "-r", "deepseek-r1-disagg", "--to", "agg", "--role", "decode", "--tp", "8"]
    assert main(args) == 2 and "expert-parallel size 16 does not divide TP x PP = 8" in capsys.readouterr().err
    assert main([*args, "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size: 8" in out and "expert_parallel_size: 8" in out
    assert main([*args, "--ep", "0"]) == 2 and "--ep 0: a parallel size is from 1 to 4096" in capsys.readouterr().err

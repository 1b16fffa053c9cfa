import pytest

from hpc.engine_args.precedence import (KV_EVENT_BUFFER_MAX_SIZE, deep_update, forced_values, merge_engine_args,
                                        overridden, prune_for_autodeploy)

pytestmark = pytest.mark.unit


def test_each_layer_wins_over_the_previous():
    defaults = {"max_batch_size": 1, "kv_cache_config": {"dtype": "auto", "free_gpu_memory_fraction": 0.9}}
    extra = {"max_batch_size": 2, "kv_cache_config": {"dtype": "fp8", "event_buffer_max_size": 0},
             "backend": "_autodeploy"}
    override = {"max_batch_size": 3, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}
    forced = forced_values(publish_kv_events=True)
    merged = merge_engine_args(defaults, extra, override, forced)
    assert merged["max_batch_size"] == 3  # override > yaml > defaults
    assert merged["kv_cache_config"]["dtype"] == "fp8"  # yaml > defaults, kept through the deep merge
    assert merged["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5
    assert merged["backend"] == "_autodeploy"  # events no longer force the backend: AutoDeploy stays AutoDeploy
    assert merged["kv_cache_config"]["event_buffer_max_size"] == KV_EVENT_BUFFER_MAX_SIZE  # forced > yaml
    assert merged["enable_iter_perf_stats"] is True  # stats need it on the PyTorch backend


def test_forced_layer_names_each_user_value_it_replaces():
    user = {"kv_cache_config": {"event_buffer_max_size": 0, "dtype": "fp8"}, "enable_iter_perf_stats": False}
    changes = overridden(user, forced_values(publish_kv_events=True))
    assert sorted(changes) == ["enable_iter_perf_stats: False -> True",
                               f"kv_cache_config.event_buffer_max_size: 0 -> {KV_EVENT_BUFFER_MAX_SIZE}"]
    assert overridden({"kv_cache_config": {"dtype": "fp8"}}, forced_values(publish_kv_events=True)) == []


def test_autodeploy_keeps_no_iteration_stats_flag():
    assert "enable_iter_perf_stats" not in forced_values(publish_kv_events=True, backend="_autodeploy")


def test_yaml_beats_defaults_when_no_override():
    assert merge_engine_args({"a": 1}, {"a": 2}, None, {}) == {"a": 2}
    assert merge_engine_args({"a": 1}, None, None, {}) == {"a": 1}


def test_no_forced_values_without_kv_events():
    assert forced_values(publish_kv_events=False) == {}
    assert merge_engine_args({}, {"backend": "_autodeploy"}, None, forced_values(publish_kv_events=False)) == {
        "backend": "_autodeploy"}


def test_deep_update_does_not_mutate_and_lists_replace():
    base = {"a": {"b": [1, 2]}, "c": 1}
    out = deep_update(base, {"a": {"b": [3]}})
    assert out == {"a": {"b": [3]}, "c": 1} and base == {"a": {"b": [1, 2]}, "c": 1}


def test_autodeploy_prunes_with_one_warning_per_field():
    warnings = []
    args = {"tensor_parallel_size": 2, "cuda_graph_config": {}, "max_batch_size": 8}
    kept = prune_for_autodeploy(args, warn=warnings.append)
    assert kept == {"max_batch_size": 8, "world_size": 2}  # AutoDeploy shards by world_size
    assert len(warnings) == 2 and any("cuda_graph_config" in w for w in warnings)
    assert "tensor_parallel_size" in args  # input untouched

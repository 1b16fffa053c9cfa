"""The global router's config: Dynamo's JSON loads unchanged, the grids choose as their cells say, priorities
override and retry on faster pools, and every malformed config is one line naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.spec.global_router import load_global_router, parse_global_router

pytestmark = pytest.mark.unit

DYNAMO_EXAMPLE = Path(__file__).parent / "data" / "dynamo_hierarchical_planner_global_router.json"
# Dynamo's examples/hierarchical_planner/global_router_config.json, as published (unit-less ttft_min / itl_max)

DISAGG = {
    "mode": "disagg", "enable_priority_retry": True, "num_prefill_pools": 3, "num_decode_pools": 2,
    "prefill_pool_dynamo_namespaces": ["fast", "mid", "slow"], "decode_pool_dynamo_namespaces": ["d0", "d1"],
    "prefill_pool_priorities": [0, 1, 2],
    "prefill_pool_selection_strategy": {
        "ttft_min_ms": 100, "ttft_max_ms": 1000, "ttft_resolution": 3, "isl_min": 0, "isl_max": 3000,
        "isl_resolution": 3, "prefill_pool_mapping": [[0, 1, 2], [0, 1, 2], [0, 0, 1]],
        "priority_overrides": [{"min_priority": 10, "max_priority": 20, "target_pool": 0}]},
    "decode_pool_selection_strategy": {
        "itl_min_ms": 10, "itl_max_ms": 50, "itl_resolution": 2, "context_length_min": 0,
        "context_length_max": 8000, "context_length_resolution": 2, "decode_pool_mapping": [[0, 1], [0, 0]]},
}
AGG3D = {
    "mode": "agg", "num_agg_pools": 2, "agg_pool_dynamo_namespaces": ["a", "b"],
    "agg_pool_selection_strategy": {"ttft_min_ms": 0, "ttft_max_ms": 100, "ttft_resolution": 2, "itl_min_ms": 0,
                                    "itl_max_ms": 20, "itl_resolution": 1, "isl_min": 0, "isl_max": 1000,
                                    "isl_resolution": 2, "agg_pool_mapping": [[[0], [1]], [[1], [1]]]},
}


def test_dynamos_example_loads_unchanged():
    config = load_global_router(DYNAMO_EXAMPLE)
    assert config.pools("prefill") == ["prefill_pool_0", "prefill_pool_1"]
    assert config.prefill_pool_selection_strategy.ttft_max_ms == 1000  # the unit-less name, read as ms
    assert config.prefill_pool(isl=500, ttft_ms=50) == 0 and config.prefill_pool(isl=500, ttft_ms=900) == 1
    assert config.decode_pool(context_length=31000) == 0 and config.retry_order("prefill", 1) == [1]


def test_the_grids_choose_by_cell_clamp_outside_and_take_the_middle_when_no_target():
    c = parse_global_router(DISAGG, "gr.json")
    assert [c.prefill_pool(isl, ttft) for isl, ttft in ((10, 150), (10, 950), (2900, 950), (1500, 500))] == \
        [0, 2, 1, 1]
    assert c.prefill_pool(isl=10**9, ttft_ms=-5) == 0  # beyond the grid: the nearest cell
    assert c.prefill_pool(isl=100) == 1  # no TTFT target: the middle of 100-1000 ms
    assert c.decode_pool(context_length=100, itl_ms=45) == 1 and c.decode_pool(context_length=7999, itl_ms=45) == 0
    a = parse_global_router(AGG3D, "gr.json")
    assert a.agg_pool(ttft_ms=10, itl_ms=5, isl=100) == 0 and a.agg_pool(ttft_ms=10, itl_ms=5, isl=900) == 1


def test_priority_overrides_win_and_retries_go_to_faster_pools_slowest_first():
    c = parse_global_router(DISAGG, "gr.json")
    assert c.prefill_pool(isl=10, ttft_ms=950, priority=15) == 0  # the override, whatever the grid says
    assert c.prefill_pool(isl=10, ttft_ms=950, priority=9) == 2  # out of its range: the grid
    assert c.retry_order("prefill", 2) == [2, 1, 0] and c.retry_order("prefill", 0) == [0]
    tied = parse_global_router({**DISAGG, "prefill_pool_priorities": [0, 0, 1]}, "gr.json")
    assert tied.retry_order("prefill", 2) == [2, 0, 1]


def _broken(path: tuple, value) -> dict:
    data = copy.deepcopy(DISAGG)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, says", [
    (("prefill_pool_selection_strategy", "prefill_pool_mapping"), [[0, 1, 2], [0, 1, 2]],
     "prefill_pool_selection_strategy.prefill_pool_mapping: 2 entries where isl_resolution is 3"),
    (("prefill_pool_selection_strategy", "prefill_pool_mapping"), [[0, 1, 2], [0, 1], [0, 0, 1]],
     "prefill_pool_selection_strategy.prefill_pool_mapping[1]: 2 entries where ttft_resolution is 3"),
    (("decode_pool_selection_strategy", "decode_pool_mapping"), [[0, 5], [0, 0]],
     "decode_pool_selection_strategy.decode_pool_mapping[0][1]: pool 5 does not exist (pools 0 to 1)"),
    (("prefill_pool_dynamo_namespaces",), ["a", "b"], "prefill_pool_dynamo_namespaces: 2 names for num_prefill"),
    (("decode_pool_selection_strategy", "itl_min_ms"), 60, "itl_min_ms 60.0 must be below itl_max_ms 50.0"),
    (("prefill_pool_selection_strategy", "priority_overrides"), [{"min_priority": 1, "max_priority": 2,
                                                                  "target_pool": 7}],
     "priority_overrides[0].target_pool: pool 7 does not exist"),
    (("num_decode_pools",), KeyError, "num_decode_pools: required in disagg mode"),
    (("prefill_pool_selection_strategy", "isl_resolutoin"), 3,
     "prefill_pool_selection_strategy.isl_resolutoin: unknown key (did you mean 'isl_resolution'?"),
    (("mode",), "hybrid", "mode: Input should be 'disagg' or 'agg'"),
])
def test_a_malformed_config_is_one_line_naming_the_field(tmp_path, path, value, says):
    config = tmp_path / "gr.json"
    config.write_text(json.dumps(_broken(path, value)))
    with pytest.raises(UserError) as err:
        load_global_router(config)
    assert says in str(err.value) and "gr.json" in str(err.value) and "\n" not in str(err.value)
    if "unknown key" in says:
        assert "valid keys: " in str(err.value) and "isl_resolution" in str(err.value)

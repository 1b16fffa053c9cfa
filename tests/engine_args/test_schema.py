import glob

import pytest
import yaml

from hpc.engine_args.schema import check_engine_config

pytestmark = pytest.mark.unit


def _messages(cfg):
    return [e.render() for e in check_engine_config(cfg, file="e.yaml")]


def test_shipped_engine_configs_are_valid(project_root):
    files = sorted(glob.glob(str(project_root / "engine_configs/*/*.yaml")))
    assert len(files) >= 14
    for f in files:
        assert check_engine_config(yaml.safe_load(open(f)), file=f) == []


def test_unknown_key_suggests_closest():
    (msg,) = _messages({"tensor_paralel_size": 2})
    assert "e.yaml: tensor_paralel_size: unknown TensorRT-LLM engine key" in msg
    assert "did you mean 'tensor_parallel_size'" in msg


@pytest.mark.parametrize("key, meant", [("tp_size", "tensor_parallel_size"), ("moe_ep", "moe_expert_parallel_size"),
                                       ("pp_size", "pipeline_parallel_size"), ("cp", "context_parallel_size")])
def test_abbreviated_key_suggests_what_it_abbreviates(key, meant):
    (msg,) = _messages({key: 2})
    assert f"e.yaml: {key}: unknown TensorRT-LLM engine key" in msg and f"did you mean '{meant}'" in msg


def test_ambiguous_abbreviation_suggests_nothing():
    (msg,) = _messages({"pp": 2})  # pipeline_parallel_size or pp_partition
    assert "did you mean" not in msg and "pipeline_parallel_size" in msg


def test_nested_unknown_key_and_type_errors():
    msgs = _messages({"kv_cache_config": {"dtyp": "fp8", "free_gpu_memory_fraction": "lots"},
                      "max_batch_size": "8", "enable_chunked_prefill": "yes"})
    assert any("kv_cache_config.dtyp" in m and "'dtype'" in m for m in msgs)
    assert any("kv_cache_config.free_gpu_memory_fraction: expected" in m for m in msgs)
    assert any("max_batch_size: expected" in m for m in msgs)
    assert any("enable_chunked_prefill: expected bool" in m for m in msgs)


def test_enum_values():
    (msg,) = _messages({"cache_transceiver_config": {"backend": "TCP"}})
    assert "must be one of DEFAULT, UCX, NIXL, MOONCAKE, MPI" in msg
    (msg,) = _messages({"backend": "tensorrt"})
    assert "pytorch, _autodeploy" in msg


def test_enum_typed_fields_take_the_enum_values_and_name_the_choices_otherwise():
    # Dynamo's configs set these; each used to be refused as "expected CapacitySchedulerPolicy"
    assert _messages({"scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
                                           "context_chunking_policy": "EQUAL_PROGRESS"}}) == []
    (msg,) = _messages({"scheduler_config": {"context_chunking_policy": "FIFO"}})
    assert msg == "e.yaml: scheduler_config.context_chunking_policy: must be one of FIRST_COME_FIRST_SERVED, " \
                  "EQUAL_PROGRESS, FORCE_CHUNK, got 'FIFO'"
    (msg,) = _messages({"scheduler_config": {"capacity_scheduler_policy": True}})
    assert "must be one of MAX_UTILIZATION, GUARANTEED_NO_EVICT, STATIC_BATCH, got True" in msg
    # load_format: a member's value or its name in any case (TorchLlmArgs' own validator), nothing else
    assert _messages({"load_format": "dummy"}) == [] and _messages({"load_format": 1}) == []
    assert _messages({"load_format": "dumy"}) == ["e.yaml: load_format: must be one of auto, dummy, vision_only, "
                                                  "gms, got 'dumy'"]


def test_speculative_union_by_decoding_type():
    assert _messages({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1}}) == []
    (msg,) = _messages({"speculative_config": {"decoding_type": "Medusa"}})
    assert "speculative_config.decoding_type: must be one of" in msg
    (msg,) = _messages({"speculative_config": {"decoding_type": "Eagle3", "max_draft_length": 3}})
    assert "max_draft_length" in msg and "max_draft_len" in msg


def test_constraints_and_bool_is_not_int():
    assert _messages({"cache_transceiver_config": {"kv_cache_bounce_size_mb": -1}})
    assert _messages({"tensor_parallel_size": True})

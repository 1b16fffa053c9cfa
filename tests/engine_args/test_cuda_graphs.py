"""`cuda_graph_config` read as TensorRT-LLM reads it (tensorrt_llm/llmapi/llm_args.py, BaseCudaGraphConfig)."""

from __future__ import annotations

import pytest

from hpc.engine_args.cuda_graphs import (DEFAULT_CAPTURE_NUM_TOKENS, GraphSizes, cross_field_problem,
                                         decode_graph_sizes, generated_sizes, prefill_graph_tokens)
from hpc.engine_args.schema import check_engine_config

pytestmark = pytest.mark.unit


def test_generated_sizes_follow_the_upstream_rule():
    # without padding: every size to 31, then 32, 64, 128, powers of two, and max_batch_size itself
    assert generated_sizes(128, False) == list(range(1, 33)) + [64, 128]
    assert generated_sizes(1000, False)[-4:] == [128, 256, 512, 1000]
    # with padding: 1, 2, 4, multiples of 8 to 128, then steps of 64
    assert generated_sizes(32, True) == [1, 2, 4, 8, 16, 24, 32]
    assert generated_sizes(300, True)[-3:] == [192, 256, 300]
    assert generated_sizes(1, False) == [1]


def test_absent_means_on_null_means_off_and_sizes_stop_at_the_engine_batch():
    assert decode_graph_sizes({}, 8) == GraphSizes(tuple(range(1, 9)), padding=False)
    assert decode_graph_sizes({"cuda_graph_config": None}, 8) is None
    assert decode_graph_sizes({"cuda_graph_config": {}}, 8) == GraphSizes(tuple(range(1, 9)), padding=False)
    padded = decode_graph_sizes({"cuda_graph_config": {"enable_padding": True, "max_batch_size": 64}}, 32)
    assert padded == GraphSizes((1, 2, 4, 8, 16, 24, 32), padding=True)
    listed = decode_graph_sizes({"cuda_graph_config": {"batch_sizes": [16, 1, 4, 64]}}, 32)
    assert listed == GraphSizes((1, 4, 16), padding=False)
    # the encoder variant (explicit, or implied by its fields) captures no decode steps
    assert decode_graph_sizes({"cuda_graph_config": {"mode": "encode", "max_num_token": 512}}, 8) is None
    assert decode_graph_sizes({"cuda_graph_config": {"max_num_token": 512}}, 8) is None
    assert decode_graph_sizes({"cuda_graph_config": {"batch_sizes": [64]}}, 32) is None


def test_a_batch_runs_in_its_own_graph_or_with_padding_the_next_one_up():
    exact = GraphSizes((1, 2, 4, 8), padding=False)
    assert [exact.size_for(r) for r in (1, 3, 4, 9)] == [1, None, 4, None]
    padded = GraphSizes((1, 2, 4, 8), padding=True)
    assert [padded.size_for(r) for r in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def test_batch_sizes_and_a_different_max_batch_size_are_refused_before_submitting():
    assert cross_field_problem({"batch_sizes": [1, 2, 8], "max_batch_size": 8}) is None
    assert cross_field_problem({"batch_sizes": [1, 2, 8]}) is None
    (error,) = check_engine_config({"cuda_graph_config": {"batch_sizes": [1, 2, 8], "max_batch_size": 16}},
                                   file="decode.yaml")
    assert error.file == "decode.yaml" and error.field == "cuda_graph_config"
    assert "max_batch_size 16 must equal max(batch_sizes) = 8" in error.message and "drop max_batch_size" in error.hint
    # a wrong type is the type check's one error, not a second one from here
    errors = check_engine_config({"cuda_graph_config": {"batch_sizes": ["a"], "max_batch_size": 16}}, file="x")
    assert len(errors) == 1 and "batch_sizes" in errors[0].field


def test_prefill_graphs_follow_torch_compile_config_and_stop_at_the_step_budget():
    # TorchCompileConfig: piecewise graphs off unless asked for; capture_num_tokens defaults to 1-128, 256-3072
    assert prefill_graph_tokens({}, 8192) is None
    assert prefill_graph_tokens({"torch_compile_config": None}, 8192) is None
    assert prefill_graph_tokens({"torch_compile_config": {"enable_piecewise_cuda_graph": False}}, 8192) is None
    on = {"torch_compile_config": {"enable_piecewise_cuda_graph": True}}
    assert prefill_graph_tokens(on, 8192) == DEFAULT_CAPTURE_NUM_TOKENS
    assert DEFAULT_CAPTURE_NUM_TOKENS[:8] == (1, 2, 4, 8, 16, 32, 64, 128) and DEFAULT_CAPTURE_NUM_TOKENS[-1] == 3072
    assert prefill_graph_tokens(on, 300) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # none above max_num_tokens
    listed = {"torch_compile_config": {"enable_piecewise_cuda_graph": True, "capture_num_tokens": [64, 8, 64, 9000]}}
    assert prefill_graph_tokens(listed, 8192) == (8, 64)
    assert prefill_graph_tokens({"torch_compile_config": {"enable_piecewise_cuda_graph": True,
                                                          "capture_num_tokens": [9000]}}, 8192) is None

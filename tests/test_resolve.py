"""One failing case per validation rule; every message names the file and field."""

import datetime as dt
from pathlib import Path

import pytest
import yaml

from hpc.errors import UserError
from hpc.render.sbatch import render_sbatch
from hpc.resolve import resolve

pytestmark = pytest.mark.unit


def _write_recipe(tmp_path: Path, roles: dict, engine: dict[str, dict] | None = None, **extra) -> str:
    for name, cfg in (engine or {}).items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    data = {"name": "t", "model": {"path": "/m", "served_name": "m"}, "backend": "trtllm", "roles": roles}
    data.update(extra)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _error(cluster: str, recipe: str) -> str:
    with pytest.raises(UserError) as err:
        resolve(cluster, recipe)
    return err.value.render()


def test_engine_tp_must_match_recipe_gpus(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"tensor_parallel_size": 8, "engine_config": "e.yaml"}},
                      {"e": {"tensor_parallel_size": 4}})
    msg = _error("eos", r)
    assert "e.yaml: tensor_parallel_size: engine TP x PP = 4 x 1 = 4" in msg and "8 GPUs" in msg


def test_expert_parallel_must_divide(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"tensor_parallel_size": 8, "expert_parallel_size": 3}})
    assert "moe_expert_parallel_size: expert-parallel size 3 does not divide TP x PP = 8" in _error("eos", r)


def test_attention_dp_needs_tp(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"enable_attention_dp": True}})
    assert "enable_attention_dp: attention-DP needs tensor_parallel_size > 1" in _error("eos", r)


def test_kv_dtype_must_match(tmp_path):
    ctc = {"backend": "UCX", "max_tokens_in_buffer": 8192}
    r = _write_recipe(tmp_path, {"prefill": {"engine_config": "p.yaml"}, "decode": {"engine_config": "d.yaml"}},
                      {"p": {"kv_cache_config": {"dtype": "fp8"}, "cache_transceiver_config": ctc},
                       "d": {"kv_cache_config": {"dtype": "auto"}, "cache_transceiver_config": ctc}})
    assert "d.yaml: kv_cache_config.dtype: prefill uses KV-cache dtype 'fp8' but decode uses 'auto'" in _error("eos", r)


def test_transceiver_buffer_must_hold_longest_input(tmp_path):
    ctc = {"backend": "UCX", "max_tokens_in_buffer": 1024}
    r = _write_recipe(tmp_path, {"prefill": {"engine_config": "p.yaml"}, "decode": {"engine_config": "p.yaml"}},
                      {"p": {"cache_transceiver_config": ctc}}, limits={"max_input_tokens": 4096})
    msg = _error("eos", r)
    assert "p.yaml: cache_transceiver_config.max_tokens_in_buffer: max_tokens_in_buffer 1024 is below" in msg


def test_a_prompt_the_recipe_accepts_must_fit_the_step_budget_unless_chunked(tmp_path):
    ctc = {"backend": "UCX"}
    r = _write_recipe(tmp_path, {"prefill": {"engine_config": "p.yaml"}, "decode": {"engine_config": "d.yaml"}},
                      {"p": {"cache_transceiver_config": ctc, "max_num_tokens": 2048},
                       "d": {"cache_transceiver_config": ctc, "max_num_tokens": 256}},  # decode takes no prompts
                      limits={"max_input_tokens": 4096})
    msg = _error("eos", r)
    assert msg.count("max_num_tokens") >= 1 and "d.yaml" not in msg
    assert "p.yaml: max_num_tokens: max_num_tokens 2048 is below the longest prompt the recipe accepts " \
           "(limits.max_input_tokens 4096) and enable_chunked_prefill is off" in msg
    assert "set enable_chunked_prefill: true, raise max_num_tokens to at least 4096" in msg
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"cache_transceiver_config": ctc, "max_num_tokens": 2048,
                                                     "enable_chunked_prefill": True}))
    assert resolve("eos", r).engine_args["prefill"]["enable_chunked_prefill"] is True
    # the default budget (8192) against a longer limit, aggregated
    r = _write_recipe(tmp_path, {"agg": {}}, limits={"max_input_tokens": 10000})
    assert "max_num_tokens: max_num_tokens 8192 is below" in _error("eos", r)


def test_transceiver_required_for_disagg(tmp_path):
    r = _write_recipe(tmp_path, {"prefill": {}, "decode": {}})
    assert "cache_transceiver_config.backend: disaggregated serving needs a cache transceiver" in _error("eos", r)


def test_encode_needs_multimodal(tmp_path):
    r = _write_recipe(tmp_path, {"encode": {}, "prefill": {}, "decode": {}}, backend="torch")
    assert "roles.encode: an encode role needs a multimodal model" in _error("eos", r)


def test_job_must_fit_nodes(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"count": 3, "tensor_parallel_size": 2}}, backend="torch",
                      infra={"placement": "dedicated"})
    assert "the job needs 4 nodes but cluster 'dev' has 3" in _error("dev", r)


def test_a_huge_recipe_is_refused_before_anything_is_planned(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"count": 4000, "tensor_parallel_size": 1000}}, backend="torch")
    assert "the recipe needs 4000000 GPUs (count x TP x PP over its roles) but cluster 'dev' has 6" in _error("dev", r)


def test_engine_and_recipe_expert_parallel_sizes_must_agree(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"tensor_parallel_size": 8, "expert_parallel_size": 2,
                                         "override_engine_args": {"moe_expert_parallel_size": 8}}})
    assert "engine expert-parallel size 8 but the recipe plans 2" in _error("eos", r)


def test_time_limit_must_fit(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {}}, backend="torch", time_limit="08:00:00")
    assert "time_limit: time limit 08:00:00 exceeds the partition's maximum 04:00:00" in _error("eos", r)


def test_the_drain_before_the_end_must_leave_time_to_serve(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {}}, backend="torch", time_limit="00:02:00", drain_before_end_s=120)
    assert _error("eos", r).endswith(
        "drain_before_end_s: 120 s is not less than the job's time limit (00:02:00): the workers would drain as "
        "they start (lower it, lengthen time_limit, or set 0 for no drain before the end)")
    fits = _write_recipe(tmp_path, {"agg": {}}, backend="torch", time_limit="00:03:00", drain_before_end_s=120)
    assert "#SBATCH --signal=USR1@120" in render_sbatch(resolve("eos", fits).manifest(tmp_path / "r", "r",
                                                                                      dt.datetime(2026, 1, 1)))
    off = _write_recipe(tmp_path, {"agg": {}}, backend="torch", time_limit="00:01:00", drain_before_end_s=0)
    assert "--signal" not in render_sbatch(resolve("eos", off).manifest(tmp_path / "r", "r", dt.datetime(2026, 1, 1)))


def test_port_clash(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {}}, backend="torch", frontend={"port": 24011})
    assert "frontend.port: frontend port 24011 clashes with the job's ports" in _error("eos", r)


def test_unknown_engine_key_in_yaml_and_override(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml", "override_engine_args": {"max_batch_sise": 2}}},
                      {"e": {"kv_cache_config": {"free_gpu_mem_fraction": 0.5}}})
    msg = _error("eos", r)
    assert "e.yaml: kv_cache_config.free_gpu_mem_fraction: unknown" in msg
    assert "override_engine_args: max_batch_sise: unknown" in msg and "max_batch_size" in msg


def test_missing_engine_config_file(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"engine_config": "nope.yaml"}})
    assert "roles.agg.engine_config: engine config not found" in _error("eos", r)


def test_override_wins_in_the_resolved_args(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml", "override_engine_args": '{"max_batch_size": 7}'}},
                      {"e": {"max_batch_size": 3}}, backend="torch")
    assert resolve("eos", r).engine_args["agg"]["max_batch_size"] == 7


def test_prefill_graphs_are_a_torch_default_that_an_override_turns_off(tmp_path):
    torch_recipe = _write_recipe(tmp_path, {"agg": {}}, backend="torch")
    assert resolve("eos", torch_recipe).engine_args["agg"]["torch_compile_config"] == \
        {"enable_piecewise_cuda_graph": True}
    off = _write_recipe(tmp_path, {"agg": {"override_engine_args": '{"torch_compile_config": null}'}}, backend="torch")
    assert resolve("eos", off).engine_args["agg"]["torch_compile_config"] is None
    # TensorRT-LLM keeps its own default (off): nothing added to what its LLM API receives
    trtllm = _write_recipe(tmp_path, {"agg": {}})
    assert "torch_compile_config" not in resolve("eos", trtllm).engine_args["agg"]


def test_padded_decode_graphs_are_a_torch_default_a_users_graph_config_merges_with(tmp_path):
    from hpc.engine_args.cuda_graphs import decode_graph_sizes

    torch_recipe = _write_recipe(tmp_path, {"agg": {}}, backend="torch")
    args = resolve("eos", torch_recipe).engine_args["agg"]
    sizes = decode_graph_sizes(args, 64)
    assert sizes.padding and sizes.size_for(57) == 64  # a batch of 57 rows replays the 64-row graph, not eager
    listed = _write_recipe(tmp_path, {"agg": {"override_engine_args": '{"cuda_graph_config": {"batch_sizes": [8]}}'}},
                           backend="torch")
    assert resolve("eos", listed).engine_args["agg"]["cuda_graph_config"] == {"enable_padding": True,
                                                                              "batch_sizes": [8]}
    off = _write_recipe(tmp_path, {"agg": {"override_engine_args": '{"cuda_graph_config": null}'}}, backend="torch")
    assert decode_graph_sizes(resolve("eos", off).engine_args["agg"], 64) is None
    assert "cuda_graph_config" not in resolve("eos", _write_recipe(tmp_path, {"agg": {}})).engine_args["agg"]


def test_bad_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nroles: [\n")
    assert "bad.yaml: line" in _error("eos", str(path))


@pytest.mark.parametrize("layout, field, says", [
    ({"tensor_parallel_size": 4, "expert_parallel_size": 2}, "roles.agg.expert_parallel_size",
     "the torch reference engine runs expert parallelism equal to tensor parallelism"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "roles.agg.pipeline_parallel_size",
     "the torch reference engine runs tensor or pipeline parallelism, not both")])
def test_the_torch_engine_refuses_layouts_it_cannot_run(tmp_path, layout, field, says):
    r = _write_recipe(tmp_path, {"agg": layout}, backend="torch")
    msg = _error("eos", r)
    assert f"recipe.yaml: {field}: {says}" in msg and "use backend: trtllm" in msg
    trtllm = _write_recipe(tmp_path, {"agg": layout})
    assert resolve("eos", trtllm).recipe.backend.value == "trtllm"  # the same layout is fine on TensorRT-LLM
    pipeline = _write_recipe(tmp_path, {"agg": {"pipeline_parallel_size": 2}}, backend="torch")
    assert resolve("eos", pipeline).plan.workers[0].tasks == 2  # pipeline parallelism alone runs


def test_the_torch_engine_refuses_a_chunking_policy_it_does_not_run(tmp_path):
    chunked = {"enable_chunked_prefill": True, "scheduler_config": {"context_chunking_policy": "FORCE_CHUNK"}}
    r = _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml"}}, {"e": chunked}, backend="torch")
    assert "e.yaml: scheduler_config.context_chunking_policy: the torch reference engine chunks prompts " \
           "FIRST_COME_FIRST_SERVED or EQUAL_PROGRESS, not FORCE_CHUNK" in _error("eos", r)
    assert resolve("eos", _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml"}}, {"e": chunked}))  # trtllm
    tiny_step = {"enable_chunked_prefill": True, "max_num_tokens": 16}  # below the default block of 32
    r = _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml"}}, {"e": tiny_step}, backend="torch",
                      limits={"max_input_tokens": 16})
    assert "e.yaml: max_num_tokens: max_num_tokens 16 is below one chunk (kv_cache_config.tokens_per_block 32)" \
        in _error("eos", r)
    chunked["scheduler_config"]["context_chunking_policy"] = "EQUAL_PROGRESS"
    assert resolve("eos", _write_recipe(tmp_path, {"agg": {"engine_config": "e.yaml"}}, {"e": chunked},
                                        backend="torch"))


def test_torch_expert_parallelism_needs_an_moe_model(tmp_path):
    layout = {"agg": {"tensor_parallel_size": 2, "expert_parallel_size": 2}}
    dense = _write_recipe(tmp_path, layout, backend="torch",
                          model={"path": "/m", "served_name": "m", "generate": "tiny"})
    assert "recipe.yaml: model.generate: expert parallelism needs a mixture-of-experts model" in _error("eos", dense)
    moe = _write_recipe(tmp_path, layout, backend="torch",
                        model={"path": "/m", "served_name": "m", "generate": "tiny-moe"})
    assert resolve("eos", moe).plan.workers[0].tasks == 2  # EP == TP on the MoE model runs


def test_a_hub_id_is_refused_for_the_torch_engine_and_left_to_tensorrt_llm(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {}}, model={"path": "meta-llama/Llama-3.1-8B", "served_name": "m"},
                      backend="torch")
    assert "recipe.yaml: model.path: 'meta-llama/Llama-3.1-8B' is a hub id; the torch reference engine reads its " \
           "weights from a directory (download it" in _error("eos", r)
    fetched = _write_recipe(tmp_path, {"agg": {}}, model={"path": "meta-llama/Llama-3.1-8B", "served_name": "m"})
    assert resolve("eos", str(fetched), []).recipe.backend.value == "trtllm"


def test_the_canned_completion_knob_is_refused_outside_the_torch_engine(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {}}, model={"path": "/m", "served_name": "m", "canned_completion": "x"})
    assert "recipe.yaml: model.canned_completion: a test knob of the torch engine only" in _error("eos", r)


# ---- pools and the global router (seed 003) -------------------------------------------------------------------
def _pooled(tmp_path: Path, router: dict | None, backend: str = "torch", **role_extra) -> str:
    import json

    roles = {"prefill": {"pools": [{"name": "pf"}, {"name": "pb", "count": 2}], **role_extra},
             "decode": {"pools": [{"name": "df"}, {"name": "db"}]}}
    extra = {}
    if router is not None:
        (tmp_path / "gr.json").write_text(json.dumps(router))
        extra["frontend"] = {"global_router": "gr.json"}
    return _write_recipe(tmp_path, roles, backend=backend, **extra)


def _router_config(prefill=("pf", "pb"), decode=("df", "db"), **extra) -> dict:
    return {"mode": "disagg", "num_prefill_pools": len(prefill), "num_decode_pools": len(decode),
            "prefill_pool_dynamo_namespaces": list(prefill), "decode_pool_dynamo_namespaces": list(decode),
            "prefill_pool_selection_strategy": {"isl_min": 0, "isl_max": 100, "isl_resolution": 1,
                                                "ttft_min_ms": 1, "ttft_max_ms": 2, "ttft_resolution": 1,
                                                "prefill_pool_mapping": [[0]]},
            "decode_pool_selection_strategy": {"context_length_min": 0, "context_length_max": 100,
                                               "context_length_resolution": 1, "itl_min_ms": 1, "itl_max_ms": 2,
                                               "itl_resolution": 1, "decode_pool_mapping": [[1]]}, **extra}


def test_pools_plan_their_workers_and_carry_the_router_config_inline(tmp_path):
    r = resolve("local", _pooled(tmp_path, _router_config(), tensor_parallel_size=1))
    names = [(w.name, w.pool) for w in r.plan.workers]
    assert names == [("prefill-0", "pf"), ("prefill-1", "pb"), ("prefill-2", "pb"), ("decode-0", "df"),
                     ("decode-1", "db")]
    assert sorted(r.engine_args) == ["db", "df", "pb", "pf"]
    assert r.recipe.frontend.global_router["decode_pool_selection_strategy"]["decode_pool_mapping"] == [[1]]


@pytest.mark.parametrize("router, where, expect", [
    (None, "recipe.yaml: frontend.global_router", "roles.prefill has pools but nothing chooses among them"),
    (_router_config(prefill=("pf", "px")), "gr.json: prefill_pool_dynamo_namespaces",
     "pool 'px' is not among the recipe's prefill pools (pf, pb)"),
    (_router_config(decode=("df",), decode_pool_selection_strategy=None), "gr.json: decode_pool_selection_strategy",
     "required in disagg mode"),
    ({**_router_config(decode=("df",)), "decode_pool_selection_strategy": {
        **_router_config()["decode_pool_selection_strategy"], "decode_pool_mapping": [[0]]}},
     "gr.json: decode_pool_dynamo_namespaces", "the recipe's decode pool 'db' is missing here"),
    ({"mode": "agg", "num_agg_pools": 1, "agg_pool_dynamo_namespaces": ["pf"], "agg_pool_selection_strategy": {
        "ttft_min_ms": 1, "ttft_max_ms": 2, "ttft_resolution": 1, "itl_min_ms": 1, "itl_max_ms": 2,
        "itl_resolution": 1, "agg_pool_mapping": [[0]]}}, "gr.json: mode",
     "mode agg routes agg requests but the recipe has no agg role"),
])
def test_a_router_config_that_does_not_match_the_pools_is_one_line(tmp_path, router, where, expect):
    msg = _error("local", _pooled(tmp_path, router))
    assert where in msg and expect in msg, msg


def test_pool_names_are_unique_and_a_pooled_role_has_no_count_of_its_own(tmp_path):
    r = _write_recipe(tmp_path, {"agg": {"pools": [{"name": "a"}, {"name": "decode"}]}}, backend="torch")
    assert "the name 'decode' is taken" in _error("local", r)
    r = _write_recipe(tmp_path, {"agg": {"count": 3, "pools": [{"name": "a"}]}}, backend="torch")
    assert "roles.agg: with pools, each pool gives its own count" in _error("local", r)


def test_torch_disaggregated_workers_hand_over_between_tp_workers_not_pipeline_stages(tmp_path):
    resolve("local", _pooled(tmp_path, _router_config(), tensor_parallel_size=2))
    msg = _error("local", _pooled(tmp_path, _router_config(), pipeline_parallel_size=2))
    assert "recipe.yaml: roles.prefill.pools[0].pipeline_parallel_size: the torch reference engine hands the KV " \
           "cache over between tensor-parallel workers, not pipeline stages" in msg


@pytest.mark.parametrize("sets, expect", [
    (["diffusion.dit_cfg_size=2"], "diffusion: the DiT parallel sizes (dp 1 x tp 1 x ulysses 1 x ring 1 x cfg 2) "
                                   "make 2 ranks, but each worker has 1 GPU(s)"),
    (["diffusion.dit_cfg_size=3"], "diffusion.dit_cfg_size: Input should be 1 or 2"),
    (["diffusion.enable_teacache=false"], "teacache_thresh is set but enable_teacache is false"),
    (["diffusion.default_width=72"], "diffusion.default_height: default size: 72x64 is not a multiple of 16"),
    (["diffusion.default_num_frames=40"], "diffusion.default_num_frames: default size: 40 frames is above the "
                                          "model's limit of 32"),
    (["diffusion.dit_ring_size=2", "roles.agg.tensor_parallel_size=2"],
     "diffusion.dit_ring_size: the torch reference engine runs dit_cfg_size and dit_ulysses_size, not dit_ring_size"),
    (["diffusion.linear_type=trtllm-nvfp4"], "diffusion.linear_type: the torch reference engine has only the "
                                             "default linear_type"),
    (["diffusion.output_dir=videos"], "diffusion.output_dir: output_dir 'videos' is relative"),
    (["diffusion.fancy=1"], "diffusion.fancy"),
    (["modality=text"], "diffusion: only for modality video_diffusion"),
])
def test_every_bad_diffusion_flag_is_one_line_exit_2(sets, expect, capsys):
    from hpc.cli.main import main

    args = ["validate", "-r", "tiny-video"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and err.count("\n") == 1, err


def test_the_eos_video_recipe_validates_and_plans_eight_ranks_per_worker():
    r = resolve("eos", "wan2.1-t2v-eos")
    assert r.recipe.diffusion.ranks == 8 and [w.tasks for w in r.plan.workers] == [8, 8]


@pytest.mark.parametrize("recipe,kv_transport,expect", [
    (["-r", "tiny-disagg"], "ucx", "runtime.kv_transport"),  # not one of auto / bytes / nixl
    (["-r", "deepseek-r1-disagg", "-c", "eos"], "nixl",
     "runtime.kv_transport: runtime.kv_transport 'nixl' is the torch engine's; TensorRT-LLM moves the KV cache"),
])
def test_the_kv_transport_is_one_the_engine_has(recipe, kv_transport, expect, capsys):
    from hpc.cli.main import main

    assert main(["validate", *recipe, "--set", f"runtime.kv_transport={kv_transport}"]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err, err
    assert main(["validate", "-r", "tiny-disagg", "--set", "runtime.kv_transport=nixl"]) == 0


@pytest.mark.parametrize("recipe,engine_process,expect", [
    (["-r", "tiny-disagg"], "apart", "runtime.engine_process"),  # not one of auto / own / worker
    (["-r", "deepseek-r1-disagg", "-c", "eos"], "own", "runtime.engine_process: a process of its own is for the "
                                                       "torch engine serving text (this recipe: trtllm, text)"),
    (["-r", "tiny-video"], "own", "(this recipe: torch, video_diffusion)"),
])
def test_an_engine_process_of_its_own_is_the_torch_text_engines(recipe, engine_process, expect, capsys):
    from hpc.cli.main import main

    assert main(["validate", *recipe, "--set", f"runtime.engine_process={engine_process}"]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and err.count("\n") == 1, err
    assert main(["validate", "-r", "tiny-disagg", "--set", "runtime.engine_process=own"]) == 0

"""A role's TP / PP / EP against the model's shape (hpc.model.fit), where `hpc validate` and the preflight
can read its config.json: one line before any GPU is spent, not an assertion after the weights loaded."""

from __future__ import annotations

import json

import pytest

from hpc.model.fit import fit_problems, read_model_config
from hpc.cli.main import main

pytestmark = pytest.mark.unit

LLAMA_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32}
DEEPSEEK_R1 = {"num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
               "n_routed_experts": 256}


def _keys(config, backend="trtllm", **args):
    return [key for key, _, _ in fit_problems(config, args, backend)]


def test_the_rules_follow_tensorrt_llms_and_the_reference_engines():
    assert _keys(LLAMA_8B, tensor_parallel_size=8) == []
    assert _keys(LLAMA_8B, tensor_parallel_size=3) == ["tensor_parallel_size"]  # heads % tp
    assert _keys(LLAMA_8B, tensor_parallel_size=3, enable_attention_dp=True) == []  # attention's TP is 1
    assert _keys(LLAMA_8B, tensor_parallel_size=16) == []  # TensorRT-LLM replicates 8 KV heads over 16 ranks
    assert _keys(LLAMA_8B, "torch", tensor_parallel_size=16) == ["tensor_parallel_size"]  # hpc's engine does not
    assert _keys(LLAMA_8B, pipeline_parallel_size=33) == ["pipeline_parallel_size"]
    assert _keys(DEEPSEEK_R1, tensor_parallel_size=16, moe_expert_parallel_size=16) == []
    assert _keys(DEEPSEEK_R1, tensor_parallel_size=12, moe_expert_parallel_size=12, enable_attention_dp=True) == \
        ["moe_expert_parallel_size"]
    assert _keys(DEEPSEEK_R1, tensor_parallel_size=12, moe_expert_parallel_size=12, enable_attention_dp=True,
                 moe_config={"load_balancer": {"num_slots": 264}}) == []  # its slots are spread instead
    nested = {"text_config": {**LLAMA_8B, "num_local_experts": 16}, "vision_config": {"num_attention_heads": 7}}
    assert _keys(nested, tensor_parallel_size=8, moe_expert_parallel_size=8) == []  # Llama 4: the text model's
    (problem,) = fit_problems(LLAMA_8B, {"tensor_parallel_size": 3}, "trtllm")
    assert problem == ("tensor_parallel_size", "TP 3 does not divide the model's 32 attention heads",
                       "use a tensor_parallel_size that divides it, or enable_attention_dp")


def test_only_a_readable_local_config_is_read(tmp_path):
    assert read_model_config("deepseek-ai/DeepSeek-R1") is None  # a hub id: the engine's business
    assert read_model_config(str(tmp_path / "absent")) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert read_model_config(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert read_model_config(str(tmp_path)) == LLAMA_8B


def test_validate_refuses_a_tp_the_models_heads_cannot_split_naming_the_recipe_field(tmp_path, capsys):
    model = tmp_path / "models" / "Llama 8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    sets = ["--set", f"model.path={model}", "--set", "model.generate=null"]
    assert main(["validate", "-c", "generic-h100", "-r", "llama8b-agg", *sets]) == 0
    assert capsys.readouterr().out.splitlines()[1] == \
        f"model: each role's TP/PP/EP fits {model} (32 attention heads, 8 KV heads, 32 layers)"
    assert main(["validate", "-c", "eos", "-r", "deepseek-r1-disagg"]) == 0  # /models is not mounted here
    assert capsys.readouterr().out.splitlines()[1] == \
        "model: /models/DeepSeek-R1/config.json is not readable here; the job's preflight checks it on the nodes"
    assert main(["validate", "-c", "generic-h100", "-r", "llama8b-agg", *sets,
                 "--set", "roles.agg.tensor_parallel_size=3"]) == 2
    err = capsys.readouterr().err
    assert "recipes/llama8b-agg.yaml: roles.agg.tensor_parallel_size: TP 3 does not divide the model's 32 " \
           f"attention heads and 8 KV heads ({model}/config.json) (use a tensor_parallel_size that divides both)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_preflight_checks_the_layout_where_the_job_sees_the_model(tmp_path):
    import datetime as dt

    from hpc.checks.preflight import model_problem
    from hpc.resolve import resolve

    m = json.loads(resolve("eos", "deepseek-r1-mtp").manifest(tmp_path / "run", "run", dt.datetime(2026, 1, 1))
                   .model_dump_json())
    model = tmp_path / "DeepSeek-R1"
    model.mkdir()
    m["recipe"]["model"]["path"] = str(model)
    (model / "config.json").write_text(json.dumps(DEEPSEEK_R1))
    (model / "tokenizer.json").write_text("{}")
    assert model_problem(m) is None  # the shipped layout (TP 16, no attention-DP) fits the real model's shape
    (model / "config.json").write_text(json.dumps({**DEEPSEEK_R1, "num_attention_heads": 120}))  # another model
    assert model_problem(m) == f"agg: tensor_parallel_size: TP 16 does not divide the model's 120 attention heads " \
        f"({model}/config.json); use a tensor_parallel_size that divides it, or enable_attention_dp"


@pytest.mark.parametrize("model_type, refused", [("llava", "LLaVA-NeXT (llava_next), not LLaVA-1.5"),
                                                  ("qwen2_vl", "Qwen2.5-VL and Qwen3-VL off an encode worker"),
                                                  ("llava_next", None), ("qwen2_5_vl", None)])
def test_an_encode_worker_for_a_model_tensorrt_llm_does_not_split(tmp_path, capsys, model_type, refused):
    import datetime as dt

    from hpc.checks.preflight import model_problem
    from hpc.resolve import resolve

    model = tmp_path / "models" / model_type
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": LLAMA_8B}))
    (model / "tokenizer.json").write_text("{}")
    code = main(["validate", "-c", "eos", "-r", "llava-epd", "--set", f"model.path={model}"])
    err = capsys.readouterr().err
    if refused is None:
        assert code == 0, err
    else:
        assert code == 2 and f"recipes/llava-epd.yaml: roles.encode: an encode worker for model_type {model_type}: " \
            f"TensorRT-LLM" in err and refused in err and "serve it aggregated (roles.agg" in err, err
    # the same on the nodes, where the job's preflight reads the model
    m = json.loads(resolve("eos", "llava-epd").manifest(tmp_path / "run", "run", dt.datetime(2026, 1, 1))
                   .model_dump_json())
    m["recipe"]["model"]["path"] = str(model)
    problem = model_problem(m)
    assert (problem is None) if refused is None else (problem.startswith("roles.encode: an encode worker") and
                                                      refused in problem)

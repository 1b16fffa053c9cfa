"""Does a role's parallel layout fit the model's shape? Read from the model's config.json: the attention heads that
tensor parallelism splits, the layers that pipeline stages split, the experts that expert parallelism spreads.

Plain dicts and the standard library only: the preflight runs it inside images that may lack hpc's dependencies,
and `hpc validate` runs it on the login node when that node can read the model's config.json. TensorRT-LLM's
rules, from its PyTorch backend:
- tensorrt_llm/_torch/modules/attention.py, Attention.__init__: with attention-DP the attention's TP is 1, else
  `num_heads % tp_size == 0` is asserted; KV heads are rounded up per rank (replicated), so they need not divide.
- tensorrt_llm/_torch/modules/fused_moe/interface.py, MoE._init_load_balancer: without a load balancer
  `num_experts % ep_size == 0` is asserted (with one, its slots are spread instead).
The torch reference engine (hpc/runtime/engine/models/llama.py) splits the KV heads as well.
"""

from __future__ import annotations

from typing import Any

from hpc.model.info import ModelInfo

# DeepSeek, Qwen3-MoE, and Mixtral / Llama 4 / gpt-oss name their routed experts so
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def is_local_path(value: Any) -> bool:
    """A model reference that names a directory (absolute, ~ or relative with a dot), not a hub id to fetch."""
    return isinstance(value, str) and value.startswith(("/", "~", "."))


def read_model_config(path: str | None) -> dict[str, Any] | None:
    """The model's config.json as a dict, or None when this machine cannot read it (not mounted here, a hub id)."""
    info = ModelInfo.load(path) if path is not None and is_local_path(path) else None
    return None if info is None else dict(info.config)


def language_model(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: LLaVA, Gemma 3 and Llama 4 nest it under text_config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _count(shape: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = shape.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def fit_problems(config: dict[str, Any], args: dict[str, Any], backend: str) -> list[tuple[str, str, str]]:
    """(engine key, problem, fix) for each part of `args`' layout the model cannot take."""
    text = language_model(config)
    heads = _count(text, "num_attention_heads")
    kv_heads = _count(text, "num_key_value_heads")
    layers = _count(text, "num_hidden_layers")
    experts = _count(text, *EXPERT_KEYS)
    tp = args.get("tensor_parallel_size") or 1
    pp = args.get("pipeline_parallel_size") or 1
    ep = args.get("moe_expert_parallel_size") or 1
    balanced = bool((args.get("moe_config") or {}).get("load_balancer"))
    problems = []
    if not isinstance(tp, int) or not isinstance(pp, int) or not isinstance(ep, int):
        return problems
    split = [] if args.get("enable_attention_dp") else [(heads, "attention heads")]
    if backend == "torch":  # the reference engine splits the KV heads too
        split.append((kv_heads, "KV heads"))
    unsplit = [f"{count} {what}" for count, what in split if count and tp > 1 and count % tp]
    if unsplit:
        fix = "use a tensor_parallel_size that divides " + ("it" if len(unsplit) == 1 else "both") + \
            (", or enable_attention_dp" if backend == "trtllm" else "")
        problems.append(("tensor_parallel_size", f"TP {tp} does not divide the model's {' and '.join(unsplit)}",
                         fix))
    if layers and pp > layers:
        problems.append(("pipeline_parallel_size", f"PP {pp} is more stages than the model's {layers} layers",
                         f"use at most {layers} pipeline stages"))
    if experts and ep > 1 and not balanced and experts % ep:
        problems.append(("moe_expert_parallel_size", f"EP {ep} does not divide the model's {experts} experts",
                         "use an expert-parallel size that divides it, or a moe_config.load_balancer"))
    return problems


# Vision models whose encode / prefill / decode split TensorRT-LLM's PyTorch backend cannot run: LLaVA-1.5
# (model_type llava) is no model of that backend (its LLaVA is LLaVA-NeXT, modeling_llava_next.py), and Qwen2-VL
# lacks the @support_multimodal_disaggregated mark that Qwen2.5-VL, Qwen3-VL and LLaVA-NeXT carry
# (modeling_qwen2vl.py). Only models known not to split are named: a newer one is left to its engine.
NO_ENCODE_SPLIT = {
    "llava": "TensorRT-LLM's PyTorch backend serves LLaVA-NeXT (llava_next), not LLaVA-1.5",
    "qwen2_vl": "TensorRT-LLM splits Qwen2.5-VL and Qwen3-VL off an encode worker, not Qwen2-VL",
}


def encode_problem(config: dict[str, Any], backend: str) -> tuple[str, str] | None:
    """(problem, fix) when a recipe's encode role asks TensorRT-LLM for a split this model cannot make."""
    reason = NO_ENCODE_SPLIT.get(str(config.get("model_type", ""))) if backend == "trtllm" else None
    if reason is None:
        return None
    return (f"an encode worker for model_type {config.get('model_type')}: {reason}",
            "serve it aggregated (roles.agg, the worker loads the images) or use a model TensorRT-LLM splits")


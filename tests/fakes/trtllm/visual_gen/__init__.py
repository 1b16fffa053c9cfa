"""Fake of TensorRT-LLM's visual generation package (`visual_gen`), as Dynamo's TensorRT-LLM video worker uses
it (ai-dynamo/dynamo components/src/dynamo/trtllm_diffusion/engine.py): `setup_configs(**dit_configs)` takes the
configuration sections (pipeline, attn, linear, parallel, teacache) before any pipeline loads. Strict: exactly
those sections, each with the keys that engine passes; anything else is a TypeError/KeyError, as a typo would be
upstream. The visual_gen sources themselves were not reachable; the section keys are the ones Dynamo sends."""

from __future__ import annotations

SECTIONS = {
    "pipeline": {"enable_torch_compile", "torch_compile_models", "torch_compile_mode", "fuse_qkv"},
    "attn": {"type"},
    "linear": {"type", "recipe"},
    "parallel": {"disable_parallel_vae", "parallel_vae_split_dim", "dit_dp_size", "dit_tp_size", "dit_ulysses_size",
                 "dit_ring_size", "dit_cp_size", "dit_cfg_size", "dit_fsdp_size", "t5_fsdp_size"},
    "teacache": {"enable_teacache", "use_ret_steps", "teacache_thresh", "ret_steps", "cutoff_steps"},
}
ATTN_TYPES = {"default", "sage-attn", "sparse-videogen", "sparse-videogen2"}
LINEAR_TYPES = {"default", "trtllm-fp8-blockwise", "trtllm-fp8-per-tensor", "trtllm-nvfp4"}
CONFIGS: dict = {}  # what setup_configs was given (the tests read it)


def check_sections(configs: dict) -> None:
    if set(configs) != set(SECTIONS):
        raise TypeError(f"setup_configs() sections {sorted(configs)} != {sorted(SECTIONS)}")
    for name, keys in SECTIONS.items():
        if set(configs[name]) != keys:
            raise KeyError(f"{name}: keys {sorted(configs[name])} != {sorted(keys)}")
    if configs["attn"]["type"] not in ATTN_TYPES or configs["linear"]["type"] not in LINEAR_TYPES:
        raise ValueError("unknown attention or linear type")


def setup_configs(**configs) -> None:
    check_sections(configs)
    CONFIGS.clear()
    CONFIGS.update(configs)

"""Models of real shapes without weight files (`model.generate: llama-8b-shape`): config.json says
hpc_random_weights and the engine makes the weights where it runs, the same on every worker; the tokenizer's
vocabulary is padded to the model's. Checked here on a small shape (the 8B one needs a GPU's memory)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from hpc.runtime.engine.models.llama import LlamaConfig, random_state
from hpc.runtime.engine.models.tiny import LLAMA_8B_SHAPE, build_shaped
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.runtime.frontend.tokenizer import TextCodec

pytestmark = pytest.mark.unit
SMALL = {**LLAMA_8B_SHAPE, "vocab_size": 6000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _greedy(model_dir: str) -> list[int]:
    async def run() -> list[int]:
        async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, {"max_seq_len": 64, "max_batch_size": 2,
                                                                         "dtype": "float32"}) as engine:
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7, 8],
                                  sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            return [t async for out in engine.generate(req) for t in out.token_ids]
    return asyncio.run(run())


def test_weights_made_at_load_are_the_same_everywhere_and_every_id_decodes(tmp_path):
    model = build_shaped(tmp_path / "m", SMALL, seed=9)
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == 6000 and config["hpc_random_weights"] == {"seed": 9}
    assert not list(model.glob("*.safetensors"))  # nothing written but the config and the tokenizer
    first, second = _greedy(str(model)), _greedy(str(model))
    assert first == second and len(first) == 12  # the same seeded weights on every load
    codec = TextCodec(model)
    assert codec.decode([5999]) == "~176f"  # a padded id is a token of its own
    assert codec.encode("def main():") == TextCodec(model).encode("def main():")
    assert max(codec.encode("the quick brown fox " * 20)) < 4096  # padding never changes how text encodes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_weights_are_drawn_in_their_own_dtype_scaled_to_their_fan_in(dtype):
    """Drawn in place (no fp32 draw cast afterwards, whose freed blocks a GPU's allocator kept pinned): each
    weight in the engine's dtype, N(0, 1/fan_in), norms 1, the same from the same seed."""
    cfg = LlamaConfig(**{k: v for k, v in SMALL.items() if k in LlamaConfig.__dataclass_fields__})
    state = random_state(cfg, torch.device("cpu"), dtype, seed=3)
    again = random_state(cfg, torch.device("cpu"), dtype, seed=3)
    assert all(t.dtype == dtype for t in state.values()) and all(torch.equal(state[k], again[k]) for k in state)
    assert not torch.equal(state["lm_head.weight"], random_state(cfg, torch.device("cpu"), dtype, 4)["lm_head.weight"])
    up = state["model.layers.0.mlp.up_proj.weight"].float()  # [128, 64]: fan-in 64
    assert abs(up.std().item() - 64 ** -0.5) < 0.01 and abs(up.mean().item()) < 0.01
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=dtype))


def test_the_8b_shape_is_llama_3_1_8b():
    assert (LLAMA_8B_SHAPE["hidden_size"], LLAMA_8B_SHAPE["num_hidden_layers"], LLAMA_8B_SHAPE["num_attention_heads"],
            LLAMA_8B_SHAPE["num_key_value_heads"], LLAMA_8B_SHAPE["intermediate_size"],
            LLAMA_8B_SHAPE["vocab_size"]) == (4096, 32, 32, 8, 14336, 128256)


def test_the_model_command_offers_every_kind_the_builder_knows():
    from hpc.cli.main import build_parser
    from hpc.runtime.engine.builds import KINDS

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    kind = next(a for a in sub.choices["model"]._actions if a.dest == "kind")
    assert tuple(kind.choices) == KINDS


def test_a_frontend_that_builds_the_model_first_does_so_in_a_child_and_never_imports_torch(tmp_path):
    """ensure_model(apart=True): the frontend may be the job's first process to reach a missing generated model;
    it builds it through `hpc model` in a child (under the same lock), so that it never holds torch itself."""
    import subprocess
    import sys

    target = tmp_path / "m o d e l"
    probe = ("import sys\n"
             "from hpc.runtime.engine.builds import ensure_model\n"
             f"ensure_model({str(target)!r}, 'tiny', True)\n"
             "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False"], out.stdout + out.stderr
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


def test_a_kv_cache_a_gpu_has_no_room_for_is_one_line_naming_what_sizes_it(monkeypatch):
    """The torch engine preallocates (max_batch_size + 1) x max_seq_len positions of KV: checked against the GPU's
    free memory first (here a GPU with 1 GiB free, asked for the 8B shape's 64 x 2,048: 16.25 GiB)."""
    from hpc.runtime.engine.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in LLAMA_8B_SHAPE.items() if k in LlamaConfig.__dataclass_fields__})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30 - 2**20, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**20)  # 1 MiB of it cached, free
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * 2**20)
    with pytest.raises(ValueError) as err:
        model.new_cache(65, 2048, torch.bfloat16, torch.device("cuda:0"))
    assert str(err.value) == ("the KV cache (65 slots of 2048 positions, 16.25 GiB) does not fit in the 1.00 GiB free "
                              "on cuda:0: lower max_batch_size or max_seq_len (a recipe's limits set it), or give the "
                              "worker a GPU of its own")
    cache = model.new_cache(2, 8, torch.float32, torch.device("cpu"))  # a CPU cache is not checked
    assert cache.whole.shape == (32, 2, 2, 8, 8, 128)

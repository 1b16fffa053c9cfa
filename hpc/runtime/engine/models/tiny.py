"""Build the tiny random-weight Llama (and its multimodal variant) with a byte-level BPE tokenizer, offline.

    hpc model tiny --out DIR [--multimodal]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc.model.generated import (LLAMA_8B_SHAPE, TINY_MOE_EXPERTS, TINY_MOE_TOP_K, TINY_SHAPE,  # noqa: F401
                                 build_place_problem)
from hpc.runtime.engine.models.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, VOCAB_SIZE, train_tokenizer  # noqa: F401

SEED = 1234


MOE_EXPERTS, MOE_TOP_K = TINY_MOE_EXPERTS, TINY_MOE_TOP_K


def build_tiny(out_dir: Path, multimodal: bool = False, hidden: int = 128, layers: int = TINY_SHAPE["num_hidden_layers"],
               moe: bool = False) -> Path:
    """`moe`: Mixtral-style sparse experts in place of the dense MLP (for expert parallelism)."""
    from safetensors.torch import save_file

    from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, VisionEncoder, init_weights

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    vision = None
    if multimodal:
        vision = {"image_size": 32, "patch_size": 8, "image_token_id": tok.token_to_id("<|image|>"),
                  "num_image_tokens": 16}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=hidden if moe else hidden * 2 + hidden // 2 * 2,
                      num_hidden_layers=layers, num_attention_heads=TINY_SHAPE["num_attention_heads"],
                      num_key_value_heads=TINY_SHAPE["num_key_value_heads"],
                      bos_token_id=_token_id(tok, "<|begin_of_text|>"),
                      eos_token_id=_token_id(tok, "<|end_of_text|>"), vision=vision,
                      num_local_experts=MOE_EXPERTS if moe else 0, num_experts_per_tok=MOE_TOP_K)
    model = LlamaForCausalLM(cfg)
    init_weights(model, SEED)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"))
    if vision:
        enc = VisionEncoder(hidden, vision["image_size"], vision["patch_size"])
        init_weights(enc, SEED + 1)
        save_file(enc.state_dict(), str(out_dir / "vision.safetensors"))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}))
    # config.json last: its presence marks a complete model for ensure_model.
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return out_dir





def build_shaped(out_dir: Path, shape: dict, seed: int = SEED) -> Path:
    """A model of real shapes without weight files: config.json says `hpc_random_weights`, and the engine makes
    the weights where it runs (seconds on a GPU; 16 GB for the 8B shape would take longer to write than to make).
    The tokenizer is the tiny one's, its vocabulary padded to the model's so every id the model emits decodes."""
    from hpc.runtime.engine.models.llama import LlamaConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    trained = train_tokenizer(out_dir)
    _pad_vocab(out_dir / "tokenizer.json", trained, shape["vocab_size"])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    cfg = LlamaConfig(**shape, bos_token_id=_token_id(tok, "<|begin_of_text|>"),
                      eos_token_id=_token_id(tok, "<|end_of_text|>"))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}))
    (out_dir / "config.json").write_text(json.dumps({**cfg.to_hf(), "hpc_random_weights": {"seed": seed}}, indent=2))
    return out_dir


def _pad_vocab(path: Path, have: int, want: int) -> None:
    """Vocabulary entries `have`..`want`-1 that no merge produces (so encoding is unchanged) and that decode to
    short visible text (so the model's every output id is a token)."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    for i in range(have, want):
        vocab[f"~{i:x}"] = i
    path.write_text(json.dumps(data))


def _token_id(tok: Any, text: str) -> int:
    token_id = tok.token_to_id(text)
    if token_id is None:
        raise ValueError(f"the tiny tokenizer has no {text} token")
    return token_id

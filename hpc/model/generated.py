"""The shapes of the models hpc generates (`model.generate`): what their config.json will say, known before they
are built, so that a layout they cannot take is refused at validate as a real model's is. The builder
(hpc.runtime.engine.models.tiny) makes them from these same numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_MOE_EXPERTS, TINY_MOE_TOP_K = 4, 2
LLAMA_8B_SHAPE = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                  "rope_theta": 500000.0}


def generated_config(kind: str | None) -> dict[str, Any] | None:
    """The layout facts of a generated model's config.json (None: not a language model's, or not generated)."""
    if kind in ("tiny", "tiny-multimodal"):
        return dict(TINY_SHAPE)
    if kind == "tiny-moe":
        return {**TINY_SHAPE, "num_local_experts": TINY_MOE_EXPERTS}
    if kind == "llama-8b-shape":
        return dict(LLAMA_8B_SHAPE)
    return None


def model_cache() -> Path:
    """hpc's own model cache, where the shipped recipes' generated models live."""
    return Path.home() / ".cache" / "hpc" / "models"


def build_place_problem(path: str) -> str | None:
    """Why a generated model may not be built at `path`, or None. hpc builds one in a directory that exists (an
    empty one the user made), in a new one inside a directory that exists, or anywhere under its model cache;
    never a chain of new directories (a typo'd /nonexistent/model made one at the filesystem's root, as root)."""
    where = Path(path).expanduser()
    if where.is_dir() or where.parent.is_dir():
        return None
    cache = model_cache()
    if where == cache or cache in where.parents:
        return None
    missing = next(p for p in [where.parent, *where.parent.parents] if p.parent.is_dir() or p == p.parent)
    return (f"model.path {path}: {missing} does not exist, and hpc builds a generated model only in a directory "
            f"that exists or under {cache}; make the directory (mkdir -p) or fix the path")

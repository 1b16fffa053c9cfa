"""Strict argument classes built from the LLM-API field table transcribed from upstream.

Upstream: tensorrt_llm/llmapi/llm_args.py — every config model derives from StrictBaseModel
(extra='forbid'), and BaseLLM.__init__ (tensorrt_llm/llmapi/llm.py) rejects any kwarg that is not a
field of the args class with `ValueError("<cls> got invalid argument: <key>")`.
The table is hpc's transcription of that file (hpc/data/trtllm-llm-args.json, "source" names the commit).
"""

from __future__ import annotations

import json
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parents[4] / "hpc" / "data" / "trtllm-llm-args.json"


@lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def fields_of(model: str) -> set[str]:
    spec = table()["models"][model]["fields"]
    names = set(spec)
    names |= {f["alias"] for f in spec.values() if f.get("alias")}
    names |= {a for f in spec.values() for a in (f.get("validation_alias") or [])}
    speculative = table()["unions"]["SpeculativeConfig"]["members"]
    for owner, entries in table()["accepted_legacy_keys"].items():  # keys upstream's validators still take
        if owner == model or (owner.startswith("DecodingBaseConfig") and model in speculative):
            names |= {k for k, text in entries.items() if not str(text).startswith("NOT accepted")}
    return names


class StrictConfig:
    """A config object that, like a StrictBaseModel, refuses unknown fields."""

    MODEL = ""

    def __init__(self, **kwargs: Any) -> None:
        valid = fields_of(self.MODEL)
        for key in kwargs:
            if key not in valid:
                raise ValueError(f"1 validation error for {self.MODEL}\n{key}\n  Extra inputs are not permitted")
        self.__dict__.update(kwargs)

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def __repr__(self) -> str:
        return f"{self.MODEL}({self.__dict__})"


def coerce(model: str, cls: type[StrictConfig], value: Any) -> StrictConfig:
    """Pydantic accepts a nested model or a dict for it; anything else is a type error."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise ValueError(f"{model}: expected a {model} or a dict, got {type(value).__name__}")


class CapacitySchedulerPolicy(str, Enum):  # tensorrt_llm/llmapi/llm_args.py
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(str, Enum):  # tensorrt_llm/llmapi/llm_args.py (a StrEnum there)
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"
    FORCE_CHUNK = "FORCE_CHUNK"

"""What a checkpoint directory's config.json says, read once into a typed record for both halves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ModelInfo:
    """`config` is the file as read (empty when there is none); the named fields are the facts hpc reads of it."""

    config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelInfo | None":
        """The directory's config.json; None where there is none or it is not a JSON object (a hub id, a path this
        machine does not mount)."""
        try:
            data = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(MappingProxyType(data)) if isinstance(data, dict) else None

    @classmethod
    def read(cls, model_dir: str | Path) -> "ModelInfo":
        """As load(), with an empty record where the directory says nothing."""
        return cls.load(model_dir) or cls()

    @property
    def vision(self) -> Mapping[str, Any]:
        """hpc's own vision tower (`hpc_vision`, the tiny multimodal model); empty for others."""
        return _mapping(self.config.get("hpc_vision"))

    @property
    def image_size(self) -> int | None:
        size = self.vision.get("image_size")
        return size if isinstance(size, int) else None

    @property
    def random_weights(self) -> Mapping[str, Any]:
        """`hpc_random_weights`: a model of real shapes whose weights the engine draws at load (its seed)."""
        return _mapping(self.config.get("hpc_random_weights"))

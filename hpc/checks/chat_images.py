"""Can an image in a chat request reach this vision model? Where `hpc validate` can read the model's directory:
its chat template must take content parts, or hpc must know the placeholder of its model_type
(hpc/runtime/frontend/chat_content.py). Otherwise every chat with an image, the smoke check's among them, would
be a 400 after the job started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc.model.placeholders import image_placeholder
from hpc.runtime.frontend.chat_content import resolved_format
from hpc.runtime.frontend.tokenizer import find_chat_template


def image_route_problem(tokenizer_dir: Path, model_config: dict[str, Any], chat_template_file: str | None
                        ) -> str | None:
    """Why images cannot reach the model, or None (also when the tokenizer's files are not readable here)."""
    try:
        config = {} if chat_template_file else json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        template = find_chat_template(tokenizer_dir, config if isinstance(config, dict) else {}, chat_template_file)
    except (OSError, ValueError):
        return None  # not readable here: the job reads it where it runs
    if template is None:
        return None  # no chat at all: /v1/completions only, which takes no images
    placeholder = image_placeholder(model_config)
    if placeholder is not None or resolved_format(template, placeholder) == "openai":
        return None
    return (f"images cannot reach this model in chat requests: its chat template prints a message's content as "
            f"text, and hpc does not know the image placeholder of model_type {model_config.get('model_type')!r}")

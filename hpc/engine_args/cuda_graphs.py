"""`cuda_graph_config`: which decode batch sizes are replayed from a CUDA graph.

TensorRT-LLM's meaning (tensorrt_llm/llmapi/llm_args.py, BaseCudaGraphConfig and TorchLlmArgs), which the torch
engine follows too, so one engine config means the same on both engines:

- the key absent: graphs on (TorchLlmArgs' default_factory is CudaGraphConfig()); `null`: off;
- `batch_sizes`: exactly those; otherwise sizes generated up to `max_batch_size` (0: 128);
- `enable_padding`: a batch runs in the smallest graph that holds it; without it, a batch whose size has no
  graph runs eagerly;
- `batch_sizes` and a non-zero `max_batch_size` together must agree (max_batch_size == max(batch_sizes)): the
  model validator raises otherwise, at engine start. We say so before submitting.

Prefill steps have graphs of their own: TensorRT-LLM's `torch_compile_config.enable_piecewise_cuda_graph`
(TorchCompileConfig; off by default) captures context steps by their token count, `capture_num_tokens`, default
1, 2, 4 ... 128 and 256 to 3072 in steps of 256 (docs: features/torch_compile_and_piecewise_cuda_graph.md); a
step pads its tokens up to the next captured count. The torch engine reads the same two fields (it compiles
nothing: attention is inside its graphs, see prefill_graphs); the recipe defaults turn them on for it.

Light (no torch): the launcher validates with it, the engine reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

DEFAULT_MAX_BATCH = 128  # BaseCudaGraphConfig: `self.max_batch_size or 128`
# TorchCompileConfig's capture_num_tokens when none is given (the piecewise CUDA graph guide)
DEFAULT_CAPTURE_NUM_TOKENS = tuple([2 ** i for i in range(8)] + list(range(256, 3073, 256)))
_ENCODE_KEYS = ("num_tokens", "max_num_token", "seq_lens", "max_seq_len")


@dataclass(frozen=True)
class GraphSizes:
    batch_sizes: tuple[int, ...]  # ascending
    padding: bool

    def size_for(self, rows: int) -> int | None:
        """The graph a batch of `rows` runs in; None: it runs eagerly."""
        if self.padding:
            return next((size for size in self.batch_sizes if size >= rows), None)
        return rows if rows in self.batch_sizes else None


def generated_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """BaseCudaGraphConfig._generate_cuda_graph_batch_sizes."""
    if enable_padding:
        sizes = [1, 2, 4] + [i * 8 for i in range(1, 17)]
        while sizes[-1] + 64 <= max_batch_size:
            sizes.append(sizes[-1] + 64)
    else:
        sizes = list(range(1, 32)) + [32, 64, 128]
        sizes += [2 ** i for i in range(8, math.ceil(math.log(max_batch_size, 2)))] if max_batch_size > 1 else []
    sizes = sorted(size for size in sizes if size <= max_batch_size)
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def prefill_graph_tokens(engine_args: Mapping[str, Any], max_num_tokens: int) -> tuple[int, ...] | None:
    """The prefill token counts an engine captures (ascending, none above its per-step budget); None: off."""
    config = engine_args.get("torch_compile_config") or {}
    if not config.get("enable_piecewise_cuda_graph"):
        return None
    counts = config.get("capture_num_tokens") or DEFAULT_CAPTURE_NUM_TOKENS
    kept = tuple(sorted({n for n in counts if 0 < n <= max_num_tokens}))
    return kept or None


def _is_decode(config: Mapping[str, Any]) -> bool:
    """The union's discriminator: a config without `mode` is 'encode' when any encoder field is non-zero."""
    mode = config.get("mode")
    if mode is None:
        return not any(config.get(key) for key in _ENCODE_KEYS)
    return mode == "decode"


def decode_graph_sizes(engine_args: Mapping[str, Any], engine_max_batch: int) -> GraphSizes | None:
    """The decode batch sizes an engine of `engine_max_batch` rows captures; None when graphs are off."""
    if "cuda_graph_config" in engine_args and engine_args["cuda_graph_config"] is None:
        return None
    config = engine_args.get("cuda_graph_config") or {}
    if not _is_decode(config):
        return None
    padding = bool(config.get("enable_padding", False))
    if config.get("batch_sizes"):
        sizes = sorted(set(config["batch_sizes"]))
    else:
        sizes = generated_sizes(int(config.get("max_batch_size") or DEFAULT_MAX_BATCH), padding)
    kept = tuple(size for size in sizes if 0 < size <= engine_max_batch)
    return GraphSizes(kept, padding) if kept else None


def cross_field_problem(config: Any) -> str | None:
    """What TensorRT-LLM's validator would refuse in a `cuda_graph_config` mapping, or None."""
    if not isinstance(config, Mapping) or not config.get("batch_sizes") or not config.get("max_batch_size"):
        return None
    sizes = config["batch_sizes"]
    if not isinstance(sizes, list) or not all(isinstance(s, int) for s in sizes):
        return None  # the type check reports it
    if config["max_batch_size"] != max(sizes):
        return (f"max_batch_size {config['max_batch_size']} must equal max(batch_sizes) = {max(sizes)} when both "
                "are given")
    return None

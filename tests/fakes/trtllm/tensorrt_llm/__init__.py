"""A strict fake of TensorRT-LLM's LLM API for hpc's tests (see tests/fakes/trtllm/README.md)."""

from tensorrt_llm.disaggregated_params import DisaggregatedParams  # noqa: F401
from tensorrt_llm.llmapi.llm import LLM  # noqa: F401
from tensorrt_llm.sampling_params import SamplingParams  # noqa: F401

from tensorrt_llm.version import __version__  # noqa: F401

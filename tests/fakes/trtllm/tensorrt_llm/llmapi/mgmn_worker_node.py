"""Upstream: tensorrt_llm/llmapi/mgmn_worker_node.py — ranks 1.. of a job started by trtllm-llmapi-launch wait in
TensorRT-LLM's MPI worker loop for rank 0's tasks. The fake waits for the end of its step and logs how it ended
(a signal it does not handle would end it silently, as it would the real one)."""

from __future__ import annotations

import os
import signal
import sys

from tensorrt_llm.llmapi.llm import _log


def main() -> int:
    rank = os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    _log("mgmn_worker_start", rank=rank)
    signal.signal(signal.SIGTERM, lambda *_: (_log("mgmn_worker_exit", rank=rank, signal="SIGTERM"), sys.exit(143)))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())

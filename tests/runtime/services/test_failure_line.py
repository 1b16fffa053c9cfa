"""What a component that failed reports in its state: one line, type and message, bounded."""

from __future__ import annotations

import pytest

from hpc.runtime.services.node import failure_line

pytestmark = pytest.mark.unit


def test_a_failure_is_one_line_with_its_type_and_every_line_of_its_message():
    exc = ValueError("1 validation error for LlmArgs\nkv_cache_config.dtype\n  Input should be 'auto' or 'fp8'\n")
    assert failure_line(exc) == ("ValueError: 1 validation error for LlmArgs kv_cache_config.dtype "
                                 "Input should be 'auto' or 'fp8'")
    assert failure_line(RuntimeError()) == "RuntimeError"


def test_a_long_message_is_cut_to_the_limit():
    line = failure_line(MemoryError("CUDA out of memory. " + "Process 1 has 80 GiB memory in use. " * 40))
    assert len(line) == 400 and line.startswith("MemoryError: CUDA out of memory.") and line.endswith("...")

"""Which GPU each worker rank runs on: the plan's own GPUs when the machine has them, a stated fallback when not."""

from __future__ import annotations

import pytest

from hpc.launch.local import gpu_sharing
from hpc.resolve import resolve
from hpc.plan.placement import device_for

pytestmark = pytest.mark.unit


def test_local_disagg_puts_prefill_and_decode_on_their_own_gpus():
    prefill, decode = resolve("local", "tiny-disagg").plan.workers
    assert device_for(prefill, 0, visible=2, whole_node=True) == ("cuda:0", False)
    assert device_for(decode, 0, visible=2, whole_node=True) == ("cuda:1", False)
    assert gpu_sharing([prefill, decode], 2) is None
    # one GPU: both on it, and said so at launch and by the worker
    assert device_for(decode, 0, visible=1, whole_node=True) == ("cuda:0", True)
    note = gpu_sharing([prefill, decode], 1)
    assert "this machine has 1" in note and "prefill-0 -> cuda:0" in note and "decode-0 -> cuda:0" in note
    assert gpu_sharing([prefill, decode], 0) is None  # CPU: nothing to share
    assert device_for(decode, 0, visible=0, whole_node=True) == ("cpu", False)


def test_a_slurm_step_bound_to_its_gpus_uses_their_positions():
    workers = resolve("eos", "tiny-disagg", ["placement=pack"]).plan.workers  # decode-0 after prefill-0
    shared_node = [w for w in workers if w.gpu_offset > 0]
    assert shared_node, [(w.name, w.gpu_offset) for w in workers]
    worker = shared_node[0]
    # Slurm bound this step to the worker's own GPUs: it sees them from 0
    assert device_for(worker, 0, visible=worker.gpus_per_node) == ("cuda:0", False)
    # a step that sees the whole 8-GPU node uses the planned index
    assert device_for(worker, 0, visible=8) == (f"cuda:{worker.ranks[0].gpu}", False)

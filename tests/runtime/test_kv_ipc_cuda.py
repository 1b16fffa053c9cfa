"""The prefill -> decode KV handoff over CUDA IPC: another process's GPU tensor, opened once per allocation and
copied (GPU only)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.kv.cuda_ipc import OpenAllocations
from hpc.runtime.serve.wire import KvMeta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The child shares three KVs one after another, freeing each before making the next (as a prefill worker does
# after each ReleaseKv), then a fourth while the third is still held.
CHILD = """
import sys, msgspec, torch
from hpc.runtime.engine.kv import pack as kv
base = (torch.arange(2 * 2 * 8 * 1600 * 128, device="cuda", dtype=torch.float32) % 251).reshape(2, 2, 8, 1600, 128)
base = base[:, :, :, 1:1537]  # 12.6 MB in bf16: the allocator's large blocks, as a real KV
for i in range(3):
    t = (base + i).contiguous().to(torch.bfloat16)
    torch.cuda.synchronize()
    print("META", msgspec.msgpack.encode(kv.share(t)).hex(), flush=True)
    sys.stdin.readline()  # released
    del t
held = (base + 3).contiguous().to(torch.bfloat16)
other = (base + 4).contiguous().to(torch.bfloat16)
torch.cuda.synchronize()
print("META", msgspec.msgpack.encode(kv.share(other)).hex(), flush=True)
sys.stdin.read()
"""


def _meta(child) -> KvMeta:
    for line in child.stdout:
        if line.startswith("META "):
            return msgspec.msgpack.decode(bytes.fromhex(line.split()[1]), type=KvMeta)
    raise AssertionError("the child exited early")


def test_shared_kvs_arrive_whole_and_a_reused_allocation_is_not_opened_again():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened = OpenAllocations()
    got, metas = [], []
    try:
        for i in range(4):
            meta = _meta(child)
            assert meta.ipc is not None and meta.shape == [2, 2, 8, 1536, 128] and meta.dtype == "torch.bfloat16"
            metas.append(meta)
            (kv,), copied = kvpack.copy_shared([meta], "cuda:0", opened)
            copied.synchronize()  # before the child frees it (the worker releases after this event)
            got.append(kv)
            if i < 3:
                child.stdin.write("released\n")
                child.stdin.flush()
    finally:
        child.stdin.close()
        child.wait(30)
        opened.close()
    base = (torch.arange(2 * 2 * 8 * 1600 * 128, dtype=torch.float32) % 251).reshape(2, 2, 8, 1600, 128)[..., 1:1537, :]
    for i, kv in enumerate(got):
        assert kv.device.type == "cuda" and torch.equal(kv.cpu(), (base + i + (i == 3)).to(torch.bfloat16))
    # the first three lay in one reused allocation of the child's caching allocator: opened once, found after
    handles = [m.ipc.handle for m in metas]
    assert handles[0] == handles[1] == handles[2], "the child's allocator reused the block"
    assert opened.opened == len(set(handles)) < len(handles)  # each allocation opened once, not each handoff


def test_the_bytes_path_agrees():
    want = torch.randn(2, 2, 3, 7, 4).to(torch.bfloat16)
    meta, data = kvpack.pack(want.cuda())
    assert meta.ipc is None and torch.equal(kvpack.unpack(meta, data), want)


def test_a_handoff_does_not_wait_for_the_steps_the_engine_launched():
    # The decode engine's stream has steps queued when a KV arrives. The copy goes on the handoff stream and
    # completes while they still run (on their stream it waited for them: 1-4 ms a handoff); the engine's
    # stream then waits for it on the GPU (kv.arrived), so what it reads next is the whole KV.
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened = OpenAllocations()
    try:
        meta = _meta(child)
        engine_stream = torch.cuda.current_stream()
        torch.cuda._sleep(3_000_000_000)  # about a second and a half of queued work on the engine's stream
        (kv,), copied = kvpack.copy_shared([meta], "cuda:0", opened)
        copied.synchronize()
        busy_after_copy = not engine_stream.query()
        kvpack.arrived(kv)
        total = kv.float().sum()  # on the engine's stream, after the wait
    finally:
        child.stdin.close()
        child.wait(30)
        opened.close()
    assert busy_after_copy, "the copy waited for the engine's stream"
    base = (torch.arange(2 * 2 * 8 * 1600 * 128, dtype=torch.float32) % 251).reshape(2, 2, 8, 1600, 128)[..., 1:1537, :]
    assert torch.equal(kv.cpu(), base.to(torch.bfloat16))
    assert float(total) == float(base.to(torch.bfloat16).float().sum())


def test_a_shared_kv_goes_straight_into_a_cache_slot_and_nowhere_else():
    """kv.copy_shared_into: one 3D copy per KV from another process's memory into one slot of a cache of more
    tokens a slot (its rows of another pitch), on the current stream; the other slots and the slot's tail keep
    what they had."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened = OpenAllocations()
    try:
        meta = _meta(child)  # [2, 2, 8, 1536, 128] bf16
        assert kvpack.fits_slot(meta, torch.empty(2, 2, 3, 8, 2048, 128, dtype=torch.bfloat16))
        whole = torch.full((2, 2, 3, 8, 2048, 128), -1.0, dtype=torch.bfloat16, device="cuda")
        copied = kvpack.copy_shared_into([meta], whole, [1], opened)
        copied.synchronize()
        (kv,), _ = kvpack.copy_shared([meta], "cuda:0", opened)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="does not fit slot 3"):
            kvpack.copy_shared_into([meta], whole, [3], opened)
    finally:
        child.stdin.close()
        child.wait(30)
        opened.close()
    base = (torch.arange(2 * 2 * 8 * 1600 * 128, dtype=torch.float32) % 251).reshape(2, 2, 8, 1600, 128)[..., 1:1537, :]
    got = whole.cpu()
    assert torch.equal(got[:, :, 1, :, :1536], base.to(torch.bfloat16))
    assert torch.equal(kv.cpu(), got[:, :, 1, :, :1536])  # what the buffered path copies
    assert bool((got[:, :, 1, :, 1536:] == -1).all()) and bool((got[:, :, [0, 2]] == -1).all())

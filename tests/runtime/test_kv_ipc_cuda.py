"""The prefill -> decode KV handoff over CUDA IPC: another process's GPU tensor, opened and copied (GPU only)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from hpc.runtime.engine import kv as kvpack
from hpc.runtime.serve.wire import KvMeta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = """
import sys, msgspec, torch
from hpc.runtime.engine import kv
t = torch.arange(2 * 2 * 3 * 5 * 4, device="cuda", dtype=torch.float32).reshape(2, 2, 3, 5, 4)[:, :, :, 1:4]
t = t.contiguous().to(torch.bfloat16)
torch.cuda.synchronize()
print(msgspec.msgpack.encode(kv.share(t)).hex(), flush=True)
sys.stdin.read()
"""


def test_a_shared_kv_arrives_whole_and_the_bytes_path_agrees():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        meta = msgspec.msgpack.decode(bytes.fromhex(child.stdout.readline().strip()), type=KvMeta)
        assert meta.ipc is not None and meta.shape == [2, 2, 3, 3, 4] and meta.dtype == "torch.bfloat16"
        got = kvpack.copy_shared(meta, "cuda:0")
    finally:
        child.stdin.close()
        child.wait(30)
    want = torch.arange(2 * 2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 2, 3, 5, 4)[:, :, :, 1:4].to(torch.bfloat16)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    meta, data = kvpack.pack(want.cuda())
    assert meta.ipc is None and torch.equal(kvpack.unpack(meta, data), want)

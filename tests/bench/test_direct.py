"""benchmarks/_direct.py: the disaggregated stack's engines driven directly, the baseline e2e_throughput.py
compares a disaggregated stack with."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _direct import DirectPair, on_device_apart, pair_devices  # noqa: E402

from hpc.runtime.engine.kv.pack import copy_stream  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.unit

ARGS = {"max_seq_len": 128, "max_batch_size": 4, "dtype": "float32"}  # fp32: greedy tokens compare exactly


@pytest.fixture(scope="module")
def tiny(model_cache) -> str:
    from hpc.runtime.engine.builds import ensure_model

    return str(ensure_model(str(model_cache / "tiny"), "tiny"))


def _request(i: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", token_ids=[5 + i, 6, 7, 8, 9],
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_the_pair_prefills_on_one_engine_and_decodes_on_the_other_as_one_engine_would(tiny):
    import torch

    from hpc.runtime.engine.torch.engine import TorchEngine

    async def tokens(engine, requests) -> list[list[int]]:
        async def one(req):
            got: list[int] = []
            await engine.stream(req, lambda out: got.extend(out.token_ids))
            return got
        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def main():
        requests = [_request(i, 9) for i in range(3)] + [_request(3, 1)]  # the last: its first token only
        # on a machine of two GPUs, a GPU each: the KV crosses from one to the other
        async with DirectPair(Path(tiny), ARGS, pair_devices(torch.cuda.device_count())) as pair:
            assert torch.cuda.device_count() < 2 or (str(pair.prefill.device), str(pair.decode.device)) == (
                "cuda:0", "cuda:1")
            paired = await tokens(pair, requests)
            prefill, decode = pair.prefill.stats(), pair.decode.stats()
            handed = pair.kv_handed_over
        async with TorchEngine(Path(tiny), DisaggregationMode.AGGREGATED, ARGS) as alone:
            single = await tokens(alone, requests)
        return paired, single, prefill, decode, handed

    paired, single, prefill, decode, handed = asyncio.run(main())
    assert [len(t) for t in paired] == [9, 9, 9, 1]
    assert paired == single  # greedy, fp32: the same tokens as one aggregated engine
    # the disaggregated path ran: every prompt prefilled by the prefill engine, which never decoded and holds no
    # KV afterwards (the one-token request's let go); the decode engine took the three KVs it needed and made the
    # other 8 tokens of each
    assert prefill["prefill_steps"] >= 1 and prefill["decode_steps"] == 0 and prefill["handoffs_waiting"] == 0
    assert handed == 3 and decode["prefill_steps"] == 0 and decode["generated_tokens"] == 3 * 8


def test_the_pair_goes_on_two_gpus_when_there_are_two():
    assert pair_devices(2) == ("cuda:0", "cuda:1") and pair_devices(8) == ("cuda:0", "cuda:1")
    assert pair_devices(1) == (None, None) and pair_devices(0) == (None, None)


def test_a_kv_on_the_cpu_or_on_the_decode_device_is_handed_over_as_it_is():
    import torch

    kv = torch.ones(2, 3)
    assert on_device_apart(kv, torch.device("cpu")) is kv


@pytest.mark.gpu
def test_a_kv_crosses_gpus_without_waiting_for_the_prefill_gpus_work():
    """The copy to the decode GPU goes on the handoff streams, not behind what the prefill GPU's current stream
    has queued (its engine's next step, here a 0.5 s sleep kernel): `kv.to()` would wait for it."""
    import time

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    source, target = torch.device("cuda:0"), torch.device("cuda:1")
    kv = torch.arange(1 << 20, dtype=torch.float32, device=source)
    # both GPUs' contexts, their handoff streams and peer access set up first, as a DirectPair's engines have them
    # before their first handoff: on two H200 a process's first cross-GPU copy, set-up included, waited 0.63 s for
    # the source's queued kernel (session 31), where a later copy on the same streams did not wait at all
    on_device_apart(kv, target)
    torch.cuda.synchronize(target)
    torch.cuda.synchronize(source)
    with torch.cuda.device(source):
        torch.cuda._sleep(1_000_000_000)  # the prefill engine's queued step: 0.5 s at an H100's or H200's 1.98 GHz
    t0 = time.perf_counter()
    copied = on_device_apart(kv, target)
    torch.cuda.current_stream(target).wait_stream(copy_stream(target))  # as the decode engine's admission does
    torch.cuda.synchronize(target)
    waited = time.perf_counter() - t0
    torch.cuda.synchronize(source)
    assert copied.device == target and torch.equal(copied.cpu(), kv.cpu())
    assert waited < 0.25, waited  # not behind the 0.5 s on the source's current stream

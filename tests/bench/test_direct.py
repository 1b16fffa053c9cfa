"""benchmarks/_direct.py: the disaggregated stack's engines driven directly, the baseline e2e_throughput.py
compares a disaggregated stack with."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _direct import DirectPair, pair_devices  # noqa: E402

from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.unit

ARGS = {"max_seq_len": 128, "max_batch_size": 4, "dtype": "float32"}  # fp32: greedy tokens compare exactly


@pytest.fixture(scope="module")
def tiny(model_cache) -> str:
    from hpc.runtime.engine.tiny import ensure_model

    return str(ensure_model(str(model_cache / "tiny"), "tiny"))


def _request(i: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", token_ids=[5 + i, 6, 7, 8, 9],
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_the_pair_prefills_on_one_engine_and_decodes_on_the_other_as_one_engine_would(tiny):
    import torch

    from hpc.runtime.engine.torch_engine import TorchEngine

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

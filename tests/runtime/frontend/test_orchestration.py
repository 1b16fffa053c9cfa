"""The frontend's way through prefill and decode, with a router that plays the workers."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.types import DisaggregatedParams, GenerateOutput, GenerateRequest, SamplingParams
from hpc.runtime.frontend.orchestration import Orchestrator
from hpc.runtime.frontend.openai import RouteHints
from hpc.runtime.frontend.router import NotStarted
from hpc.runtime.serve.wire import TrtllmContextParams
from hpc.spec.recipe import Recipe

pytestmark = pytest.mark.unit


class Workers:
    """Each prefill samples another first token (temperature > 0); the first decode worker fails before starting
    (its KV gone with it), so the orchestrator prefills again and the second decode worker runs."""

    def __init__(self) -> None:
        self.first_tokens = iter([5, 9])
        self.decoded: list[GenerateRequest] = []

    async def generate(self, role, request, deadline=None, pools=None, before_next_pool=None):
        if role == "prefill":
            token = next(self.first_tokens)
            t = TrtllmContextParams(first_gen_tokens=[token], prompt_token_ids=list(request.token_ids),
                                    ctx_request_id=token, draft_tokens=[token + 1, token + 2])
            yield GenerateOutput(token_ids=[token], finished=True, disaggregated_params=DisaggregatedParams(
                request_handle="trtllm", prefill_address="p:1", first_token_id=token, prompt_length=3, trtllm=t))
            return
        request = await before_next_pool(NotStarted("decode worker 0 failed before starting"), request)
        self.decoded.append(request)
        yield GenerateOutput(token_ids=[7], finished=True, finish_reason="length")


def test_a_second_prefill_goes_on_from_the_first_token_the_client_already_has():
    recipe = Recipe.model_validate({"name": "t", "model": {"path": "/m", "served_name": "m"}, "backend": "trtllm",
                                    "roles": {"prefill": {}, "decode": {}}})
    workers = Workers()
    orchestrator = Orchestrator(recipe, workers, None, eos_token_id=2, counters={})
    gen = GenerateRequest(request_id="r", token_ids=[11, 12, 13], sampling=SamplingParams(temperature=1.0, max_tokens=4))

    async def main():
        return [out async for out in orchestrator.outputs(gen, RouteHints())]
    outs = asyncio.run(main())
    assert [t for o in outs for t in o.token_ids] == [5, 7]  # the client saw 5 first
    (decode,) = workers.decoded
    params = decode.disaggregated_params
    assert params.first_token_id == 5 and params.trtllm.ctx_request_id == 9  # the second prefill's KV...
    assert params.trtllm.first_gen_tokens == [5] and params.trtllm.draft_tokens is None  # ...from the client's token

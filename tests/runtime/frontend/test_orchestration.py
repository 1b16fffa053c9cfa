"""The frontend's way through prefill and decode, with a router that plays the workers."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.types import DisaggregatedParams, GenerateOutput, GenerateRequest, SamplingParams
from hpc.runtime.frontend.orchestration import Orchestrator
from hpc.runtime.frontend.openai import RouteHints
from hpc.runtime.frontend.router import NotStarted
from hpc.runtime.serve.rpc import KV_GONE, KV_TRANSFER_TIMEOUT, RemoteError
from hpc.runtime.serve.wire import TrtllmContextParams
from hpc.spec.recipe import Recipe

pytestmark = pytest.mark.unit


class Workers:
    """Each prefill samples another first token (temperature > 0); the first decode worker fails before starting
    (its KV gone with it), so the orchestrator prefills again and the second decode worker runs."""

    def __init__(self) -> None:
        self.first_tokens = iter([5, 9])
        self.decoded: list[GenerateRequest] = []

    instances: dict = {}

    async def generate(self, role, request, deadline=None, pools=None, before_next_pool=None, avoid=(), chosen=None):
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


class Instance:
    def __init__(self, role: str) -> None:
        self.role, self.draining = role, False


class Route:
    """Two prefill and two decode workers; transfers prefill/0 -> decode/0 never arrive (the decode's 504, as
    kv_handoff raises it past the deadline); every other pair works. Picks the first instance not avoided."""

    def __init__(self) -> None:
        self.instances = {k: Instance(k.split("/")[0]) for k in ("prefill/0", "prefill/1", "decode/0", "decode/1")}
        self.calls: list[tuple[str, str]] = []
        self.prefill_from: dict[int, str] = {}

    async def generate(self, role, request, deadline=None, pools=None, before_next_pool=None, avoid=(), chosen=None):
        key = sorted(k for k, i in self.instances.items() if i.role == role and k not in avoid)[0]
        if chosen is not None:
            chosen.append(key)
        self.calls.append((role, key))
        if role == "prefill":
            token = 40 + len(self.calls)
            self.prefill_from[token] = key
            yield GenerateOutput(token_ids=[token], finished=True, disaggregated_params=DisaggregatedParams(
                request_handle=f"h{token}", prefill_address=key, first_token_id=token, prompt_length=3))
            return
        prefill = request.disaggregated_params.prefill_address
        if (prefill, key) == ("prefill/0", "decode/0"):
            raise RemoteError(f"the KV transfer from prefill worker {prefill} passed its deadline", KV_TRANSFER_TIMEOUT)
        yield GenerateOutput(token_ids=[7], finished=True, finish_reason="length")


def _pair_recipe(**runtime):
    return Recipe.model_validate({"name": "t", "model": {"path": "/m", "served_name": "m"}, "backend": "torch",
                                  "roles": {"prefill": {"count": 2}, "decode": {"count": 2}}, "runtime": runtime})


def _run(orchestrator, n: int = 1):
    gen = GenerateRequest(request_id="r", token_ids=[11, 12, 13], sampling=SamplingParams(max_tokens=4))

    async def main():
        runs = []
        for _ in range(n):
            runs.append([out async for out in orchestrator.outputs(gen, RouteHints())])
        return runs
    return asyncio.run(main())


def test_a_timed_out_kv_transfer_goes_on_another_pair_and_a_pair_that_keeps_failing_sits_out():
    route, counters = Route(), {}
    clock = [0.0]
    orchestrator = Orchestrator(_pair_recipe(kv_pair_bench_after=2, kv_pair_cooldown_s=30), route, None,
                                eos_token_id=2, counters=counters)
    orchestrator.pairs.clock = lambda: clock[0]
    (outs,) = _run(orchestrator)
    assert [t for o in outs for t in o.token_ids] == [41, 7]  # the client's first token, then the retried decode's
    assert route.calls == [("prefill", "prefill/0"), ("decode", "decode/0"),  # timed out
                           ("prefill", "prefill/1"), ("decode", "decode/1")]  # another pair, both ends
    assert counters["kv_transfer_retries_total"] == 1
    assert orchestrator.pairs.view() == [{"prefill": "prefill/0", "decode": "decode/0", "timeouts": 1,
                                          "in_a_row": 1, "retried": 1, "benched_s": 0.0}]

    route.calls.clear()
    _run(orchestrator)  # the second timeout in a row: the pair sits out
    assert orchestrator.pairs.benched("prefill/0") == {"decode/0"}
    route.calls.clear()
    _run(orchestrator)
    assert route.calls == [("prefill", "prefill/0"), ("decode", "decode/1")]  # not tried on the benched pair
    assert orchestrator.pairs.view()[0]["benched_s"] == 30.0

    clock[0] = 31.0  # the cooldown is over: one request tries the pair again, fails, and it sits out twice as long
    route.calls.clear()
    _run(orchestrator)
    assert ("decode", "decode/0") == route.calls[1]
    assert orchestrator.pairs.view()[0]["benched_s"] == 60.0


def test_with_no_retry_left_the_request_fails_with_the_decodes_504():
    orchestrator = Orchestrator(_pair_recipe(kv_transfer_retries=0), Route(), None, eos_token_id=2, counters={})
    with pytest.raises(RemoteError) as failed:
        _run(orchestrator)
    assert failed.value.code == KV_TRANSFER_TIMEOUT and "prefill/0" in str(failed.value)


class Churn(Route):
    """decode/0 took the KV and died; the router sent the request on to decode/1, whose fetch finds no KV under
    the handle (the prefill's 404): what a kill -9 of a decode worker under load did to clients."""

    async def generate(self, role, request, deadline=None, pools=None, before_next_pool=None, avoid=(), chosen=None):
        if role == "decode" and len(self.calls) == 1:
            chosen.append("decode/1")
            self.calls.append(("decode", "decode/1"))
            raise RemoteError(f"no KV cache waiting under handle {request.disaggregated_params.request_handle!r}",
                              KV_GONE)
        async for out in super().generate(role, request, deadline, pools, before_next_pool, avoid, chosen):
            yield out


def test_a_kv_gone_with_a_dead_decode_worker_is_prefilled_again_not_a_404():
    route, counters = Churn(), {}
    route.instances.pop("prefill/0")  # the one prefill left: the request goes on from its fresh KV
    orchestrator = Orchestrator(_pair_recipe(), route, None, eos_token_id=2, counters=counters)
    (outs,) = _run(orchestrator)
    assert [t for o in outs for t in o.token_ids][1:] == [7]
    assert route.calls[2][0] == "prefill" and counters["kv_gone_retries_total"] == 1
    assert orchestrator.pairs.view() == []  # the pair did nothing wrong

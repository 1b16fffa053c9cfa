"""A request's way through the workers: to an aggregated worker, or a prefill worker's first token and KV handle
and then a decode worker from that KV, within the request's deadline; each disaggregated phase timed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from hpc.runtime.engine.types import DisaggregatedParams, GenerateOutput, GenerateRequest
from hpc.runtime.frontend.openai import RouteHints
from hpc.runtime.frontend.pools import PoolRouter
from hpc.runtime.frontend.router import NotStarted, Router
from hpc.runtime.serve.rpc import RemoteError
from hpc.runtime.serve.wire import replace
from hpc.spec.recipe import Recipe

# a disaggregated request's phases, summed (seconds) in the frontend's counters: the prefill call to its answer,
# that answer to the decode call's start (the first token's delivery), the decode call to its first and last output
DISAGG_PHASES = ("prefill_call_seconds_total", "decode_handover_seconds_total", "decode_first_output_seconds_total",
                 "decode_call_seconds_total")


def continue_from(params: DisaggregatedParams, token: int) -> DisaggregatedParams:
    """A second prefill's handoff, made to go on from the first token the client already has: sampled again
    (temperature > 0) it may differ, and TensorRT-LLM's generation phase starts from first_gen_tokens, not from
    hpc's first_token_id (its draft tokens were drafted after the other token, so they go)."""
    t = params.trtllm
    if t is not None and t.first_gen_tokens[:1] != [token]:
        t = replace(t, first_gen_tokens=[token], draft_tokens=None)
    return replace(params, first_token_id=token, trtllm=t)


class Orchestrator:
    def __init__(self, recipe: Recipe, router: Router, pools: PoolRouter | None, eos_token_id: int | None,
                 counters: dict[str, float]) -> None:
        self.recipe, self.router, self.pools, self.eos_token_id = recipe, router, pools, eos_token_id
        self.phases = counters
        counters.update(dict.fromkeys(DISAGG_PHASES, 0.0), disagg_requests_total=0)

    async def outputs(self, gen: GenerateRequest, hints: RouteHints) -> AsyncIterator[GenerateOutput]:
        """Aggregated, or prefill (first token + KV handle) then decode, all within the request's deadline
        (frontend.request_timeout_s): past it the RPC streams are cancelled, and with them the engines' work.
        With a global router, each step goes to the pool its grid picks (and on to faster pools on failure)."""
        deadline = asyncio.get_running_loop().time() + self.recipe.frontend.request_timeout_s
        pools = self.pools
        isl = len(gen.token_ids)
        if not self.recipe.disaggregated:
            async with contextlib.aclosing(self.router.generate("agg", gen, deadline,
                                                                pools.agg(isl, hints) if pools else None)) as outs:
                async for out in outs:
                    yield out
            return
        prefill_pools = pools.prefill(isl, hints) if pools else None
        phases, began = self.phases, time.perf_counter()
        first = await self._prefill(gen, deadline, prefill_pools)
        answered = time.perf_counter()
        phases["prefill_call_seconds_total"] += answered - began
        token = first.disaggregated_params.first_token_id
        stop = gen.sampling.min_tokens <= 1 and ((token == self.eos_token_id and not gen.sampling.ignore_eos)
                                                 or token in gen.sampling.stop_token_ids)
        done = stop or gen.sampling.max_tokens == 1
        yield GenerateOutput(token_ids=[token], finished=done, prompt_tokens=isl,
                             finish_reason=("stop" if stop else "length") if done else None,
                             logprobs=first.logprobs, cached_tokens=first.cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
        if done:
            return

        async def prefill_again(failure: Exception, decode_req: GenerateRequest) -> GenerateRequest:
            if not isinstance(failure, NotStarted):  # the pool had no worker: the KV still waits where it was
                return decode_req
            # the failed decode worker may have taken the prefilled KV with it: prefill again (the client has the
            # first token already, so the decode goes on from that one)
            again = await self._prefill(gen, deadline, prefill_pools)
            return replace(decode_req, disaggregated_params=continue_from(again.disaggregated_params, token))

        decode_req = replace(gen, disaggregated_params=first.disaggregated_params, image=None, media=None)
        sent = time.perf_counter()
        phases["decode_handover_seconds_total"] += sent - answered
        waiting_first = True
        async with contextlib.aclosing(self.router.generate("decode", decode_req, deadline, pools.decode(
                isl, hints) if pools else None, prefill_again)) as outs:
            async for out in outs:
                if waiting_first or out.finished:
                    got = time.perf_counter() - sent
                    if waiting_first:
                        phases["decode_first_output_seconds_total"] += got
                        waiting_first = False
                    if out.finished:
                        phases["decode_call_seconds_total"] += got
                        phases["disagg_requests_total"] += 1
                yield out

    async def _prefill(self, gen: GenerateRequest, deadline: float, pools: list[str] | None) -> GenerateOutput:
        first: GenerateOutput | None = None
        async for out in self.router.generate("prefill", replace(gen, streaming=False), deadline, pools):
            first = out
        if first is None or first.disaggregated_params is None:
            raise RemoteError("prefill worker returned no KV handle", 502)
        return first

"""A request's way through the workers: to an aggregated worker, or a prefill worker's first token and KV handle
and then a decode worker from that KV, within the request's deadline; each disaggregated phase timed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Set
from typing import AsyncGenerator

from hpc.runtime.engine.types import DisaggregatedParams, FinishReason, GenerateOutput, GenerateRequest
from hpc.runtime.frontend.openai import RouteHints
from hpc.runtime.frontend.pairs import PairHealth
from hpc.runtime.frontend.pools import PoolRouter
from hpc.runtime.frontend.router import NotStarted, Router
from hpc.runtime.serve.rpc import KV_GONE, KV_TRANSFER_TIMEOUT, RemoteError
from hpc.runtime.serve.wire import replace
from hpc.spec.recipe import Recipe

log = logging.getLogger(__name__)

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
        counters.update(dict.fromkeys(DISAGG_PHASES, 0.0), disagg_requests_total=0, kv_transfer_retries_total=0,
                        kv_gone_retries_total=0)
        runtime = recipe.runtime
        self.pairs = PairHealth(runtime.kv_pair_bench_after, runtime.kv_pair_cooldown_s)

    async def outputs(self, gen: GenerateRequest, hints: RouteHints) -> AsyncGenerator[GenerateOutput, None]:
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
        first_chosen: list[str] = []
        first, handoff = await self._prefill(gen, deadline, prefill_pools, chosen=first_chosen)
        answered = time.perf_counter()
        phases["prefill_call_seconds_total"] += answered - began
        token = handoff.first_token_id
        stop = gen.sampling.min_tokens <= 1 and ((token == self.eos_token_id and not gen.sampling.ignore_eos)
                                                 or token in gen.sampling.stop_token_ids)
        done = stop or gen.sampling.max_tokens == 1
        yield GenerateOutput(token_ids=[token], finished=done, prompt_tokens=isl,
                             finish_reason=(FinishReason.STOP if stop else FinishReason.LENGTH) if done else None,
                             logprobs=first.logprobs, cached_tokens=first.cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
        if done:
            return

        phases["decode_handover_seconds_total"] += time.perf_counter() - answered
        decode_req = replace(gen, disaggregated_params=handoff, image=None, media=None)
        async with contextlib.aclosing(self._decode(gen, decode_req, token, (first_chosen or [""])[-1], deadline,
                                                    prefill_pools, pools.decode(isl, hints) if pools else None)) as outs:
            async for out in outs:
                yield out

    async def _decode(self, gen: GenerateRequest, decode_req: GenerateRequest, token: int, prefill_key: str,
                      deadline: float, prefill_pools: list[str] | None,
                      decode_pools: list[str] | None) -> AsyncGenerator[GenerateOutput, None]:
        """The decode from the prefill's KV; a transfer past its deadline goes on another pair (kv_transfer_retries),
        and a pair whose transfers keep timing out sits out (frontend/pairs.py)."""
        phases = self.phases

        async def fresh_kv(decode_req: GenerateRequest, avoid: Set[str] = frozenset()) -> tuple[str, GenerateRequest]:
            """Prefill again (on a worker not in `avoid` where one is left): the client has the first token already,
            so the decode goes on from that one. (the prefill worker, the decode request)"""
            picked: list[str] = []
            _, again = await self._prefill(gen, deadline, prefill_pools, self._avoid("prefill", avoid), picked)
            return (picked or [prefill_key])[-1], replace(decode_req, disaggregated_params=continue_from(again, token))

        async def prefill_again(failure: Exception, decode_req: GenerateRequest) -> GenerateRequest:
            if not isinstance(failure, NotStarted):  # the pool had no worker: the KV still waits where it was
                return decode_req
            return (await fresh_kv(decode_req))[1]  # the failed decode worker may have taken the KV with it

        timed_out: set[str] = set()
        for attempt in range(self.recipe.runtime.kv_transfer_retries + 1):
            chosen: list[str] = []
            sent, waiting_first = time.perf_counter(), True
            try:
                async with contextlib.aclosing(self.router.generate(
                        "decode", decode_req, deadline, decode_pools, prefill_again,
                        self._avoid("decode", self.pairs.benched(prefill_key), timed_out), chosen)) as outs:
                    async for out in outs:
                        if waiting_first or out.finished:
                            got = time.perf_counter() - sent
                            if waiting_first:
                                phases["decode_first_output_seconds_total"] += got
                                if chosen:
                                    self.pairs.succeeded(prefill_key, chosen[-1])
                                waiting_first = False
                            if out.finished:
                                phases["decode_call_seconds_total"] += got
                                phases["disagg_requests_total"] += 1
                        yield out
                return
            except RemoteError as exc:
                # the KV did not arrive in time (the pair's route is at fault, not the request), or it is gone (a
                # decode worker that took it died, and the router sent the request on to another): the client has
                # the first token only, so a fresh prefill and another decode go on from it
                if exc.code not in (KV_TRANSFER_TIMEOUT, KV_GONE) or not waiting_first or not chosen:
                    raise
                if exc.code == KV_GONE:
                    if attempt == self.recipe.runtime.kv_transfer_retries:
                        raise
                    phases["kv_gone_retries_total"] += 1
                    prefill_key, decode_req = await fresh_kv(decode_req)
                    continue
                last = attempt == self.recipe.runtime.kv_transfer_retries or not self._another_pair(
                    prefill_key, timed_out | {chosen[-1]})
                if self.pairs.failed(prefill_key, chosen[-1], retried=not last):
                    log.warning("KV transfers %s -> %s keep passing their deadline: the pair leaves routing for "
                                "%.0f s", prefill_key, chosen[-1], self.pairs.pairs[(prefill_key, chosen[-1])].cooldown_s)
                if last:
                    raise
                timed_out.add(chosen[-1])
                phases["kv_transfer_retries_total"] += 1
                prefill_key, decode_req = await fresh_kv(decode_req, {prefill_key})

    def _another_pair(self, prefill: str, decodes_failed: set[str]) -> bool:
        """Whether a pair other than the ones that timed out is live: another prefill, or another decode."""
        live = [(key, inst.role) for key, inst in self.router.instances.items() if not inst.draining]
        return any(role == "prefill" and key != prefill or role == "decode" and key not in decodes_failed
                   for key, role in live)

    def _avoid(self, role: str, rather_not: Set[str], never: Set[str] = frozenset()) -> set[str]:
        """Instances of `role` to leave out: `never` and `rather_not`, unless that leaves none of the live ones, then
        `never` alone, unless that leaves none either (trying the one there is beats failing without trying)."""
        live = {key for key, inst in self.router.instances.items() if inst.role == role and not inst.draining}
        for avoid in (set(rather_not) | set(never), set(never)):
            if live - avoid:
                return avoid
        return set()

    async def _prefill(self, gen: GenerateRequest, deadline: float, pools: list[str] | None,
                       avoid: Set[str] = frozenset(),
                       chosen: list[str] | None = None) -> tuple[GenerateOutput, DisaggregatedParams]:
        first: GenerateOutput | None = None
        async for out in self.router.generate("prefill", replace(gen, streaming=False), deadline, pools,
                                              avoid=avoid, chosen=chosen):
            first = out
        if first is None or first.disaggregated_params is None:
            raise RemoteError("prefill worker returned no KV handle", 502)
        return first, first.disaggregated_params

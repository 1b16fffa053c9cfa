"""Routes of the frontend and the prefill -> decode orchestration."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncGenerator, NamedTuple

from pydantic import ValidationError

from hpc.manifest import Manifest
from hpc.runtime.engine.types import FinishReason, GenerateRequest, SamplingParams, TokenLogprob
from hpc.runtime.frontend.openai import (MAX_CHOICES, REQUEST_ID_HEADER, ApiError, ChatRequest, CompletionRequest,
                                         LogprobRow, chat_logprobs, check_fields, completion_logprobs, field_error,
                                         merged_completions, new_id, now, upstream_error)
from hpc.runtime.frontend.parsers import AnswerParser, json_answer_guide, tool_call_guide
from hpc.runtime.frontend.chat_content import ChatInputError, template_kwargs, template_messages
from hpc.runtime.frontend.group import FrontendGroup, health_status, live_counts
from hpc.runtime.frontend.pools import PoolRouter
from hpc.runtime.frontend.orchestration import Orchestrator
from hpc.runtime.frontend.router import NoInstance, Router
from hpc.runtime.frontend.tokenizer import Detokenizer, StopStrings, TextCodec
from hpc.runtime.serve.http import Request, Response, json_dumps, json_loads, json_response
from hpc.runtime.serve.metrics import LatencyHistograms, prometheus, prometheus_family
from hpc.runtime.serve.tasks import all_or_first_failure
from hpc.runtime.serve.rpc import PeerGone, RemoteError
from hpc.runtime.services.node import GcClock, IdleSpin, LoopLatency
from hpc.runtime.serve.wire import Guide, GuidePiece, replace

log = logging.getLogger("hpc.runtime.frontend")
WHOLE_REQUEST_RETRIES = 1  # non-streamed requests whose worker died midway


class Frontend:
    def __init__(self, manifest: Manifest, router: Router, codec: TextCodec) -> None:
        self.manifest = manifest
        self.recipe = manifest.recipe
        self.router = router
        self.pools = PoolRouter.from_recipe(self.recipe.frontend.global_router)
        self.codec = codec
        self.model_name = self.recipe.model.served_name
        self.expected = {role.value: spec.total_count for role, spec in self.recipe.roles.items()}
        self.counters: dict[str, float] = {"requests_total": 0, "errors_total": 0, "inflight": 0, "timeouts_total": 0,
                                           "retried_total": 0, "completion_tokens_total": 0,
                                           "prompt_tokens_total": 0}
        self.orchestrator = Orchestrator(self.recipe, router, self.pools, codec.eos_token_id, self.counters)
        self.created = now()
        # Which backend and run produced an answer (OpenAI: changes when the serving configuration changes).
        self.fingerprint = f"hpc-{self.recipe.backend.value}-{manifest.run_id}"[:64]
        self.latency = LatencyHistograms("hpc_frontend", {"model": self.model_name})
        self.routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/live"): self.live,
            ("GET", "/metrics"): self.metrics,
        }
        self.group: FrontendGroup | None = None  # several processes on the port: /health, /metrics for all
        self.gc_clock: GcClock | None = None  # a served frontend's process (watch_gc)
        self.loop_latency: LoopLatency | None = None  # and its event loop's
        self.idle_spin: IdleSpin | None = None  # and its spins after a request's start and end
        self.videos = None
        if self.recipe.modality == "video_diffusion":  # seed 004: the videos API
            from hpc.runtime.frontend.videos import VideoService

            self.videos = VideoService(self)
            self.routes[("POST", "/v1/videos")] = self.videos.create
            self.routes[("GET", "/v1/videos")] = self.videos.list

    async def handle(self, req: Request) -> Response:
        route = self.routes.get((req.method, req.path))
        if route is None and req.method == "GET" and req.path.startswith("/v1/models/"):
            return self.model(req.path[len("/v1/models/"):])
        if route is None and req.method == "GET" and req.path.startswith("/v1/videos/") and self.videos:
            return self.videos.get(req.path[len("/v1/videos/"):])
        if route is None:
            allowed = [m for (m, p) in self.routes if p == req.path]
            status = 405 if allowed else 404
            return ApiError(status, f"{req.method} {req.path} is not served here").response()
        if self.videos is not None and req.path in ("/v1/completions", "/v1/chat/completions"):
            return ApiError(400, f"{self.model_name} makes videos: POST /v1/videos").response()
        try:
            return await route(req)
        except ApiError as exc:
            self.counters["errors_total"] += 1
            if exc.status < 500:  # the client's mistake, one bounded line (a 5xx was logged where it failed)
                log.info("%s %s -> %d %s param=%s: %s", req.method, req.path[:80], exc.status,
                         exc.request_id or "-", (exc.param or "-")[:64], exc.message[:200])
            return exc.response()

    # ---- info routes -----------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "hpc"}

    async def models(self, req: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    def model(self, model_id: str) -> Response:
        """GET /v1/models/{id}: the served name may contain '/' (hpc/tiny), so the rest of the path is the id."""
        from urllib.parse import unquote

        if unquote(model_id) != self.model_name:
            return ApiError(404, f"model '{unquote(model_id)[:200]}' does not exist; this server serves "
                                 f"'{self.model_name}'", param="model", code="model_not_found").response()
        return json_response(self._model_card())

    def instance_table(self) -> dict[str, list[dict[str, Any]]]:
        table: dict[str, list[dict[str, Any]]] = {role: [] for role in self.expected}
        for inst in self.router.instances.values():
            table.setdefault(inst.role, []).append({"index": inst.index, "pool": inst.pool or None,
                                                    "instance_id": inst.instance_id,
                                                    "address": inst.address, "node": inst.node,
                                                    "draining": inst.draining,
                                                    "routed": self.router.routed.get(inst.key, 0)})
        return table

    def router_view(self) -> dict[str, Any]:
        """The policy, and for kv_aware how much of the prompts' prefixes the chosen workers held."""
        view: dict[str, Any] = {"policy": self.router.policy.value}
        if self.router.kv is not None:
            blocks, kv = self.router.kv_blocks, self.router.kv
            view.update(stale=kv.stale, events=kv.events, prompt_blocks=blocks["prompt"],
                        cached_blocks=blocks["overlap"], indexed_blocks=kv.indexed, resyncs=kv.resyncs)
        if self.pools is not None:
            view["pools"] = self.pool_view()
        if self.recipe.disaggregated:  # KV transfers that passed their deadline, by pair (frontend/pairs.py)
            view["kv_pairs"] = [{**pair, "prefill": pair["prefill"].replace("/", "-"),
                                 "decode": pair["decode"].replace("/", "-")}
                                for pair in self.orchestrator.pairs.view()]
        return view

    def pool_view(self) -> list[dict[str, Any]]:
        """Per pool: live workers, requests routed there, those that moved on, and why the pools were chosen."""
        rows = []
        if self.pools is None:
            return rows
        for kind in self.pools.config.kinds():
            for pool in self.pools.config.pools(kind):
                reasons = {r: n for (k, p, r), n in self.pools.decisions.items() if (k, p) == (kind, pool)}
                rows.append({"role": kind, "pool": pool,
                             "live": sum(1 for i in self.router.live(kind) if i.pool == pool),
                             "routed": self.router.pool_routed.get((kind, pool), 0),
                             "retried_away": self.router.pool_retried.get((kind, pool), 0),
                             "chosen_by": reasons})
        return rows

    def health_view(self) -> dict[str, Any]:
        """This process's view: the workers it can route to, and how the router chose."""
        table = self.instance_table()
        live = live_counts(table)
        return {"status": health_status(live, self.expected), "model": self.model_name, "expected": self.expected,
                "live": live, "instances": table, "router": self.router_view()}

    async def health(self, req: Request) -> Response:
        view = await self.group.health() if self.group is not None else self.health_view()
        return json_response(view, 503 if view["status"] == "unhealthy" else 200)

    async def live(self, req: Request) -> Response:
        return json_response({"status": "live"})

    async def metrics(self, req: Request) -> Response:
        body = await self.group.metrics() if self.group is not None else self.metrics_text()
        return Response(body=body, content_type="text/plain; version=0.0.4")

    def metrics_text(self) -> bytes:
        """This process's counters and latency histograms (a group merges those of all its processes)."""
        values = dict(self.counters)
        if self.gc_clock is not None:
            values.update(self.gc_clock.stats(""))
        if self.loop_latency is not None:
            values.update(self.loop_latency.stats(""))
        if self.idle_spin is not None:
            values.update(self.idle_spin.stats(""))
        if self.videos is not None:
            values.update(self.videos.counters)
        for role in self.expected:
            values[f"{role}_instances"] = len(self.router.live(role))
            values[f"{role}_draining_instances"] = len(self.router.draining(role))
            values[f"{role}_routed_total"] = self.router.served.get(role, 0)
        for key, count in sorted(self.router.routed.items()):  # per instance: is the spread what the policy says?
            values[f"routed_{key.replace('/', '_')}_total"] = count
        if self.router.kv is not None:  # kv_aware: how much of the prompts' prefixes the chosen workers held
            values["kv_prompt_blocks_total"] = self.router.kv_blocks["prompt"]
            values["kv_overlap_blocks_total"] = self.router.kv_blocks["overlap"]
            values["kv_events_total"] = self.router.kv.events
            values["kv_index_stale"] = int(self.router.kv.stale)
        body = prometheus("hpc_frontend", values, {"run": self.manifest.run_id})
        if self.pools is not None:  # per pool, labelled: routed, moved on (retry), and each decision reason
            rows = self.pool_view()
            labels = [{"run": self.manifest.run_id, "role": r["role"], "pool": r["pool"]} for r in rows]
            for name, field in (("routed_total", "routed"), ("retried_away_total", "retried_away"),
                                ("live", "live")):
                body += prometheus_family(f"hpc_frontend_pool_{name}",
                                          [(lb, r[field]) for lb, r in zip(labels, rows)])
            body += prometheus_family("hpc_frontend_pool_decisions_total", [
                ({**lb, "reason": reason}, n) for lb, r in zip(labels, rows)
                for reason, n in sorted(r["chosen_by"].items())])
        if self.recipe.disaggregated:
            pairs = self.router_view()["kv_pairs"]
            labels = [{"run": self.manifest.run_id, "prefill": p["prefill"], "decode": p["decode"]} for p in pairs]
            body += prometheus_family("hpc_frontend_kv_pair_timeouts_total",
                                      [(lb, p["timeouts"]) for lb, p in zip(labels, pairs)])
            body += prometheus_family("hpc_frontend_kv_pair_benched",
                                      [(lb, int(p["benched_s"] > 0)) for lb, p in zip(labels, pairs)])
        return body + self.latency.exposition()

    # ---- generation routes -----------------------------------------------------------------------
    def _parse(self, req: Request, model: type) -> Any:
        try:
            data = json_loads(req.body)
        except ValueError:
            raise ApiError(400, "request body is not valid JSON") from None
        except RecursionError:  # the parser's own depth limit: refused, never a 500
            raise ApiError(400, "request body nests too deeply to be a request") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        check_fields(data, model, tool_parser=self.recipe.model.tool_call_parser is not None)
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            param, message = field_error(exc.errors())
            raise ApiError(400, message[:500], param=param[:200]) from None
        problem = parsed.problem()
        if problem is not None:
            raise ApiError(400, f"{problem[0]}: {problem[1]}", param=problem[0])
        if parsed.model != self.model_name:
            asked = parsed.model if len(parsed.model) <= 80 else parsed.model[:80] + f"... ({len(parsed.model)} chars)"
            raise ApiError(404, f"model {asked!r} does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return parsed

    def _build(self, body: Any, ids: list[int], max_tokens: int | None, image: str | None,
               default_max_tokens: int = 16, guide: list[GuidePiece] | None = None) -> GenerateRequest:
        ids = self.codec.expand_image_tokens(ids)
        limits = self.recipe.limits
        if not ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(ids) > limits.max_input_tokens:
            raise ApiError(400, f"prompt has {len(ids)} tokens; the limit is {limits.max_input_tokens}",
                           param="prompt", code="context_length_exceeded")
        wanted = max_tokens or default_max_tokens
        if wanted > limits.max_output_tokens:
            raise ApiError(400, f"max_tokens {wanted} exceeds the limit {limits.max_output_tokens}",
                           param="max_tokens")
        if body.min_tokens > wanted:
            raise ApiError(400, f"min_tokens {body.min_tokens} exceeds max_tokens {wanted}", param="min_tokens")
        sampling = SamplingParams(max_tokens=wanted, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos,
                                  min_tokens=body.min_tokens,
                                  stop=body.stop_strings, logprobs=body.logprob_count,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty,
                                  guide=Guide(pieces=guide) if guide else None)
        # the response's id: the workers' logs name a request as the client's x-request-id does
        return GenerateRequest(request_id=new_id("chatcmpl" if isinstance(body, ChatRequest) else "cmpl"),
                               token_ids=ids, sampling=sampling, streaming=body.stream, image=image)

    async def completions(self, req: Request) -> Response:
        body: CompletionRequest = self._parse(req, CompletionRequest)
        prompts = body.prompts
        if body.max_tokens == 0 and body.stream:
            raise ApiError(400, "max_tokens 0 scores the prompt; that answer is not streamed", param="stream")
        if len(prompts) == 1:
            return await self._respond(body, *await self._completion(body, prompts[0]), chat=False)
        if body.stream:
            raise ApiError(400, f"{len(prompts)} prompts are answered in one response, not streamed; stream them "
                                "one a request", param="stream")
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n {body.n} choices; at most {MAX_CHOICES}", param="n")
        built = [await self._completion(body, p) for p in prompts]  # every prompt checked before any runs
        answers = await all_or_first_failure(self._answer(body, gen, chat=False, echo=echo) for gen, echo in built)
        merged = json_response(merged_completions(answers, body.n))
        merged.headers[REQUEST_ID_HEADER] = answers[0]["id"]
        return merged

    async def _completion(self, body: CompletionRequest, prompt: str | list[int]) -> tuple[GenerateRequest, str]:
        """One prompt's engine request, and the text an echo puts before its answer."""
        if isinstance(prompt, str):
            ids = await self._encode(prompt)
        else:
            ids = list(prompt)
            if any((not isinstance(t, int)) or not 0 <= t < 2**31 for t in ids):
                raise ApiError(400, "prompt token ids must be integers from 0 to 2^31 - 1", param="prompt")
        guide = json_answer_guide(None) if body.json_object else None
        # max_tokens 0: the engines generate one token, which the answer leaves out (_answer)
        gen = self._build(body, ids, 1 if body.max_tokens == 0 else body.max_tokens, None, guide=guide)
        if body.echo and body.logprobs is not None:  # the echoed prompt comes with its own logprobs
            gen = replace(gen, sampling=replace(gen.sampling, prompt_logprobs=body.logprobs))
        return gen, (prompt if isinstance(prompt, str) else self.codec.decode(ids)) if body.echo else ""

    async def chat(self, req: Request) -> Response:
        body: ChatRequest = self._parse(req, ChatRequest)
        try:
            messages, images = template_messages(body.messages, self.codec.message_content,
                                                 self.recipe.model.multimodal)
            variables = template_kwargs(body.chat_template_kwargs, body.reasoning_effort, self.codec.template_variables)
        except ChatInputError as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
        if len(images) > 1:
            raise ApiError(400, "at most one image per request is supported", param="messages")
        try:
            tools = body.tool_dicts()
            prompt = self.codec.apply_chat_template(messages, tools, variables)
        except Exception as exc:
            raise ApiError(400, f"chat template failed: {exc}", param="messages") from None
        model = self.recipe.model
        try:
            forced = body.forced_tool_names() if tools else None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tool_choice") from None
        # tools come only with a tool_call_parser (check_fields refuses them without one)
        guide = tool_call_guide(model.reasoning_parser, model.tool_call_parser, forced) \
            if forced and model.tool_call_parser else \
            json_answer_guide(model.reasoning_parser) if body.json_object else None
        # OpenAI's chat has no small default length: up to the model's limit (completions keep 16)
        gen = self._build(body, await self._encode(prompt, "messages"),
                          body.max_completion_tokens or body.max_tokens,
                          images[0] if images else None, default_max_tokens=self.recipe.limits.max_output_tokens,
                          guide=guide)
        parsing = (model.reasoning_parser, model.tool_call_parser if tools else None)
        return await self._respond(body, gen, chat=True, parsing=parsing if any(parsing) else None)

    def _timed_out(self) -> ApiError:
        self.counters["timeouts_total"] += 1
        return ApiError(504, f"the request took longer than request_timeout_s "
                             f"({self.recipe.frontend.request_timeout_s:g} s); its engine work was cancelled",
                        "timeout", code="timeout")

    async def _encode(self, text: str, param: str = "prompt") -> list[int]:
        """Bound, then tokenize: a prompt with more characters than its token limit can hold is refused before
        any work; a long one goes to a thread that lets go of the GIL (encode_bounded), so the event loop keeps
        serving everyone else meanwhile. `param`: what a refusal names (a chat's messages, rendered)."""
        limit = self.recipe.limits.max_input_tokens
        if len(text) > self.codec.most_chars(limit):
            raise ApiError(400, f"prompt has {len(text):,} characters, more than {limit} tokens can hold (at most "
                                f"{self.codec.max_token_chars} characters a token); the limit is {limit} tokens",
                           param=param, code="context_length_exceeded")
        if len(text) < OFF_LOOP_CHARS:
            return self.codec.encode(text)
        ids = await asyncio.to_thread(self.codec.encode_bounded, text, limit)
        if isinstance(ids, int):
            raise ApiError(400, f"prompt has {ids} tokens; the limit is {limit}", param=param,
                           code="context_length_exceeded")
        return ids

    async def _events(self, body: Any, gen: GenerateRequest) -> AsyncGenerator[Piece, None]:
        """Text deltas with their finish reason, the tokens so far and the logprobs of the tokens they carry,
        honouring stop strings (text that may start one is held back until it cannot)."""
        detok, text = Detokenizer(self.codec), StopStrings(body.stop_strings)
        tokens = 0
        pending: list[TokenLogprob] = []
        cached = 0
        prompt: list[TokenLogprob] | None = None
        reason: str | None = None
        clock = self.latency.start()
        try:
            async with contextlib.aclosing(self.orchestrator.outputs(gen, body.route_hints)) as outputs:
                async for out in outputs:
                    if reason:  # nothing comes after a request's last output; the loop ends, no generator closed
                        continue
                    if out.token_ids:
                        clock.tokens(len(out.token_ids))
                    tokens += len(out.token_ids)
                    cached = max(cached, out.cached_tokens)
                    prompt = out.prompt_logprobs or prompt
                    pending += out.logprobs or []
                    reason = out.finish_reason if out.finished else None
                    delta, stopped = text.feed(detok.add(out.token_ids), final=reason is not None)
                    if stopped:
                        yield Piece(delta, "stop", tokens, pending, cached, prompt)
                        return
                    if delta or reason:
                        yield Piece(delta, _reason(reason) if reason else None, tokens, pending, cached, prompt)
                        pending = []
        finally:
            clock.end()

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.recipe.backend.value != "trtllm":  # what the reference engines reused from their prefix cache
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _samples(self, body: Any, gen: GenerateRequest) -> list[GenerateRequest]:
        """`n` independent requests (seeded seed, seed+1, ... when a seed was given)."""
        if body.n == 1:
            return [gen]
        seed = gen.sampling.seed
        return [replace(gen, request_id=f"{gen.request_id}-{i}",
                        sampling=replace(gen.sampling, seed=None if seed is None else (seed + i) % 2**63))
                for i in range(body.n)]

    def _logprobs(self, chat: bool, entries: list[TokenLogprob], offset: int,
                  prompt: tuple[int, list[TokenLogprob]] | None = None) -> dict[str, Any]:
        """`prompt` (echo): the prompt's first token and the logprobs of the rest, rows before the answer's."""
        raw = self.codec.token_bytes

        def rows_of(items: list[TokenLogprob]) -> list[LogprobRow]:
            return [(raw(e.token_id), e.logprob, [(raw(t), lp) for t, lp in zip(e.top_ids, e.top_logprobs)])
                    for e in items]
        rows = rows_of(entries)
        if prompt is not None:
            first: LogprobRow = (raw(prompt[0]), None, None)
            rows = [first] + rows_of(prompt[1]) + rows
        return chat_logprobs(rows) if chat else completion_logprobs(rows, offset)

    async def _collect(self, body: Any, gen: GenerateRequest) -> tuple[str, str | None, int, list[TokenLogprob],
                                                                     int, list[TokenLogprob] | None]:
        for attempt in range(1 + WHOLE_REQUEST_RETRIES):
            text, reason, tokens, logprobs, cached, prompt = "", None, 0, [], 0, None
            try:
                async for piece in self._events(body, gen):
                    text += piece.delta
                    reason = piece.reason or reason
                    tokens = piece.tokens
                    logprobs += piece.logprobs
                    cached = piece.cached
                    prompt = piece.prompt or prompt
                return text, reason, tokens, logprobs, cached, prompt
            except PeerGone:
                # A worker died mid-request. The client has seen nothing of a non-streamed answer, so run it
                # again from the start on the workers that are left (the router no longer routes to the dead).
                if attempt == WHOLE_REQUEST_RETRIES:
                    raise
                self.counters["retried_total"] += 1
        raise AssertionError("unreachable")

    async def _respond(self, body: Any, gen: GenerateRequest, echo: str = "", *, chat: bool,
                       parsing: tuple[str | None, str | None] | None = None) -> Response:
        if body.stream:
            self.counters["requests_total"] += 1
            self.counters["prompt_tokens_total"] += len(gen.token_ids)
            # The headers wait for the stream's first event: a request that fails before it (no live worker, every
            # worker failing before its first token, its deadline) is an HTTP status that clients and load
            # balancers act on (503 with Retry-After, 504), not a 200 whose body is an error event.
            events = self._sse(body, gen, chat, gen.request_id, parsing, echo)
            first = await anext(events, b"")
            return Response(content_type="text/event-stream", stream=_after(first, events),
                            headers={REQUEST_ID_HEADER: gen.request_id})
        answer = json_response(await self._answer(body, gen, chat=chat, parsing=parsing, echo=echo))
        answer.headers[REQUEST_ID_HEADER] = gen.request_id
        return answer

    async def _answer(self, body: Any, gen: GenerateRequest, chat: bool,
                      parsing: tuple[str | None, str | None] | None = None, echo: str = "") -> dict[str, Any]:
        """A whole (not streamed) answer to one prompt, its `n` samples for choices."""
        self.counters["requests_total"] += 1
        self.counters["prompt_tokens_total"] += len(gen.token_ids)
        rid = gen.request_id
        self.counters["inflight"] += 1
        try:
            samples = self._samples(body, gen)
            if len(samples) == 1:
                results = [await self._collect(body, gen)]
            else:
                # one failed sample cancels the others
                results = await all_or_first_failure(self._collect(body, g) for g in samples)
        except (NoInstance, PeerGone, RemoteError, asyncio.TimeoutError) as exc:
            raise self._failed(rid, exc) from None
        finally:
            self.counters["inflight"] -= 1
        if body.max_tokens == 0:  # the prompt scored (echo): the token made for it is left out
            results = [("", "length", 0, [], cached, prompt) for _, _, _, _, cached, prompt in results]
        tokens = sum(r[2] for r in results)
        self.counters["completion_tokens_total"] += tokens
        choices = []
        for index, (text, reason, _, logprobs, _, prompt) in enumerate(results):
            lp = None
            if body.logprob_count is not None:
                # by the flag: a prompt of special tokens echoes as "" and still has its logprobs
                echoed = (gen.token_ids[0], prompt or []) if not chat and body.echo else None
                lp = self._logprobs(chat, logprobs, 0, echoed)
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if parsing:
                    split = AnswerParser(*parsing).feed(text, final=True)
                    message["content"] = split.content if split.content or not split.tool_calls else None
                    if parsing[0]:
                        message["reasoning_content"] = split.reasoning
                    if split.tool_calls:
                        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in split.tool_calls]
                        reason = "tool_calls"
                choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": echo + text, "logprobs": lp, "finish_reason": reason})
        usage = self._usage(len(gen.token_ids), tokens, max(r[4] for r in results))
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": self.model_name, "system_fingerprint": self.fingerprint, "choices": choices, "usage": usage}

    def _failed(self, rid: str, exc: Exception) -> ApiError:
        """The client's error for a request the workers could not serve, with its id; logged, since the
        frontend's log is where an operator looks for it."""
        err = self._timed_out() if isinstance(exc, asyncio.TimeoutError) else upstream_error(exc)
        err.request_id = rid
        log.warning("%s failed: %d %s", rid, err.status, err.message)
        return err

    async def _merged(self, body: Any, gen: GenerateRequest) -> AsyncGenerator[tuple[int, Piece], None]:
        """The pieces of all `n` samples as they come, tagged with their index."""
        samples = self._samples(body, gen)
        if len(samples) == 1:
            async for piece in self._events(body, gen):
                yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, sample: GenerateRequest) -> None:
            async for piece in self._events(body, sample):
                queue.put_nowait((index, piece))

        async def all_samples() -> None:
            try:
                await all_or_first_failure(run(index, sample) for index, sample in enumerate(samples))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, who raises it
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        driver = asyncio.create_task(all_samples())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            driver.cancel()

    async def _sse(self, body: Any, gen: GenerateRequest, chat: bool, rid: str,
                   parsing: tuple[str | None, str | None] | None = None, echo: str = "") -> AsyncGenerator[bytes, None]:
        """The stream's events; a failure before the first is raised (an HTTP error), after it an error event."""
        events = self._events_of(body, gen, chat, rid, parsing, echo)
        sent = False
        try:
            async for event in events:
                sent = True
                yield event
        except (NoInstance, PeerGone, RemoteError, asyncio.TimeoutError) as exc:
            err = self._failed(rid, exc)
            if not sent:
                raise err from None
            # Headers are gone already: end the stream with an OpenAI-style error event, never hang.
            self.counters["errors_total"] += 1
            yield b"data: " + json_dumps({"error": {"message": err.message, "type": err.type,
                                                    "code": err.code or err.status}}) + b"\n\n"
        finally:
            await events.aclose()

    async def _events_of(self, body: Any, gen: GenerateRequest, chat: bool, rid: str,
                         parsing: tuple[str | None, str | None] | None = None,
                         echo: str = "") -> AsyncGenerator[bytes, None]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now()
        self.counters["inflight"] += 1
        tokens = [0] * body.n
        cached = [0] * body.n
        offsets = [0] * body.n
        started: set[int] = set()
        parsers = {i: AnswerParser(*parsing) for i in range(body.n)} if parsing else {}
        called: set[int] = set()

        def chunk(**fields: Any) -> bytes:
            return b"data: " + json_dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                           **fields}) + b"\n\n"
        # chunk(system_fingerprint=..., choices=[choice]) with its fixed fields encoded once: a chunk a token
        head = chunk(system_fingerprint=self.fingerprint, choices=[])[:-len(b"]}\n\n")]

        def choice_chunk(choice: dict[str, Any]) -> bytes:
            return head + json_dumps(choice) + b"]}\n\n"
        try:
            # the prompt first, as OpenAI's echo sends it; with logprobs, once the engine scored it
            echoing = not chat and body.echo  # by the flag: a prompt of special tokens echoes as ""
            echo_later = {i for i in range(body.n) if echoing and body.logprob_count is not None}
            for index in range(body.n if echoing and not echo_later else 0):
                yield chunk(system_fingerprint=self.fingerprint, choices=[
                    {"index": index, "text": echo, "logprobs": None, "finish_reason": None}])
            async for index, piece in self._merged(body, gen):
                tokens[index] = piece.tokens
                cached[index] = piece.cached
                if index in echo_later:
                    echo_later.discard(index)
                    yield chunk(system_fingerprint=self.fingerprint, choices=[
                        {"index": index, "text": echo, "finish_reason": None,
                         "logprobs": self._logprobs(False, [], 0, (gen.token_ids[0], piece.prompt or []))}])
                    offsets[index] = len(echo)
                lp = None
                if body.logprob_count is not None:
                    lp = self._logprobs(chat, piece.logprobs, offsets[index])
                offsets[index] += len(piece.delta)
                if chat:
                    d: dict[str, Any] = {"content": piece.delta}
                    reason = piece.reason
                    if parsers:
                        split = parsers[index].feed(piece.delta, final=piece.reason is not None)
                        d = {"content": split.content} if split.content else {}
                        if split.reasoning:
                            d["reasoning_content"] = split.reasoning
                        if split.tool_calls:
                            d["tool_calls"] = split.tool_calls
                            called.add(index)
                        if reason and index in called:
                            reason = "tool_calls"
                        if not d and not reason and not lp:
                            continue  # held back by a parser: nothing to send yet
                    if index not in started:
                        d["role"] = "assistant"
                    choice = {"index": index, "delta": d, "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": index, "text": piece.delta, "logprobs": lp, "finish_reason": piece.reason}
                started.add(index)
                if body.continuous_usage:
                    yield chunk(system_fingerprint=self.fingerprint, choices=[choice],
                                usage=self._usage(len(gen.token_ids), sum(tokens), max(cached)))
                else:
                    yield choice_chunk(choice)
            if body.include_usage:
                yield chunk(choices=[], usage=self._usage(len(gen.token_ids), sum(tokens), max(cached)))
            yield b"data: [DONE]\n\n"
        finally:
            self.counters["inflight"] -= 1
            self.counters["completion_tokens_total"] += sum(tokens)


class Piece(NamedTuple):
    delta: str
    reason: str | None
    tokens: int  # generated so far
    logprobs: list[TokenLogprob]
    cached: int = 0  # prompt tokens the engine reused
    prompt: list[TokenLogprob] | None = None  # the prompt's logprobs (tokens 1..n-1), when asked for


OFF_LOOP_CHARS = 16_384  # shorter prompts tokenize faster than a thread hand-off


async def _after(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`first`, then the rest of the stream it came from (closed with this one)."""
    try:
        if first:
            yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


# OpenAI's finish_reason for each engine's: a cancelled request stopped, a timed-out one ran into a limit; an
# engine's failure keeps its name (the client's error), as before
OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.TIMEOUT: "length",
                 FinishReason.CANCELLED: "stop", FinishReason.ERROR: "error"}


def _reason(reason: FinishReason | None) -> str | None:
    return OPENAI_FINISH[reason] if reason is not None else None

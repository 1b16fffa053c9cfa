"""The TensorRT-LLM adapter against the strict fake of the LLM API (tests/fakes/trtllm), in one process.

The fake refuses what the real API refuses (unknown kwargs, generation-only requests without the context's
ids, AutoDeploy-only fields), so these tests fail if the adapter drifts from the real API.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from pathlib import Path

import pytest

from hpc.engine_args.precedence import forced_values, merge_engine_args, prune_for_autodeploy, recipe_defaults
from hpc.runtime.engine.trtllm import TrtllmEngine, llm_kwargs, trtllm_sampling
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.runtime.serve.wire import replace
from hpc.spec.recipe import Recipe

pytestmark = pytest.mark.unit
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "trtllm"
AGG, PREFILL, DECODE, ENCODE = (DisaggregationMode.AGG, DisaggregationMode.PREFILL, DisaggregationMode.DECODE,
                                DisaggregationMode.ENCODE)


# The contract in each version mode of the fake: the oldest and newest TensorRT-LLM hpc knows, eos's, the base
# table's (the fake takes each version's DisaggregatedParams from hpc/data/trtllm-versions.json)
VERSION_MODES = ("1.1.0rc5", "1.3.0rc11", "1.3.0rc27", "1.4.0rc4")


def _forget_fake() -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture(scope="module", autouse=True, params=VERSION_MODES)
def fake_trtllm(request, tmp_path_factory):
    import os

    os.environ["FAKE_TRTLLM_VERSION"] = request.param
    _forget_fake()
    sys.path.insert(0, str(FAKE))
    os.environ["FAKE_TRTLLM_TRANSCEIVER_DIR"] = str(tmp_path_factory.mktemp("transceiver"))
    yield request.param
    sys.path.remove(str(FAKE))
    os.environ.pop("FAKE_TRTLLM_VERSION", None)
    _forget_fake()


def needs_handles(version: str) -> None:
    """EPD needs DisaggregatedParams.multimodal_embedding_handles, which some versions lack (validate refuses it)."""
    from hpc.engine_args.trtllm_versions import facts

    if facts(version).lacks("multimodal_embedding_handles"):
        pytest.skip(f"TensorRT-LLM {version} has no multimodal_embedding_handles: no EPD (hpc validate says so)")


def engine_args(backend: str = "pytorch") -> dict:
    """What resolve puts in the manifest for a one-GPU TensorRT-LLM role with events on."""
    recipe = Recipe.model_validate({"name": "t", "model": {"path": "/m", "served_name": "m"}, "backend": "trtllm",
                                    "roles": {"agg": {}}})
    merged = merge_engine_args(recipe_defaults(recipe, recipe.roles.agg, trtllm=True), {"backend": backend}, None,
                               forced_values(publish_kv_events=True, backend=backend))
    return prune_for_autodeploy(merged, warn=lambda w: None) if backend == "_autodeploy" else merged


def request(max_tokens=8, streaming=True, temperature=0.0, **kw) -> GenerateRequest:
    return GenerateRequest(request_id="r", token_ids=[11, 12, 13, 14, 15, 16], streaming=streaming,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw))


async def tokens(engine, req) -> list[int]:
    return [t async for out in engine.generate(req) for t in out.token_ids]


async def disaggregated(prefill, decode, req) -> tuple[list[int], list]:
    outs = [o async for o in prefill.generate(replace(req, streaming=False))]
    params = outs[-1].disaggregated_params
    rest = [o async for o in decode.generate(replace(req, disaggregated_params=params))]
    return [params.first_token_id] + [t for o in rest for t in o.token_ids], rest


def run(coro):
    return asyncio.run(coro)


def test_disaggregated_greedy_equals_aggregated_and_sends_each_token_once(tiny, fake_trtllm):
    async def main():
        args = engine_args()
        async with TrtllmEngine(tiny, AGG, args) as agg, \
                TrtllmEngine(tiny, PREFILL, args, self_address="h:1") as pre, TrtllmEngine(tiny, DECODE, args) as dec:
            for streaming in (True, False):
                req = request(max_tokens=8, streaming=streaming)
                whole = await tokens(agg, req)
                split, rest = await disaggregated(pre, dec, req)
                assert len(whole) == 8 and split == whole  # 8, not 9: the first token is not re-emitted
                assert rest[-1].finished and rest[-1].finish_reason == "length"
            params = [o async for o in pre.generate(request(streaming=False))][-1].disaggregated_params.trtllm
            # Everything the generation-only request needs from the context phase travelled along.
            assert params.ctx_request_id is not None
            assert (params.disagg_request_id is not None) is (fake_trtllm != "1.1.0rc5")  # not in 1.1.0rc5
            assert params.opaque_state and params.first_gen_tokens and params.prompt_token_ids
    run(main())


def test_temperature_zero_is_greedy_and_sampling_is_not(tiny):
    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            greedy = [await tokens(agg, request(max_tokens=12)) for _ in range(3)]
            sampled = [await tokens(agg, request(max_tokens=12, temperature=1.0)) for _ in range(3)]
            assert greedy[0] == greedy[1] == greedy[2]
            assert len({tuple(s) for s in sampled}) == 3
    run(main())
    from tensorrt_llm import SamplingParams as Real

    greedy = trtllm_sampling(SamplingParams(temperature=0.0, top_p=1.0), Real)
    assert greedy._greedy_decoding and greedy.top_k == 1 and greedy.temperature is None
    sampled = trtllm_sampling(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3), Real)
    assert not sampled._greedy_decoding and (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 40)
    assert sampled.repetition_penalty is None  # 1, none: left to the image's default
    assert trtllm_sampling(SamplingParams(repetition_penalty=1.3), Real).repetition_penalty == 1.3


def test_stop_strings_stop_the_engine(tiny):
    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            whole = await tokens(agg, request(max_tokens=20))
            stop_text = agg._llm.tokenizer.decode([whole[4]])
            outs = [o async for o in agg.generate(request(max_tokens=20, stop=[stop_text]))]
            got = [t for o in outs for t in o.token_ids]
            assert outs[-1].finish_reason == "stop"
            assert got == whole[:len(got)] and len(got) <= 4 < 20  # stopped there, stop string left out
    run(main())


def test_a_caller_that_stops_reading_aborts_the_request_within_a_second(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(tmp_path / "events.jsonl"))

    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            stream = agg.generate(request(max_tokens=2000))
            async for _ in stream:
                break
            left = time.time()
            await stream.aclose()  # what a cancelled RPC stream does to the engine generator
            await asyncio.sleep(0.2)
            assert agg.stats()["aborted"] == 1 and agg.stats()["running"] == 0
            return left
    left = run(main())
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    aborts = [e for e in log if e["event"] == "abort"]
    finish = [e for e in log if e["event"] == "finish"]
    assert len(aborts) == 1 and aborts[0]["ts"] - left < 1.0
    assert finish and finish[-1]["reason"] == "CANCELLED" and finish[-1]["tokens"] < 2000


def test_stats_and_kv_events_are_drained_into_the_sinks(tiny):
    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            stats, events = [], []
            agg.on_stats, agg.on_kv_event = stats.append, events.append
            long_prompt = GenerateRequest(request_id="r", token_ids=list(range(100, 200)),
                                          sampling=SamplingParams(max_tokens=4))
            await tokens(agg, long_prompt)
            await asyncio.sleep(0.3)
            return stats, events, agg.stats()
    stats, events, counters = run(main())
    assert stats and "kvCacheStats" in stats[-1] and counters["stats_records"] >= 4
    stored = [e for e in events if e["data"]["type"] == "stored"]
    assert stored and len(stored[0]["data"]["blocks"]) == 3  # 100 tokens, 32 per block
    assert stored[0]["data"]["blocks"][0]["tokens"][0]["token_id"] == 100


def test_engine_args_become_the_api_config_classes_and_stay_strict(tiny):
    from tensorrt_llm import llmapi

    kwargs = llm_kwargs(engine_args(), llmapi)
    assert isinstance(kwargs["kv_cache_config"], llmapi.KvCacheConfig)
    scheduler = kwargs["scheduler_config"]
    assert isinstance(scheduler.dynamic_batch_config, llmapi.DynamicBatchConfig)  # on by default, as in Dynamo
    assert scheduler.capacity_scheduler_policy is llmapi.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    chunked = llm_kwargs({"enable_chunked_prefill": True,
                          "scheduler_config": {"context_chunking_policy": "EQUAL_PROGRESS"}}, llmapi)
    assert chunked["scheduler_config"].context_chunking_policy is llmapi.ContextChunkingPolicy.EQUAL_PROGRESS
    assert chunked["enable_chunked_prefill"] is True
    with pytest.raises(ValueError, match="FIFO"):
        llm_kwargs({"scheduler_config": {"context_chunking_policy": "FIFO"}}, llmapi)
    with pytest.raises(ValueError, match="dtyp"):
        llm_kwargs({"kv_cache_config": {"dtyp": "fp8"}}, llmapi)

    async def main():
        async with TrtllmEngine(tiny, AGG, {**engine_args(), "max_batch_sise": 2}):
            pass
    with pytest.raises(ValueError, match="invalid argument: max_batch_sise"):
        run(main())


def test_autodeploy_runs_through_its_own_llm_class_with_the_pruned_args(tiny):
    args = engine_args("_autodeploy")
    assert "scheduler_config" not in args and args["kv_cache_config"]["event_buffer_max_size"] > 0

    async def main(a):
        async with TrtllmEngine(tiny, AGG, a) as engine:
            return type(engine._llm).__module__, await tokens(engine, request(max_tokens=4))
    module, out = run(main(args))
    assert module == "tensorrt_llm._torch.auto_deploy.llm" and len(out) == 4
    with pytest.raises(ValueError, match="scheduler_config"):  # unpruned args are what AutoDeploy refuses
        run(main({**args, "scheduler_config": {}}))


def _png(color) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (24, 24), color).save(buf, format="PNG")
    return buf.getvalue()


def test_encode_prefill_decode_with_an_image_matches_the_image_in_one_engine(tiny_mm, fake_trtllm):
    needs_handles(fake_trtllm)
    images = {"red": _png((200, 0, 0)), "blue": _png((0, 0, 200))}

    def loader(ref: str) -> bytes:
        return images[ref]

    async def main():
        args = engine_args()
        async with TrtllmEngine(tiny_mm, ENCODE, args, load_image_bytes=loader) as enc, \
                TrtllmEngine(tiny_mm, PREFILL, args, load_image_bytes=loader) as pre, \
                TrtllmEngine(tiny_mm, DECODE, args) as dec, TrtllmEngine(tiny_mm, AGG, args, load_image_bytes=loader) as agg:
            media = await enc.encode(enc.load_image(images["red"]))
            assert media.handles and media.handles[0]["tensor_size"]
            # A prompt that survives decode -> encode: with embedding handles the engine takes the text. The
            # image's place is marked as hpc's frontend marks it for the tiny model: one <|image|> an embedding.
            ids = pre._llm.tokenizer.encode("<|image|>" * 16 + "What is in this picture?", add_special_tokens=False)
            req = replace(request(max_tokens=6), token_ids=ids)
            with pytest.raises(ValueError, match="0 image placeholder"):  # as a real processor, the fake needs it
                await tokens(agg, replace(req, token_ids=ids[16:], image="red"))
            with_handles = replace(req, media=media)
            epd, _ = await disaggregated(pre, dec, with_handles)
            pd, _ = await disaggregated(pre, dec, replace(req, image="red"))
            one = await tokens(agg, replace(req, image="red"))
            other = await tokens(agg, replace(req, image="blue"))
            text_only = await tokens(agg, req)
            return epd, pd, one, other, text_only
    epd, pd, one, other, text_only = run(main())
    assert epd == pd == one and len(one) == 6
    assert other != one and text_only != one  # the image really reached the engine


def test_an_image_goes_to_the_processor_with_its_text_and_no_second_bos(tiny_mm):
    """The model's processor expands the placeholder in the prompt's text, so the adapter sends text; the text
    already holds the template's special tokens, so the input processor must not add its own (as TensorRT-LLM
    sets add_special_tokens=False when it decodes token ids for a VLM itself, llm.py generate_async)."""
    sent = []

    async def main():
        async with TrtllmEngine(tiny_mm, AGG, engine_args(), load_image_bytes=lambda ref: _png((0, 90, 0))) as agg:
            real = agg._llm.generate_async

            def spy(inputs, sampling_params=None, **kw):
                sent.append((inputs, sampling_params.add_special_tokens))
                return real(inputs, sampling_params=sampling_params, **kw)
            agg._llm.generate_async = spy
            ids = agg._llm.tokenizer.encode("<|image|>" * 16 + "Colour?", add_special_tokens=False)
            await tokens(agg, replace(request(max_tokens=3), token_ids=ids, image="green"))
            await tokens(agg, replace(request(max_tokens=3), token_ids=ids[16:]))
            return ids
    ids = run(main())
    (with_image, image_specials), (text_only, text_specials) = sent
    assert with_image["prompt"].startswith("<|image|>" * 16) and with_image["multi_modal_data"]["image"]
    assert image_specials is False
    assert text_only == ids[16:] and text_specials is True  # token ids alone stay ids, untouched


def test_a_per_request_error_fails_one_request_and_a_background_error_fails_the_engine(tiny):
    from tensorrt_llm.executor.utils import RequestError

    async def main():
        args = engine_args()
        async with TrtllmEngine(tiny, PREFILL, args, self_address="h:1") as pre, \
                TrtllmEngine(tiny, DECODE, args) as dec, TrtllmEngine(tiny, AGG, args) as agg:
            outs = [o async for o in pre.generate(replace(request(), streaming=False))]
            params = outs[-1].disaggregated_params
            # The context's KV was already taken: the executor answers this one request with an error response.
            await tokens(dec, replace(request(), disaggregated_params=params))
            with pytest.raises(RequestError, match="no context with request id"):
                await tokens(dec, replace(request(), disaggregated_params=params))
            assert dec.failure is None  # ...and keeps serving
            assert len(await tokens(pre, replace(request(max_tokens=1), streaming=False))) == 1

            # An executor thread dies while two long requests stream: both fail at once, so does the next.
            started = time.monotonic()
            long = [asyncio.create_task(tokens(agg, request(max_tokens=5000))) for _ in range(2)]
            await asyncio.sleep(0.1)
            agg._llm._executor.fail_in_background(RuntimeError("MPI worker 1 exited: CUDA error: an illegal "
                                                               "memory access was encountered"))
            results = await asyncio.wait_for(asyncio.gather(*long, return_exceptions=True), 5)
            assert all(isinstance(r, RuntimeError) and "engine failed" in str(r) for r in results), results
            assert time.monotonic() - started < 5 and "illegal memory access" in agg.failure
            with pytest.raises(RuntimeError, match="engine failed"):
                await tokens(agg, request())
    run(main())


def test_a_guide_goes_to_tensorrt_llm_as_guided_decoding_and_needs_a_backend(tiny):
    """json_object alone becomes GuidedDecodingParams(json_object=True); a forced call becomes an EBNF grammar
    that xgrammar compiles; without guided_decoding_backend in the engine config the request is refused."""
    from hpc.runtime.frontend.parsers import json_answer_guide, tool_call_guide
    from hpc.runtime.serve.wire import Guide

    def guided(pieces):
        return request(max_tokens=4, guide=Guide(pieces=pieces))

    async def main():
        async with TrtllmEngine(tiny, AGG, {**engine_args(), "guided_decoding_backend": "xgrammar"}) as agg:
            await tokens(agg, guided(json_answer_guide(None)))
            await tokens(agg, guided(tool_call_guide("deepseek_r1", "hermes", ["get_weather"])))
            sent = agg._llm._executor.submitted[-2:]
        async with TrtllmEngine(tiny, AGG, engine_args()) as plain:
            with pytest.raises(ValueError, match="guided_decoding_backend: xgrammar"):
                await tokens(plain, guided(json_answer_guide(None)))
        return sent
    as_json, as_grammar = run(main())
    assert as_json.guided_decoding.json_object and as_json.guided_decoding.grammar is None
    grammar = as_grammar.guided_decoding.grammar
    assert not as_grammar.guided_decoding.json_object and grammar.startswith("root ::= ") and "get_weather" in grammar
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    compiled = xgr.Grammar.from_ebnf(grammar)
    assert accepts(compiled, 'ok</think><tool_call>{"name": "get_weather", "arguments": {"c": 1}}</tool_call>')
    assert not accepts(compiled, 'ok</think><tool_call>{"name": "other", "arguments": {}}</tool_call>')


def test_the_prompts_logprobs_come_once_with_the_first_output(tiny):
    """SamplingParams.prompt_logprobs in, CompletionOutput.prompt_logprobs (executor/result.py) out: one entry per
    prompt token after the first, on the first output only."""
    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            return [o async for o in agg.generate(request(max_tokens=4, prompt_logprobs=2))]
    outs = run(main())
    first = outs[0].prompt_logprobs
    assert [e.token_id for e in first] == [12, 13, 14, 15, 16] and all(len(e.top_ids) == 2 for e in first)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_disaggregated_params_carry_only_the_fields_the_images_version_has(tiny, fake_trtllm):
    """A field the version lacks was a TypeError on every prefill (DisaggregatedParams is a kw-only slots
    dataclass); without disagg_request_id the decode side names the context by ctx_request_id."""
    import dataclasses

    from tensorrt_llm import __version__
    from tensorrt_llm.disaggregated_params import DisaggregatedParams

    have = {f.name for f in dataclasses.fields(DisaggregatedParams)}
    assert __version__.startswith(fake_trtllm)
    assert ("disagg_request_id" in have) is (fake_trtllm != "1.1.0rc5")  # the mode really differs

    async def main():
        args = engine_args()
        async with TrtllmEngine(tiny, AGG, args) as agg, TrtllmEngine(tiny, PREFILL, args, self_address="h:1") as pre, \
                TrtllmEngine(tiny, DECODE, args) as dec:
            req = request(max_tokens=6)
            split, rest = await disaggregated(pre, dec, req)
            return await tokens(agg, req), split, rest
    whole, split, rest = run(main())
    assert split == whole and len(whole) == 6


def test_a_disagg_request_id_is_drawn_from_the_global_range(tiny, fake_trtllm):
    """Upstream keeps local ids in [0, 2^40) and global disagg ids in [2^40, 2^63) (llmapi/disagg_utils.py)."""
    from hpc.runtime.engine.trtllm import MIN_GLOBAL_ID, global_disagg_request_id

    assert all(MIN_GLOBAL_ID <= global_disagg_request_id() < 1 << 63 for _ in range(1000))

    async def main():
        async with TrtllmEngine(tiny, PREFILL, engine_args(), self_address="h:1") as pre:
            outs = [o async for o in pre.generate(request(max_tokens=2, streaming=False))]
            return outs[-1].disaggregated_params.trtllm
    sent = run(main())
    if fake_trtllm == "1.1.0rc5":
        assert sent.disagg_request_id is None and sent.ctx_request_id is not None
    else:
        assert sent.disagg_request_id >= MIN_GLOBAL_ID


def test_nested_engine_configs_reach_the_llm_as_its_config_classes(tiny, tmp_path, monkeypatch):
    """speculative_config by decoding_type (DecodingBaseConfig.from_dict), moe_config and the cache transceiver's
    as their classes, as upstream's update_llm_args_with_extra_dict converts them; they reached LLM(...) as dicts."""
    import yaml

    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(tmp_path / "events.jsonl"))
    root = Path(__file__).resolve().parents[2]
    mtp = yaml.safe_load((root / "engine_configs/deepseek-r1/mtp-agg.yaml").read_text())
    moe = yaml.safe_load((root / "engine_configs/deepseek-r1/wide-ep-decode.yaml").read_text())
    args = {**engine_args(), "speculative_config": mtp["speculative_config"], "moe_config": moe["moe_config"],
            "cache_transceiver_config": moe["cache_transceiver_config"]}

    async def main():
        async with TrtllmEngine(tiny, AGG, args):
            pass
    run(main())
    (init,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "init"]
    assert init["nested"]["speculative_config"] == "MTPDecodingConfig"
    assert init["nested"]["moe_config"] == "MoeConfig"
    assert init["nested"]["cache_transceiver_config"] == "CacheTransceiverConfig"
    assert init["nested"]["kv_cache_config"] == "KvCacheConfig"


def test_200_clients_leaving_during_the_kv_transfer_leave_the_decode_engine_alive(tiny, tmp_path, monkeypatch):
    """An abort that lands while a generation-only request's KV cache is in transfer takes the executor down
    (the fake models it, as Dynamo's _DeferredAbort guards against it); the adapter aborts once it has landed."""
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("FAKE_TRTLLM_TRANSFER_MS", "30")

    async def main():
        args = engine_args()
        async with TrtllmEngine(tiny, PREFILL, args, self_address="h:1") as pre, TrtllmEngine(tiny, DECODE, args) as dec:
            handoffs = []
            for i in range(200):
                req = replace(request(max_tokens=50), token_ids=[11, 12, 13, i % 100 + 20])
                outs = [o async for o in pre.generate(replace(req, streaming=False))]
                handoffs.append(replace(req, disaggregated_params=outs[-1].disaggregated_params))

            async def leave(req):  # the client goes away before the first decode token
                stream = dec.generate(req)
                task = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0.005)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await stream.aclose()
            await asyncio.gather(*(leave(r) for r in handoffs))
            await asyncio.sleep(0.3)
            after, _ = await disaggregated(pre, dec, request(max_tokens=4))  # still serving
            return dec.failure, dec.stats(), after
    failure, stats, after = run(main())
    assert failure is None, failure
    assert stats["aborts_deferred"] >= 150 and stats["running"] == 0 and after
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not [e for e in log if e["event"] == "abort_during_transfer"]
    assert len([e for e in log if e["event"] == "abort"]) >= 150


def test_sampling_leaves_detokenizing_to_the_frontend():
    from tensorrt_llm import SamplingParams as Sampling
    from tensorrt_llm.sampling_params import GuidedDecodingParams

    assert trtllm_sampling(SamplingParams(max_tokens=3), Sampling, GuidedDecodingParams).detokenize is False


def test_qwen_vl_epd_carries_the_mrope_handles_to_prefill_and_decode(tiny_mm, tmp_path, fake_trtllm):
    """Qwen-VL's positions follow the image grid: the encoder's mrope handles go to the prefill request and on to
    the decode request (upstream test_mm_encoder_standalone.py); the fake refuses a phase without them, and
    positions computed for another token sequence than the request's: the encoder runs on the request's own text,
    tokenized as prefill tokenizes it (no second BOS: its text holds the template's special tokens)."""
    import shutil

    needs_handles(fake_trtllm)
    model = tmp_path / "qwen-vl-shaped"
    shutil.copytree(tiny_mm, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_vl"}))

    async def main():
        args = engine_args()
        async with TrtllmEngine(str(model), ENCODE, args, load_image_bytes=lambda ref: _png((200, 0, 0))) as enc, \
                TrtllmEngine(str(model), PREFILL, args, self_address="h:1") as pre, \
                TrtllmEngine(str(model), DECODE, args) as dec:
            ids = pre._llm.tokenizer.encode("<|image|>" * 16 + "What is it?", add_special_tokens=False)
            media = await enc.encode(enc.load_image(_png((200, 0, 0))), ids)  # on the request's own prompt
            alone = await enc.encode(enc.load_image(_png((200, 0, 0))))  # on the placeholder alone
            with pytest.raises(Exception, match="computed for another prompt"):
                [o async for o in pre.generate(replace(request(max_tokens=4), token_ids=ids, media=alone))]
            req = replace(request(max_tokens=4), token_ids=ids, media=media)
            outs = [o async for o in pre.generate(replace(req, streaming=False))]
            handed = outs[-1].disaggregated_params
            rest = [t async for o in dec.generate(replace(req, media=None, disaggregated_params=handed))
                    for t in o.token_ids]
            bare = replace(media, mrope_position_ids_handle=None, mrope_position_deltas_handle=None)
            with pytest.raises(Exception, match="mrope"):
                [o async for o in pre.generate(replace(req, media=bare, streaming=False))]
            return media, handed, rest
    media, handed, rest = run(main())
    assert media.mrope_position_ids_handle and media.mrope_position_deltas_handle
    assert handed.trtllm.mrope_position_ids_handle == media.mrope_position_ids_handle  # at prefill, on to decode
    assert handed.trtllm.mrope_position_deltas_handle == media.mrope_position_deltas_handle
    assert len(rest) == 3


def test_the_encode_worker_gets_only_the_encoders_arguments(tiny_mm, tmp_path, monkeypatch, fake_trtllm):
    """As Dynamo's encode worker: the model and its batch, not the scheduler, KV-event or stats settings."""
    needs_handles(fake_trtllm)
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(tmp_path / "events.jsonl"))

    async def main():
        async with TrtllmEngine(tiny_mm, ENCODE, {**engine_args(), "max_batch_size": 4, "trust_remote_code": True}):
            pass
    run(main())
    (init,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "init"]
    assert init["cls"] == "MultimodalEncoder" and set(init["kwargs"]) <= {"max_batch_size", "max_num_tokens"}


def test_attention_dp_ranks_publish_their_own_events_and_take_the_routers_rank(tiny, tmp_path, monkeypatch):
    """Each attention-DP rank has its own KV cache: its events carry attention_dp_rank (upstream
    test_llm_kv_cache_events.py), the index keeps them apart, and a request routed to a rank is scheduled there
    (SchedulingParams(attention_dp_rank, attention_dp_relax=False))."""
    from hpc.runtime.frontend.kv_index import KvIndex

    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(tmp_path / "events.jsonl"))
    records = []
    args = {**engine_args(), "tensor_parallel_size": 4, "enable_attention_dp": True}
    prompt = list(range(40, 40 + 64))

    async def main():
        async with TrtllmEngine(tiny, AGG, args) as agg:
            agg.on_kv_event = records.append
            assert agg.attention_dp_size() == 4
            await tokens(agg, replace(request(max_tokens=2), token_ids=prompt, dp_rank=2))
            await asyncio.sleep(2.5)  # a drain cycle
    run(main())
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["dp_rank"] for e in log if e["event"] == "request"] == [2]
    stored = [r for r in records if r["data"]["type"] == "stored"]
    assert stored and {r["attention_dp_rank"] for r in stored} == {2}
    kv = KvIndex(32)
    for r in records:
        kv.apply("agg-0", {"event": "engine", "record": r})
    assert kv.overlaps(prompt)[1] == {"agg-0@2": 2}  # this rank's cache, not the worker's as a whole


def test_tensorrt_llms_own_metrics_come_from_its_iteration_stats(tiny):
    """Named as TensorRT-LLM's MetricsCollector names them (tensorrt_llm/metrics/collector.py): gauges as the last
    record has them, per-iteration counts summed."""
    async def main():
        async with TrtllmEngine(tiny, AGG, engine_args()) as agg:
            for _ in range(4):  # each one's completion is counted in the next request's first iteration
                await tokens(agg, request(max_tokens=4))
            await asyncio.sleep(2.5)  # a drain cycle
            return agg.stats()
    stats = run(main())
    assert stats["trtllm_max_num_active_requests"] > 0 and stats["trtllm_kv_cache_max_blocks"] == 4096
    assert 0 < stats["trtllm_iteration_latency_seconds"] < 1 and stats["trtllm_gpu_memory_usage_bytes"] > 0
    assert stats["trtllm_num_requests_completed_total"] == 3
    assert 0 <= stats["trtllm_kv_cache_utilization"] <= 1

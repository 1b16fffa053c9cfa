"""The official `openai` client against the local stack with the tiny model: n, logprobs, defaults, models,
streaming and not, sync and async, aggregated and disaggregated."""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime.conftest import stack_fixture

openai = pytest.importorskip("openai", reason="the dev extra installs the official client")

pytestmark = pytest.mark.integration

# a short limit so that "no max_tokens" (OpenAI: up to the model's limit) is quick to check
agg = stack_fixture("tiny-agg", "--set", "limits.max_output_tokens=40")
disagg = stack_fixture("tiny-disagg")
MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def client(stack) -> "openai.OpenAI":
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def test_n_samples_are_independent_and_counted(agg):
    c = client(agg)
    r = c.chat.completions.create(model=agg.model, messages=MESSAGES, n=3, max_tokens=12, seed=11,
                                  extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) == 3  # seeds 11, 12, 13: three different samples
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens > 0
    again = c.chat.completions.create(model=agg.model, messages=MESSAGES, n=3, max_tokens=12, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]  # seeded

    stream = c.completions.create(model=agg.model, prompt="Once upon", n=2, max_tokens=8, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert all(texts.values()) and reasons == {0: "length", 1: "length"} and usage.completion_tokens == 16


def test_openai_defaults_sample_and_chat_runs_to_the_models_limit(agg):
    c = client(agg)
    long = c.chat.completions.create(model=agg.model, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40 and long.choices[0].finish_reason == "length"  # not 16
    sampled = {c.completions.create(model=agg.model, prompt="The sea", max_tokens=10).choices[0].text
               for _ in range(3)}
    greedy = {c.completions.create(model=agg.model, prompt="The sea", max_tokens=10, temperature=0).choices[0].text
              for _ in range(3)}
    assert len(sampled) > 1 and len(greedy) == 1  # temperature defaults to 1, as OpenAI's does


@pytest.mark.parametrize("which", ["agg", "disagg"])
def test_logprobs_chat_and_completions(which, request):
    stack = request.getfixturevalue(which)
    c = client(stack)
    r = c.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6  # the first token too (disagg: from the prefill)
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy picks the best
    # the tokens' raw bytes make up the answer (a token may hold half of a UTF-8 character)
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content

    done = c.completions.create(model=stack.model, prompt="The sea", max_tokens=5, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs)

    plain = c.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None  # only when asked


def test_models_refusals_and_the_async_streaming_client(disagg):
    c = client(disagg)
    assert c.models.retrieve("hpc/tiny").id == "hpc/tiny"
    assert [m.id for m in c.models.list().data] == ["hpc/tiny"]
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=disagg.model, messages=MESSAGES, max_tokens=3,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert refused.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=disagg.model, messages=MESSAGES, max_tokens=3, top_logprobs=2)
    assert "top_logprobs needs logprobs" in str(refused.value)

    async def stream() -> tuple[dict[int, str], int]:
        async_client = openai.AsyncOpenAI(base_url=disagg.url + "/v1", api_key="none", max_retries=0)
        texts: dict[int, str] = {}
        usage = 0
        chunks = await async_client.chat.completions.create(
            model=disagg.model, messages=MESSAGES, n=2, max_tokens=5, stream=True, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            usage = chunk.usage.completion_tokens if chunk.usage else usage
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        await async_client.close()
        return texts, usage

    texts, usage = asyncio.run(stream())
    assert sorted(texts) == [0, 1] and texts[0] == texts[1] and usage == 10  # greedy: the same twice


# Every documented Chat Completions parameter, with a value that asks for its effect: honoured (200, and the
# answer shows it) or refused (400 naming it). Nothing may be accepted and ignored.
HONOURED = {
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logprobs": True, "top_logprobs": 2, "max_tokens": 3,
    "max_completion_tokens": 3, "n": 2, "seed": 5, "stop": ["zzz"], "stream": False,
    "stream_options": None, "temperature": 0.5, "top_p": 0.9, "user": "u", "metadata": {"k": "v"},
    "service_tier": "auto", "response_format": {"type": "json_object"}, "modalities": ["text"], "tool_choice": "none",
}
REFUSED = {
    "logit_bias": {"5": 10}, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "functions": [{"name": "f"}],
    "function_call": {"name": "f"}, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "parallel_tool_calls": False, "store": True, "best_of": 2,
}


def test_every_documented_chat_parameter_is_honoured_or_refused_by_name(agg):
    from hpc.checks.probe import post_json

    base = {"model": agg.model, "messages": MESSAGES, "max_tokens": 3}
    for name, value in HONOURED.items():
        needs = {"logprobs": True} if name == "top_logprobs" else {}  # as OpenAI: top_logprobs needs logprobs
        code, resp = post_json(agg.url + "/v1/chat/completions", {**base, **needs, name: value})
        assert code == 200, (name, resp)
    code, resp = post_json(agg.url + "/v1/chat/completions", {**base, **HONOURED})
    assert code == 200 and len(resp["choices"]) == 2 and resp["usage"]["completion_tokens"] <= 6
    assert all(len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2 for ch in resp["choices"])
    for name, value in REFUSED.items():
        code, resp = post_json(agg.url + "/v1/chat/completions", {**base, name: value})
        assert code == 400 and resp["error"]["param"] == name, (name, resp)


def test_penalties_echo_and_usage_details(agg):
    c = client(agg)

    def distinct(**extra) -> tuple[int, int]:
        """Distinct tokens among 30 greedy ones, and the cached prompt tokens reported."""
        r = c.completions.create(model=agg.model, prompt="the the the", max_tokens=30, temperature=0, logprobs=0,
                                 extra_body={"ignore_eos": True}, **extra)
        return len(set(r.choices[0].logprobs.tokens)), r.usage.prompt_tokens_details.cached_tokens
    plain, cached = distinct()
    penalised, _ = distinct(frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised > plain and cached == 0  # the penalty changed what greedy picked: fewer repeats
    echoed = c.completions.create(model=agg.model, prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Echo me") and len(echoed.choices[0].text) > len("Echo me")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=agg.model, prompt="Echo me", max_tokens=3, temperature=0, echo=True, stream=True) if ch.choices)
    assert streamed == echoed.choices[0].text
    # echo with logprobs: the prompt's tokens come first, scored by the model (the very first has nothing before it)
    prompt = "Echo me, please"
    plain = c.completions.create(model=agg.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    whole = c.completions.create(model=agg.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = whole.choices[0].logprobs
    n_prompt = whole.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and "".join(lp.tokens[:n_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens  # the answer's own, unchanged (to rounding:
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    # the head then runs over every prompt position at once)
    assert lp.text_offset[n_prompt] == len(prompt) and whole.choices[0].text == prompt + plain.choices[0].text
    streamed = [ch.choices[0] for ch in c.completions.create(model=agg.model, prompt=prompt, max_tokens=3,
                                                             temperature=0, logprobs=2, echo=True, stream=True)
                if ch.choices]
    assert streamed[0].text == prompt and streamed[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    assert [t for ch in streamed for t in ch.logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_unknown_field_is_a_400_naming_it_and_the_extensions_and_caller_fields_are_taken(agg, route):
    """As OpenAI answers an unrecognized argument: a typo'd max_tokenz must not silently get the default length."""
    c = client(agg)

    def ask(**extra):
        if route == "chat":
            return c.chat.completions.create(model=agg.model, messages=MESSAGES, max_tokens=6, extra_body=extra)
        return c.completions.create(model=agg.model, prompt="Once upon", max_tokens=6, extra_body=extra)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(max_tokenz=9)
    assert "Unrecognized request argument supplied: 'max_tokenz' (did you mean 'max_tokens'?)" in str(refused.value)
    assert refused.value.body["param"] == "max_tokenz" and refused.value.body["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError, match="min_tokens 9 exceeds max_tokens 6"):
        ask(min_tokens=9)
    # hpc's extensions (and Dynamo's nvext), and the fields that describe the caller, are taken
    answer = ask(min_tokens=6, ignore_eos=False, top_k=5, nvext={"agent_hints": {"priority": 1}}, user="u-1",
                 metadata={"team": "x"})
    assert answer.usage.completion_tokens == 6  # min_tokens = max_tokens: exactly that many


def test_every_prompt_form_openai_documents_is_answered_with_choices_prompt_by_prompt(agg):
    """A string, an array of strings, an array of tokens, an array of token arrays (what lm-eval's
    local-completions sends): the choices of prompt i at i*n .. i*n+n-1, usage summed, each answer the one that
    prompt alone gets."""
    c = client(agg)
    ask = dict(model=agg.model, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    one = [c.completions.create(prompt=p, **ask).choices[0].text for p in ("Once upon", "The sea")]
    both = c.completions.create(prompt=["Once upon", "The sea"], **ask)
    assert [ch.index for ch in both.choices] == [0, 1] and [ch.text for ch in both.choices] == one
    assert both.usage.completion_tokens == 8
    ids = [[5, 6, 7, 8], [40, 41]]
    alone = [c.completions.create(prompt=p, **ask).choices[0].text for p in ids]
    batched = c.completions.create(prompt=ids, n=2, **ask)
    assert [ch.index for ch in batched.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batched.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: n alike
    assert batched.usage.prompt_tokens == 4 + 2 and batched.usage.completion_tokens == 16  # a prompt counts once
    scored = c.completions.create(prompt=ids, echo=True, logprobs=1, **ask)  # the loglikelihood request's shape
    assert [len(ch.logprobs.token_logprobs) for ch in scored.choices] == [4 + 4, 2 + 4]
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        c.completions.create(prompt=["a", "b"], stream=True, **ask)
    with pytest.raises(openai.BadRequestError, match="a prompt must not be empty"):
        c.completions.create(prompt=[[1, 2], []], **ask)


def test_max_tokens_0_with_echo_scores_the_prompt_as_the_loglikelihood_request_asks(agg):
    """lm-eval's loglikelihood request: the prompt echoed with its tokens' logprobs, nothing generated; the
    logprobs equal those of the same prompt scored beside a generated answer."""
    c = client(agg)
    ids = [5, 6, 7, 8, 9]
    scored = c.completions.create(model=agg.model, prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=1)
    beside = c.completions.create(model=agg.model, prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0)
    first = scored.choices[0]
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.token_logprobs) == 5  # the prompt's only
    assert first.logprobs.token_logprobs == pytest.approx(beside.choices[0].logprobs.token_logprobs[:5], abs=1e-5)
    assert scored.usage.completion_tokens == 0 and len(scored.choices[1].logprobs.token_logprobs) == 3
    assert first.text == beside.choices[0].text[:len(first.text)]  # the prompt's text alone
    with pytest.raises(openai.BadRequestError, match="scores the prompt, with echo"):
        c.completions.create(model=agg.model, prompt=ids, max_tokens=0)


def _raw(stack, body: bytes) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(stack.url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "16"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"), ({"temperature": "0.5"}, "temperature"), ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [2**64 + 1]}, "prompt"), ({"prompt": [2**31]}, "prompt"), ({"seed": 1.5}, "seed"),
])
def test_loose_types_and_out_of_range_token_ids_are_400s_naming_the_field(agg, fields, param):
    import json

    body = {"model": agg.model, "prompt": "Once upon", "max_tokens": 2, **fields}
    status, answer = _raw(agg, json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"].split(".")[0] == param, answer


def test_a_body_nested_too_deeply_is_a_400_and_the_server_answers_on(agg):
    status, answer = _raw(agg, b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and "nests too deeply" in answer["error"]["message"]
    status, answer = _raw(agg, b'{"model": "' + agg.model.encode() + b'", "prompt": "x", "max_tokens": 1}')
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


def test_a_4xx_is_one_bounded_line_of_the_frontends_log_and_a_long_model_name_is_not_echoed_whole(agg):
    import json

    status, answer = _raw(agg, json.dumps({"model": "m" * 1_000_000, "prompt": "x"}).encode())
    assert status == 404 and len(answer["error"]["message"]) < 300 and "(1000000 chars)" in answer["error"]["message"]
    status, _ = _raw(agg, json.dumps({"model": agg.model, "prompt": "x", "max_tokenz": 1}).encode())
    assert status == 400
    log = (agg.run.logs / "frontend.log").read_text().splitlines()
    lines = [line for line in log if "-> 400" in line and "param=max_tokenz" in line]
    assert lines and all(len(line) < 600 for line in log if "-> 40" in line)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_prompt_too_long_for_its_tokens_is_refused_before_tokenizing_and_one_just_under_after(agg, route):
    """tiny-agg takes 512 prompt tokens; its tokenizer's longest piece is max_token_chars characters: 600 KB of
    text cannot fit and is refused on its length alone; 20,000 characters might and are tokenized, in a thread
    that lets go of the GIL, then refused by their count."""
    c = client(agg)

    def ask(text: str):
        if route == "chat":
            return c.chat.completions.create(model=agg.model, messages=[{"role": "user", "content": text}],
                                             max_tokens=4)
        return c.completions.create(model=agg.model, prompt=text, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        ask("the sea " * 75_000)
    body = refused.value.body
    assert "more than 512 tokens can hold" in body["message"] and "characters a token" in body["message"]
    # a chat's prompt is its messages, rendered: OpenAI names them
    assert body["param"] == ("messages" if route == "chat" else "prompt")
    assert body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as counted:
        ask("the sea " * 2_500)
    assert "tokens; the limit is 512" in counted.value.body["message"]
    assert ask("the sea").usage.completion_tokens > 0  # and it serves on


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(agg):
    """vLLM's stream_options.continuous_usage_stats, which GuideLLM sends with every request (refused by name
    before: GuideLLM's 100 requests all failed)."""
    c = client(agg)
    stream = c.chat.completions.create(model=agg.model, messages=MESSAGES, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices and all(ch.usage is not None for ch in with_choices)
    counts = [ch.usage.completion_tokens for ch in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    assert all(ch.usage.prompt_tokens == with_choices[0].usage.prompt_tokens > 0 for ch in with_choices)
    plain = c.chat.completions.create(model=agg.model, messages=MESSAGES, max_tokens=3, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert [ch.usage is None for ch in plain if ch.choices] == [True] * 3  # only the last chunk, as OpenAI's


def test_an_answer_sent_back_as_the_client_dumps_it_is_a_turn_of_the_next_request(agg):
    """Messages refuse keys OpenAI does not know; every key of the official client's own answer is known (a
    conversation that appends `message.model_dump()` goes on)."""
    c = client(agg)
    first = c.chat.completions.create(model=agg.model, messages=MESSAGES, max_tokens=4)
    turn = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(turn)
    again = c.chat.completions.create(model=agg.model, messages=[*MESSAGES, turn, {"role": "user", "content": "go on"}],
                                      max_tokens=4)
    assert again.choices[0].message.content is not None

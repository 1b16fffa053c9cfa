"""Constrained decoding: the guide automaton accepts exactly its language, always closes within its budget, and
its EBNF form (what TensorRT-LLM's xgrammar gets) accepts the same texts."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from hpc.runtime.engine.guided import Automaton, to_ebnf
from hpc.runtime.frontend.parsers import TOOL_CALL_PARSERS, json_answer_guide, tool_call_guide
from hpc.runtime.serve.wire import Guide

pytestmark = pytest.mark.unit

JSON = Automaton.from_guide(Guide(pieces=json_answer_guide(None)))
GUIDES = {f"json/{r}": json_answer_guide(r) for r in (None, "deepseek_r1", "qwen3", "gpt_oss")}
GUIDES.update({f"call/{r}/{t}": tool_call_guide(r, t, ["get_weather", "get_time"])
               for r in (None, "deepseek_r1") for t in sorted(TOOL_CALL_PARSERS)})


@pytest.mark.parametrize("text", ['{}', '{"a": 1}', '{"a": [1, 2.5e-3, "x\\n", true, null, {"b": false}]}',
                                  '{ "k" : -0.5 }', '{"\\"q\\"": "\\\\"}'])
def test_json_objects_are_accepted(text):
    state = JSON.feed(JSON.initial, text)
    assert state is not None and JSON.complete(state)
    json.loads(text)


@pytest.mark.parametrize("text", ['[]', '{a}', '{"a" 1}', '{"a": 01}', '{"a": tru }', '{"a": 1,}', '{}}', ' {}',
                                  '{"a":"\x01"}', '{"a": .5}', '{"a": 1e}', '"x"'])
def test_anything_else_is_refused_before_it_completes(text):
    state = JSON.feed(JSON.initial, text)
    assert state is None or not JSON.complete(state)


def _walk(automaton: Automaton, alphabet: list[str], budget: int, rng: random.Random) -> str:
    """Random allowed characters, each kept only if the rest can still close in the budget (the engine's rule)."""
    state, text = automaton.initial, ""
    for left in range(budget, 0, -1):
        if automaton.complete(state):
            break
        options = [c for c in alphabet if (n := automaton.step(state, c)) is not None
                   and automaton.min_close(n) <= left - 1]
        assert options, (text, state)
        ch = rng.choice(options)
        state, text = automaton.step(state, ch), text + ch
    assert automaton.complete(state), text
    return text


def _alphabet(pieces) -> list[str]:
    return sorted(set('{}[]",:0123456789-.eEtrufalsn xy\\\n') | set("".join(v for p in pieces for v in p.values)))


def test_every_walk_within_its_budget_ends_in_valid_json():
    rng = random.Random(1)
    for _ in range(500):
        budget = rng.randint(2, 60)
        text = _walk(JSON, _alphabet([]), budget, rng)
        assert len(text) <= budget and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_the_ebnf_grammar_accepts_what_the_automaton_accepts(name):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    pieces = GUIDES[name]
    guide = Guide(pieces=pieces)
    automaton, grammar = Automaton.from_guide(guide), xgr.Grammar.from_ebnf(to_ebnf(guide))
    rng = random.Random(2)
    alphabet = _alphabet(pieces)
    for _ in range(15):
        floor = automaton.min_close(automaton.initial)
        text = _walk(automaton, alphabet, rng.randint(floor, floor + 100), rng)
        assert accepts(grammar, text), text
        at = rng.randrange(len(text) + 1)  # one character more, somewhere: both must agree
        mutated = text[:at] + rng.choice(alphabet) + text[at:]
        state = automaton.feed(automaton.initial, mutated)
        assert accepts(grammar, mutated) == (state is not None and automaton.complete(state)), mutated


def test_the_engine_answers_inside_the_guide_and_stops_when_it_is_complete(tiny):
    """The random-weight model, sampled and greedy, still produces a JSON object and a well-formed forced call."""
    from hpc.runtime.engine.torch.engine import TorchEngine
    from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

    call = tool_call_guide(None, "hermes", ["get_weather", "get_time"])

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            async def one(pieces, temperature, max_tokens):
                req = GenerateRequest(request_id="g", token_ids=[5, 6, 7], sampling=SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, seed=3, guide=Guide(pieces=pieces)))
                outs = [o async for o in engine.generate(req)]
                return [t for o in outs for t in o.token_ids], outs[-1].finish_reason
            return await asyncio.gather(one(json_answer_guide(None), 0, 40), one(json_answer_guide(None), 1.0, 12),
                                        one(call, 0.8, 60)), engine.core.picker.token_texts()

    results, texts = asyncio.run(main())
    (obj, r1), (small, r2), (tool, r3) = results
    assert isinstance(json.loads("".join(texts[t] for t in obj)), dict) and r1 == "stop"
    assert isinstance(json.loads("".join(texts[t] for t in small)), dict) and len(small) <= 12 and r2 == "stop"
    from hpc.runtime.frontend.parsers import AnswerParser

    split = AnswerParser(None, "hermes").feed("".join(texts[t] for t in tool), final=True)
    assert r3 == "stop" and len(split.tool_calls) == 1
    assert split.tool_calls[0]["function"]["name"] in ("get_weather", "get_time")
    assert isinstance(json.loads(split.tool_calls[0]["function"]["arguments"]), dict)

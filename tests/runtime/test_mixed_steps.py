"""Mixed steps: prompt tokens and decoding rows in one forward pass (mixed_steps.py). The model's mixed pass gives
the logits and the KV cache of a decode step and a prefill run apart; the engine answers with the same greedy
tokens mixed as apart, and says which it ran."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, StepRows, init_weights
from hpc.spec.recipe import TorchEngineSpec
from tests.runtime.staggered import staggered

pytestmark = pytest.mark.unit

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    init_weights(model, seed=3)
    return model.eval().fuse_projections()


def _rows(model, rows: list[list[int]], starts: list[int], slots: list[int]) -> StepRows:
    """Rows right-padded to the longest, each from its start, as the context steps stage them."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    positions = torch.tensor([[start + j for j in range(width)] for start in starts])
    return StepRows(model.embed(ids), positions, torch.tensor(slots), window=max(s + len(r) for s, r in
                                                                                   zip(starts, rows)),
                    fresh=not any(starts), last=torch.tensor([len(row) - 1 for row in rows]))


@pytest.mark.parametrize("prompt_starts,prompt_lengths", [([0, 0], [7, 3]), ([5], [6]), ([5, 2], [4, 6])],
                         ids=["fresh-prompts", "one-chunk-going-on", "chunks-going-on"])
def test_the_mixed_pass_gives_the_logits_and_cache_of_the_two_passes_apart(prompt_starts, prompt_lengths):
    model = _model()
    gen = torch.Generator().manual_seed(5)
    cache = model.new_cache(8, 32, torch.float32, torch.device("cpu"))
    decoding, prompts = [0, 3, 6], [1, 4][:len(prompt_starts)]
    cached = {0: 9, 3: 4, 6: 12, **dict(zip(prompts, prompt_starts))}
    for slot, length in cached.items():  # what is in the cache before the step
        if length:
            ids = torch.randint(2, CFG.vocab_size, (1, length), generator=gen)
            model.forward_step(model.embed(ids), torch.arange(length)[None], torch.tensor([slot]), cache)
    apart = type(cache)(cache.whole.clone())
    tokens = torch.randint(2, CFG.vocab_size, (len(decoding), 1), generator=gen)
    chunks = [torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist() for n in prompt_lengths]

    decode = StepRows(model.embed(tokens), torch.tensor([[cached[s]] for s in decoding]), torch.tensor(decoding),
                      window=max(cached[s] for s in decoding) + 1)
    got = model.forward_mixed(decode, [_rows(model, chunks, prompt_starts, prompts)], cache)

    want_decode = model.forward_step(decode.embeds, decode.positions, decode.slots, apart)
    rows = _rows(model, chunks, prompt_starts, prompts)
    want_prompts = model.forward_step(rows.embeds, rows.positions, rows.slots, apart, last=rows.last)
    assert got.shape == (len(decoding) + len(prompts), CFG.vocab_size)
    torch.testing.assert_close(got[:len(decoding)], want_decode, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[len(decoding):], want_prompts, rtol=1e-4, atol=1e-4)
    for slot, start, n in [*zip(prompts, prompt_starts, prompt_lengths), *((s, cached[s], 1) for s in decoding)]:
        torch.testing.assert_close(cache.whole[:, :, slot, :, :start + n], apart.whole[:, :, slot, :, :start + n],
                                   rtol=1e-5, atol=1e-5)


def test_parts_that_attend_apart_give_the_logits_of_a_pass_each():
    """A fresh prompt and one going on from its cache, two parts of one pass (ContextSteps.prompt_parts)."""
    model = _model()
    gen = torch.Generator().manual_seed(6)
    cache = model.new_cache(8, 32, torch.float32, torch.device("cpu"))
    ids = torch.randint(2, CFG.vocab_size, (1, 7), generator=gen)
    model.forward_step(model.embed(ids), torch.arange(7)[None], torch.tensor([2]), cache)
    apart = type(cache)(cache.whole.clone())
    fresh, going_on = ([torch.randint(2, CFG.vocab_size, (n,), generator=gen).tolist()] for n in (9, 4))
    got = model.forward_mixed(None, [_rows(model, fresh, [0], [5]), _rows(model, going_on, [7], [2])], cache)
    want = [model.forward_step(rows.embeds, rows.positions, rows.slots, apart)
            for rows in (_rows(model, fresh, [0], [5]), _rows(model, going_on, [7], [2]))]
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.whole, apart.whole, rtol=1e-5, atol=1e-5)


# no prefill graphs: on a GPU the tiny model's fresh prompts would replay them, apart (MixedSteps.takes)
ARGS = {"max_seq_len": 256, "max_batch_size": 8, "dtype": "float32", "kv_cache_config": {"tokens_per_block": 16},
        "torch_compile_config": None}
PROMPTS = [[(i * 7 + j * 13) % 90 + 5 for j in range(20 + 9 * i)] for i in range(5)]


async def _answers(model_dir, mixed: bool, args: dict) -> tuple[list[list[int]], dict]:
    """Five greedy requests, each sent once the one before has three tokens out: every later prompt is prefilled
    while the earlier ones decode."""
    return await staggered(model_dir, {**ARGS, **args}, PROMPTS, lambda i: 12, TorchEngineSpec(mixed_steps=mixed))


@pytest.mark.parametrize("args", [{}, {"enable_chunked_prefill": True, "max_num_tokens": 32}],
                         ids=["whole-prompts", "chunked"])
def test_the_engine_answers_alike_mixed_and_apart_and_counts_its_mixed_steps(tiny, args):
    mixed, mixed_stats = asyncio.run(_answers(tiny, True, args))
    apart, apart_stats = asyncio.run(_answers(tiny, False, args))
    assert mixed == apart
    assert all(len(tokens) == 12 for tokens in mixed)
    assert mixed_stats.get("mixed_steps", 0) >= len(PROMPTS) - 1  # every later prompt rode on a decode step
    assert mixed_stats["mixed_prompt_tokens"] > 0
    assert apart_stats.get("mixed_steps", 0) == 0

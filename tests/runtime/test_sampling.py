"""What the torch engine's sampler reports: logprobs of the model's own distribution, penalties or not."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.unit


def test_penalised_greedy_picks_are_reported_with_the_models_logprobs(tiny):
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1,
                                      presence_penalty=2.0, frequency_penalty=2.0)
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7], sampling=sampling)
            return [lp for out in [o async for o in engine.generate(req)] for lp in out.logprobs or []]

    logprobs = asyncio.run(main())
    assert len(logprobs) == 24
    # greedy on penalised logits: the pick is the top of the penalised distribution, but what is reported is the
    # model's own, where a penalised token's best rival ranks higher — so the pick is not always the raw top-1
    assert any(lp.logprob < lp.top_logprobs[0] for lp in logprobs)
    assert logprobs[0].logprob == pytest.approx(logprobs[0].top_logprobs[0])  # no penalty before the first token


def test_batched_sampling_keeps_each_rows_temperature_top_k_and_top_p():
    import torch

    from hpc.runtime.engine.torch.sampling import sample_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.01), SamplingParams(temperature=100.0)]
    draws = torch.stack([sample_rows(logits, params, gen) for _ in range(400)])  # [400, 4]
    assert set(draws[:, 0].tolist()) == {0, 1}  # top-k 2: only the two best, and both of them
    assert set(draws[:, 1].tolist()) == {0}  # the best token alone holds 64 % >= top-p 0.5
    assert set(draws[:, 2].tolist()) == {0}  # near-zero temperature is near-greedy
    assert len(set(draws[:, 3].tolist())) == 5  # a hot row reaches every token
    counts = torch.bincount(draws[:, 0], minlength=5).float() / 400
    # plain floats: pytest.approx stopped taking 0-d tensors (9.2: 'iteration over a 0-d tensor')
    assert counts[0].item() == pytest.approx(torch.softmax(torch.tensor([4.0, 3.0]), 0)[0].item(), abs=0.08)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_picks_in_a_decode_graph_are_greedy_at_zero_and_drawn_at_each_rows_temperature(device):
    import torch

    from hpc.runtime.engine.torch.sampling import graph_temperature, graph_temperatures, pick_in_graph

    torch.manual_seed(0)  # the graph draws from the default generator
    # on a GPU one argmax covers both kinds of row: a greedy row's over its logits, a hot row's over its race
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=device).repeat(4000, 1)
    temperatures = torch.tensor([0.0, 2.0], device=device).repeat_interleave(2000)
    picked = pick_in_graph(logits, temperatures).cpu()
    assert set(picked[:2000].tolist()) == {0}  # temperature 0: the argmax
    counts = torch.bincount(picked[2000:], minlength=4).float() / 2000
    torch.testing.assert_close(counts, torch.softmax(logits[0].cpu() / 2.0, 0), atol=0.03, rtol=0)
    # interleaved rows: each keeps its own kind
    mixed = torch.tensor([0.0, 2.0], device=device).repeat(2000)
    picked = pick_in_graph(logits, mixed).cpu()
    assert set(picked[0::2].tolist()) == {0} and len(set(picked[1::2].tolist())) == 4
    # rows the graph cannot pick for: any top-k below the vocabulary or top-p below 1
    class Row:  # a Seq as the engine makes it: its graph temperature set once (graph_temperature)
        def __init__(self, params: SamplingParams) -> None:
            self.graph_temperature = graph_temperature(params, vocab=4)

    plain = [Row(SamplingParams(temperature=0.7)), Row(SamplingParams(temperature=0, top_k=4))]
    assert graph_temperatures(plain) == [0.7, 0]
    assert graph_temperatures([*plain, Row(SamplingParams(temperature=1.0, top_k=3))]) is None
    assert graph_temperatures([*plain, Row(SamplingParams(temperature=1.0, top_p=0.9))]) is None


def test_a_decode_step_samples_unseeded_rows_in_one_batch(tiny, monkeypatch):
    """At temperature 1 (the OpenAI default) unseeded rows take the batched sampler; the per-row path, with
    its host round trip per row, is only for seeded, penalised or logprob rows."""
    from hpc.runtime.engine.torch import picking

    per_row, batched = [], []
    real_sample, real_rows = picking.sample, picking.sample_rows
    monkeypatch.setattr(picking, "sample", lambda *a: per_row.append(1) or real_sample(*a))
    monkeypatch.setattr(picking, "sample_rows", lambda logits, *a: batched.append(len(logits))
                        or real_rows(logits, *a))

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            async def one(seed):
                req = GenerateRequest(request_id="r", token_ids=[5, 6, 7], sampling=SamplingParams(
                    max_tokens=6, temperature=1.0, ignore_eos=True, seed=seed))
                return [t async for out in engine.generate(req) for t in out.token_ids]
            return await asyncio.gather(one(None), one(None), one(None), one(7))

    outs = asyncio.run(main())
    assert all(len(o) == 6 for o in outs)
    assert max(batched) >= 2  # rows of one step sampled together
    assert len(per_row) == 1 + 5  # the seeded request's picks: its prefill's and its five decode steps'
    # the unseeded ones' first tokens too, in their prefill steps: 3 rows batched, or fewer per step when apart
    assert sum(batched) == 3 * 6


def test_rows_of_one_temperature_draw_as_rows_of_their_own_temperatures_do():
    # one temperature for the whole batch divides by a scalar; several by a per-row tensor: both draw what the
    # tempered softmax gives, from the same random stream
    import torch

    from hpc.runtime.engine.torch.sampling import draw, sample_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    for temperatures in ([0.3] * 6, [1.0] * 6, [2.5] * 6, [0.3, 1.0, 2.5, 0.3, 1.0, 2.5]):
        want = draw(torch.softmax(logits / torch.tensor(temperatures)[:, None], -1), torch.Generator().manual_seed(7))
        got = sample_rows(logits, [SamplingParams(temperature=t) for t in temperatures],
                          torch.Generator().manual_seed(7))
        assert torch.equal(got, want)


def test_the_cpu_draw_follows_the_distribution_and_never_picks_an_impossible_token(monkeypatch):
    """On the CPU a row's token is found by one uniform in its cumulative sum (the V exponentials of the GPU's
    draw cost more than the tiny model's decode step there)."""
    import torch

    from hpc.runtime.engine.torch.sampling import draw

    gen = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0]]).repeat(20000, 1)  # masked tokens first, between, last
    counts = torch.bincount(draw(probs.clone(), gen), minlength=6).float() / 20000
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)
    unnormalised = torch.tensor([[0.0, 3.0, 1.0]]).repeat(20000, 1)  # rows need not sum to 1
    counts = torch.bincount(draw(unnormalised, gen), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.0, 0.75, 0.25]), atol=0.015, rtol=0)
    # the uniform's two ends, 0 and the largest below 1 (1 - 2^-24): the first and the last possible token, never a
    # token of probability 0 before, between or after them
    edge = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 2)
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([[0.0], [1 - 2 ** -24]]))
    assert draw(edge, gen).tolist() == [1, 3]
    monkeypatch.setattr(torch, "rand", rand)

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """HF's and vLLM's definition, over the prompt and the answer so far (TensorRT-LLM's repetition_penalty)."""
    from types import SimpleNamespace

    from hpc.runtime.engine.torch.picking import repetition_penalised

    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    seq = SimpleNamespace(request=SimpleNamespace(token_ids=[0, 1]), counts={4: 2})
    out = repetition_penalised(logits, seq, 2.0)  # type: ignore[arg-type]
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5, 1.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5, 3.0]  # a copy: logprobs report the model's own


def test_repetition_penalty_changes_greedy_picks_and_leaves_the_batched_path(tiny):
    async def main(penalty: float) -> list[int]:
        async with TorchEngine(tiny, DisaggregationMode.AGG, {"max_seq_len": 256}) as engine:
            sampling = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=penalty)
            assert engine.core.picker.batchable(sampling) is (penalty == 1.0)
            req = GenerateRequest(request_id="r", token_ids=[5, 6, 7, 5, 6, 7], sampling=sampling)
            return [t for out in [o async for o in engine.generate(req)] for t in out.token_ids]

    plain, penalised = asyncio.run(main(1.0)), asyncio.run(main(10.0))
    assert len(plain) == len(penalised) == 32
    assert len(set(penalised)) > len(set(plain))  # fewer repeats: the penalty reached the pick
    assert not {5, 6, 7} & set(penalised[:1])  # the prompt's tokens count as seen from the first pick

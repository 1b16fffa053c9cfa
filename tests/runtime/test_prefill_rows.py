"""Several prompts in one eager prefill: rows right-padded to the longest. Rows that all start at position 0 take
SDPA's causal fused path (no mask); a row that goes on from cached positions keeps the masked one. Either way each
row's last logits are what that prompt alone gives."""

from __future__ import annotations

import pytest
import torch

from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, TensorParallel, init_weights

pytestmark = pytest.mark.unit

CFG = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)


def _model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG, TensorParallel()).eval()
    init_weights(model, seed=3)
    return model


@torch.inference_mode()
def _prefill(model, cache, rows: list[list[int]], starts: list[int], slots: list[int]) -> torch.Tensor:
    width = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    positions = torch.tensor([[start + j for j in range(width)] for start in starts])
    last = torch.tensor([len(row) - 1 for row in rows]) if len(rows) > 1 else None
    return model.forward_step(model.embed(tokens), positions, torch.tensor(slots), cache, last=last)


def _alone(model, row: list[int]) -> torch.Tensor:
    """The prompt prefilled whole and alone: its last position's logits."""
    return _prefill(model, model.new_cache(1, 64, torch.float32, torch.device("cpu")), [row], [0], [0])[0]


def _recording_sdpa(monkeypatch) -> list[tuple[bool, bool]]:
    """(is_causal, masked) of each attention call."""
    import torch.nn.functional as F

    calls: list[tuple[bool, bool]] = []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        calls.append((bool(kwargs.get("is_causal")), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def test_fresh_prompts_of_different_lengths_prefill_together_as_alone(monkeypatch):
    model = _model()
    rows = [[5, 9, 17, 33, 8, 4, 90], [12, 7], [60, 61, 62, 63]]
    cache = model.new_cache(3, 64, torch.float32, torch.device("cpu"))
    calls = _recording_sdpa(monkeypatch)
    together = _prefill(model, cache, rows, [0, 0, 0], [0, 1, 2])
    assert calls == [(True, False)] * CFG.num_hidden_layers  # the fused causal path, no mask
    for i, row in enumerate(rows):
        torch.testing.assert_close(together[i], _alone(model, row), rtol=1e-4, atol=1e-4)


def test_a_row_going_on_from_its_cache_beside_a_fresh_one_sees_its_cached_tokens(monkeypatch):
    model = _model()
    prefix, rest, fresh = [5, 9, 17, 33], [8, 4, 90], [12, 7, 3]
    cache = model.new_cache(2, 64, torch.float32, torch.device("cpu"))
    _prefill(model, cache, [prefix], [0], [0])
    calls = _recording_sdpa(monkeypatch)
    together = _prefill(model, cache, [rest, fresh], [len(prefix), 0], [0, 1])
    assert calls == [(False, True)] * CFG.num_hidden_layers  # the masked path over the cache
    torch.testing.assert_close(together[0], _alone(model, prefix + rest), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(together[1], _alone(model, fresh), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens, params, eager", [
    (64 * 64, 7_500_000_000, True),  # the 8B shape, 64 prompts of 64: 130 ms eager against 174 ms graphed (H200)
    (16 * 256, 7_500_000_000, True),  # 127 against 171
    (8 * 1024, 7_500_000_000, True),
    (64 * 64, 917_504, False),  # the tiny model: 11.5 ms eager against 8.5 ms graphed, its steps all launches
    (2048, 7_500_000_000, False),  # fits the largest graph: one replay
])
def test_work_past_the_largest_graph_goes_eager_once_its_matmuls_outweigh_the_launches(tokens, params, eager):
    from hpc.runtime.engine.torch.context_steps import one_eager_step

    assert one_eager_step(tokens, 2048, params) is eager

"""The attention paths of one prompt going on from its cached positions (a later prefill chunk, a prefix-cache hit)
agree: SDPA's lower-right causal bias (flash / memory-efficient kernels on a GPU) and the general boolean mask."""

from __future__ import annotations

import pytest
import torch

from hpc.runtime.engine.models.llama import Attention, LlamaConfig, TensorParallel, rope_tables

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.unit
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("offset, length", [(32, 16), (5, 27), (64, 64)])
def test_a_prompt_going_on_from_its_cache_attends_as_the_masked_path_does(device, offset, length):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    attn = Attention(cfg, TensorParallel()).to(device).eval()
    slots = torch.tensor([1], device=device)
    cos_t, sin_t = rope_tables(cfg, torch.device(device))
    prefix = torch.randn(1, offset, cfg.hidden_size, device=device)
    chunk = torch.randn(1, length, cfg.hidden_size, device=device)

    def run(continuing: bool) -> torch.Tensor:
        cache_k = torch.zeros(3, cfg.num_key_value_heads, 256, cfg.head_dim, device=device)
        cache_v = torch.zeros_like(cache_k)
        with torch.inference_mode():
            first = torch.arange(offset, device=device)[None]  # the cached positions, from scratch
            attn(prefix, cos_t[first], sin_t[first], cache_k, cache_v, slots, first, first[:, -1] + 1,
                 from_scratch=True)
            positions = torch.arange(offset, offset + length, device=device)[None]
            window = offset + length
            return attn(chunk, cos_t[positions], sin_t[positions], cache_k, cache_v, slots, positions,
                        positions[:, -1] + 1, window=window, continuing=continuing)

    lower_right, masked = run(True), run(False)
    assert lower_right.shape == (1, length, cfg.hidden_size)
    torch.testing.assert_close(lower_right, masked, rtol=1e-4, atol=1e-4)

"""The fused decode kernels against the torch reference path (on CPU through Triton's interpreter)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hpc.runtime.engine.models.llama import LlamaConfig, LlamaForCausalLM, init_weights

pytestmark = pytest.mark.unit

triton = pytest.importorskip("triton", reason="Triton is not installed (the CI installs it for these tests)")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without a GPU these kernels run only under TRITON_INTERPRET=1 (set in tests/conftest.py)",
                allow_module_level=True)

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
EXPERTS = dataclasses.replace(CFG, num_local_experts=4)  # Mixtral's feed-forward: batched steps only


def _models(device: torch.device, dtype: torch.dtype, cfg: LlamaConfig = CFG):
    reference = LlamaForCausalLM(cfg)
    init_weights(reference, seed=3)
    gen = torch.Generator().manual_seed(4)
    for name, param in reference.named_parameters():  # non-trivial norms, so a skipped scale shows
        if name.endswith("norm.weight"):
            param.data.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    fused = LlamaForCausalLM(cfg)
    fused.load_state_dict(reference.state_dict())
    reference = reference.to(device, dtype).eval().fuse_projections()
    fused = fused.to(device, dtype).eval().enable_fused_decode()
    return reference, fused


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("chunk", [4, 64], ids=["many-chunks", "one-chunk"])
@pytest.mark.parametrize("slots,forced,cfg", [([0], None, CFG), ([2, 0, 3], None, CFG),
                                              ([5, 0, 3, 1, 6, 2], None, CFG), ([5, 0, 3, 1, 6, 2], "gemv", CFG),
                                              ([5, 0, 3, 1, 6, 2], None, EXPERTS)],
                         ids=["1-row", "3-rows", "6-rows-batched", "6-rows-gemv", "6-rows-experts"])
def test_decode_steps_match_the_reference(slots: list[int], forced: str | None, cfg: LlamaConfig, chunk: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Either path past MAX_BATCH rows (a graph is captured on the faster: DecodeGraphs.capture)."""
    import contextlib

    from hpc.runtime.engine.kernels import decode_kernels, fused_decode

    monkeypatch.setattr(decode_kernels, "ATTN_CHUNK", chunk)  # positions 0..13 span up to 4 chunks of 4
    monkeypatch.setattr(decode_kernels, "ATTN_CHUNK_BATCHED", chunk)  # the same past MAX_BATCH rows
    device, dtype = _device(), torch.float32
    reference, fused = _models(device, dtype, cfg)
    gen = torch.Generator().manual_seed(7)
    caches = [m.new_cache(8, 32, dtype, device) for m in (reference, fused)]
    slot_ids = torch.tensor(slots, device=device)
    # prefill rows of different lengths (torch path for both), then one-token steps
    lengths = [5, 1, 9, 3, 7, 2][:len(slots)]
    batched_calls = []
    batched = fused.fused_decode.batched
    monkeypatch.setattr(fused.fused_decode, "batched", lambda *a: batched_calls.append(1) or batched(*a))
    reference.fused_decode = None  # the reference stays on the torch path
    for row, length in enumerate(lengths):
        ids = torch.randint(2, CFG.vocab_size, (1, length), generator=gen).to(device)
        for model, cache in zip((reference, fused), caches):
            model.forward_step(model.embed(ids), torch.arange(length, device=device)[None], slot_ids[row:row + 1],
                               cache)
    positions = torch.tensor([[n] for n in lengths], device=device)
    with fused.fused_decode.path(forced) if forced else contextlib.nullcontext():
        for _ in range(4):
            ids = torch.randint(2, CFG.vocab_size, (len(slots), 1), generator=gen).to(device)
            want = reference.forward_step(reference.embed(ids), positions, slot_ids, caches[0])
            got = fused.forward_step(fused.embed(ids), positions, slot_ids, caches[1])
            assert fused.fused_decode.supports(fused.embed(ids))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for ref_layer, fused_layer in zip(*caches):  # the new K/V landed in the right slot and position
                torch.testing.assert_close(fused_layer, ref_layer, rtol=1e-5, atol=1e-5)
            positions += 1
    # past MAX_BATCH rows: cuBLAS matmuls around the same Triton attention (unless the GEMVs are forced); up to
    # it: the fused GEMVs; with experts every one-token step, the one-token prompt's too
    want_batched = 5 if cfg.moe else 4 if len(slots) > fused_decode.MAX_BATCH and forced != "gemv" else 0
    assert len(batched_calls) == want_batched
    # each head's last chunk merged them and set its arrival count back, ready for the next step
    assert fused.fused_decode.counts.count_nonzero() == 0


def test_few_rows_attend_per_query_head_and_batches_per_query_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to MAX_BATCH rows (the GEMV path) ATTN_CHUNK positions per program and a program per query head, past
    it ATTN_CHUNK_BATCHED and a program per query group (in tensor-core tiles): on an H200 the first was faster at
    batch 1, the second at batch 32 and 64 (benchmarks/decode_knobs.py, decode_profile.py)."""
    from hpc.runtime.engine.kernels import decode_kernels, fused_decode

    chunks, grouped = [], []
    attention = decode_kernels.decode_attention
    monkeypatch.setattr(decode_kernels, "decode_attention", lambda *a, **k: chunks.append(a[-1])
                        or grouped.append(k.get("grouped", False)) or attention(*a, **k))
    device, dtype = _device(), torch.float32
    _, fused = _models(device, dtype)
    cache = fused.new_cache(8, 32, dtype, device)
    for rows in (1, fused_decode.MAX_BATCH + 1):
        ids = torch.randint(2, CFG.vocab_size, (rows, 1)).to(device)
        fused.forward_step(fused.embed(ids), torch.full((rows, 1), 3, device=device),
                           torch.arange(rows, device=device), cache)
    layers = CFG.num_hidden_layers
    assert chunks == [decode_kernels.ATTN_CHUNK] * layers + [decode_kernels.ATTN_CHUNK_BATCHED] * layers
    assert grouped == [False] * layers + [True] * layers
    assert decode_kernels.ATTN_CHUNK != decode_kernels.ATTN_CHUNK_BATCHED


def _launches(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list:
    """The grids of each launch of the Triton kernel `name` in `module`, which still runs."""
    grids: list = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name,
                        type("Counted", (), {"__getitem__": lambda _, grid: grids.append(grid) or kernel[grid]})())
    return grids


def _attention_inputs(seed: int, heads: int, kv_heads: int, rows: int, dim: int = 16):
    """A cache of 4 slots x 200 positions, one new token's q/k/v per row at positions 130, 5 and 64 of slots
    2, 0 and 3, and RoPE tables: decode_attention's arguments up to heads."""
    device = _device()
    gen = torch.Generator().manual_seed(seed)
    cache = [torch.randn(4, kv_heads, 200, dim, generator=gen).to(device) for _ in range(2)]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(device)
    slots, positions = torch.tensor([2, 0, 3], device=device), torch.tensor([130, 5, 64], device=device)
    cos, sin = (torch.randn(200, dim, generator=gen).to(device) for _ in range(2))
    return cache, qkv, slots, positions, cos, sin


def test_attention_merges_in_its_own_launch_or_in_a_second_one_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """With arrival counts the last chunk of each head merges; without (or too few counts), a merge kernel."""
    from hpc.runtime.engine.kernels import decode_kernels

    merges = _launches(monkeypatch, decode_kernels, "_attention_merge_kernel")
    device = _device()
    heads, kv_heads, rows = 4, 2, 3
    cache, qkv, slots, positions, cos, sin = _attention_inputs(9, heads, kv_heads, rows)
    outs = []
    for counts in (None, torch.zeros(rows * heads - 1, dtype=torch.int32, device=device),
                   torch.zeros(rows * heads, dtype=torch.int32, device=device)):
        caches = [c.clone() for c in cache]
        outs.append(decode_kernels.decode_attention(qkv, *caches, slots, positions, cos, sin, heads, kv_heads,
                                                    counts))
        assert counts is None or counts.count_nonzero() == 0
    assert merges == [(rows, heads)] * 2  # the third call merged inside its one launch
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-6, atol=1e-6)


def test_prefill_keeps_the_torch_path_and_every_decode_batch_the_triton_attention() -> None:
    _, fused = _models(_device(), torch.float32)
    assert not fused.fused_decode.supports(torch.zeros(1, 4, CFG.hidden_size))
    assert fused.fused_decode.supports(torch.zeros(64, 1, CFG.hidden_size))
    assert fused.fused_decode.supports(torch.zeros(3, 1, CFG.hidden_size))


def test_a_mixed_steps_decode_rows_take_the_triton_attention_and_answer_as_the_torch_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """forward_mixed: the decode rows' attention through the kernel beside a prompt's, as the torch path's."""
    from hpc.runtime.engine.models.llama import StepRows

    device, dtype = _device(), torch.float32
    reference, fused = _models(device, dtype)
    reference.fused_decode = None
    calls = []
    attention = fused.fused_decode.attention
    monkeypatch.setattr(fused.fused_decode, "attention", lambda *a: calls.append(a[1].shape[0]) or attention(*a))
    caches = [m.new_cache(8, 32, dtype, device) for m in (reference, fused)]
    gen = torch.Generator().manual_seed(8)
    for slot, length in ((0, 6), (2, 11)):
        ids = torch.randint(2, CFG.vocab_size, (1, length), generator=gen).to(device)
        for model, cache in zip((reference, fused), caches):
            model.forward_step(model.embed(ids), torch.arange(length, device=device)[None],
                               torch.tensor([slot], device=device), cache)
    tokens = torch.randint(2, CFG.vocab_size, (2, 1), generator=gen).to(device)
    prompt = torch.randint(2, CFG.vocab_size, (1, 5), generator=gen).to(device)
    got = []
    for model, cache in zip((reference, fused), caches):
        decode = StepRows(model.embed(tokens), torch.tensor([[6], [11]], device=device),
                          torch.tensor([0, 2], device=device), window=12)
        prompts = StepRows(model.embed(prompt), torch.arange(5, device=device)[None], torch.tensor([5], device=device),
                           window=5, fresh=True, last=torch.tensor([4], device=device))
        got.append(model.forward_mixed(decode, [prompts], cache))
    assert calls == [2] * CFG.num_hidden_layers  # the kernel ran for the two decode rows in every layer
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].whole, caches[0].whole, rtol=1e-5, atol=1e-5)


def test_gemv_prologues_and_epilogue() -> None:
    from hpc.runtime.engine.kernels.decode_kernels import gemv

    gen = torch.Generator().manual_seed(1)
    device = _device()
    x = torch.randn(3, 2 * 40, generator=gen).to(device)
    weight = torch.randn(30, 40, generator=gen).to(device)
    residual = torch.randn(3, 30, generator=gen).to(device)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(gemv(x, weight, silu_mul=True, residual=residual),
                               residual + (torch.nn.functional.silu(gate) * up) @ weight.T, rtol=1e-4, atol=1e-4)
    norm = torch.rand(40, generator=gen).to(device) + 0.5
    plain = x[:, :40].contiguous()
    normed = plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    torch.testing.assert_close(gemv(plain, weight, norm=norm, out_dtype=torch.float64),
                               (normed @ weight.T).double(), rtol=1e-4, atol=1e-4)


def test_a_gemv_is_tuned_for_its_rows_class_and_each_row_count_computes_the_same() -> None:
    from hpc.runtime.engine.kernels import decode_kernels
    from hpc.runtime.engine.kernels.decode_kernels import gemv, row_class

    assert [row_class(r) for r in (1, 2, 16, 17, 64, 65)] == [1, 16, 16, 64, 64, 64]
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 40, generator=gen).to(_device())
    x = torch.randn(64, 40, generator=gen).to(_device())
    for rows in (1, 5, 64):  # the same rows alone or among more give the same result, whatever the tile
        torch.testing.assert_close(gemv(x[:rows].contiguous(), weight), x[:rows] @ weight.T, rtol=1e-4, atol=1e-4)
    if torch.cuda.is_available():  # the interpreter has one config and tunes nothing
        tuned = {key[4] for key in decode_kernels._gemv_kernel.cache if key[:2] == (48, 40)}
        assert tuned == {1, 16, 64}, decode_kernels._gemv_kernel.cache


def test_a_gemv_over_several_slices_of_k_with_each_prologue() -> None:
    """K = 520 spans several BLOCK_K slices of any config (the interpreter's takes 256), so the loop over K runs;
    20 rows and 70 outputs, not a multiple of any tile."""
    from hpc.runtime.engine.kernels.decode_kernels import gemv

    gen = torch.Generator().manual_seed(5)
    device = _device()
    k = 520
    x = torch.randn(20, 2 * k, generator=gen).to(device)
    weight = (torch.randn(70, k, generator=gen) / k ** 0.5).to(device)
    residual = torch.randn(20, 70, generator=gen).to(device)
    norm = torch.rand(k, generator=gen).to(device) + 0.5
    plain = x[:, :k].contiguous()
    gate, up = x.chunk(2, dim=-1)
    normed = plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    for got, want in ((gemv(plain, weight), plain @ weight.T), (gemv(plain, weight, norm=norm), normed @ weight.T),
                      (gemv(x, weight, silu_mul=True, residual=residual),
                       residual + (torch.nn.functional.silu(gate) * up) @ weight.T)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_add_rms_norm_and_silu_mul_answer_as_the_torch_modules() -> None:
    """The batched decode's element-wise launches: h + delta rounded to h's dtype, then its norm (or the norm of h
    alone); SiLU(gate) · up of [gate | up]."""
    from hpc.runtime.engine.kernels.decode_kernels import add_rms_norm, silu_mul
    from hpc.runtime.engine.models.llama import RMSNorm

    device = _device()
    gen = torch.Generator().manual_seed(5)
    h, delta = (torch.randn(6, 72, generator=gen).to(device) for _ in range(2))  # 72: a block of 128, masked
    norm = RMSNorm(72, 1e-5).to(device)
    norm.weight.data.copy_(torch.rand(72, generator=gen) + 0.5)
    total, normed = add_rms_norm(h, delta, norm.weight, 1e-5)
    torch.testing.assert_close(total, h + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm(h + delta), rtol=1e-6, atol=1e-6)
    same, normed = add_rms_norm(h, None, norm.weight, 1e-5)
    assert same is h
    torch.testing.assert_close(normed, norm(h), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(6, 2 * 1100, generator=gen).to(device)  # two blocks of 1,024, the second masked
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_add_residual_rounds_once() -> None:
    from hpc.runtime.engine.kernels.decode_kernels import add_residual

    gen = torch.Generator().manual_seed(2)
    partial = torch.randn(2, 3000, generator=gen).to(_device())
    residual = torch.randn(2, 3000, generator=gen).to(_device(), torch.bfloat16)
    got, want = add_residual(partial, residual), (partial + residual.float()).to(torch.bfloat16)
    if torch.cuda.is_available():
        assert torch.equal(got, want)
    else:  # Triton's CPU interpreter truncates to bf16 where the GPU rounds to nearest: one unit apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU (the CPU interpreter truncates bf16)")
def test_bf16_fused_logits_are_as_close_to_fp32_as_the_torch_path() -> None:
    device = torch.device("cuda")
    reference, _ = _models(device, torch.float32)
    plain, fused = _models(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    caches = [m.new_cache(2, 64, dtype, device) for m, dtype in
              ((reference, torch.float32), (plain, torch.bfloat16), (fused, torch.bfloat16))]
    prompt = torch.randint(2, CFG.vocab_size, (1, 20), generator=gen).to(device)
    slots = torch.tensor([1], device=device)
    for model, cache in zip((reference, plain, fused), caches):
        model.forward_step(model.embed(prompt), torch.arange(20, device=device)[None], slots, cache)
    errors = {"torch": [], "fused": []}
    for step in range(20):
        ids = torch.randint(2, CFG.vocab_size, (1, 1), generator=gen).to(device)
        pos = torch.tensor([[20 + step]], device=device)
        want = reference.forward_step(reference.embed(ids), pos, slots, caches[0])
        for name, model, cache in (("torch", plain, caches[1]), ("fused", fused, caches[2])):
            got = model.forward_step(model.embed(ids), pos, slots, cache)
            errors[name].append(float((got - want).norm() / want.norm()))
    assert max(errors["fused"]) < 5e-2, errors  # bf16 keeps ~3 significant digits
    assert sum(errors["fused"]) <= 1.5 * sum(errors["torch"]), errors


def test_grouped_attention_reads_each_kv_head_once_and_answers_as_per_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """grouped: one program per KV head's query group (8B: 8 programs a row and chunk instead of 32), the same
    outputs and the same new K/V in the cache, merged in its own launch or by the merge kernel; with `tile`, the
    group's queries in tensor-core dots over tiles of a chunk (two tiles of 16 a chunk of 32, or one of 64 masked
    at the chunk's end), else the group's heads one by one."""
    from hpc.runtime.engine.kernels import decode_kernels

    per_head = _launches(monkeypatch, decode_kernels, "_attention_chunk_kernel")
    tiled = _launches(monkeypatch, decode_kernels, "_attention_group_kernel")
    device = _device()
    heads, kv_heads, rows = 8, 2, 3
    cache, qkv, slots, positions, cos, sin = _attention_inputs(11, heads, kv_heads, rows)
    results = {}
    for grouped, tile in ((False, 0), (True, 0), (True, 16), (True, 64)):
        for counts in (None, torch.zeros(rows * heads, dtype=torch.int32, device=device)):
            caches = [c.clone() for c in cache]
            out = decode_kernels.decode_attention(qkv, *caches, slots, positions, cos, sin, heads, kv_heads, counts,
                                                  chunk=32, grouped=grouped, tile=tile)
            assert counts is None or counts.count_nonzero() == 0
            results[grouped, tile, counts is None] = (out, caches)
    want_out, want_caches = results[False, 0, True]
    for out, caches in results.values():
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
        for got, want in zip(caches, want_caches):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    chunks = 200 // 32 + 1
    assert per_head == [(rows, heads, chunks)] * 2 + [(rows, kv_heads, chunks)] * 2
    assert tiled == [(rows, kv_heads, chunks)] * 4

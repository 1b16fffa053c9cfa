"""The torch reference engine beside plain PyTorch on one GPU, in one run (issue #63's goals 1, 2 and 4):

    python benchmarks/reference_engine.py [--json PATH] [--model llama-8b-shape]

1. Prefill of `--prompts` x `--prompt-tokens` (8 x 1,024): transformers' own LlamaForCausalLM (sdpa, bf16, random
   weights, the same shapes, one batched forward with its KV cache) against the engine answering the same number
   of concurrent requests for one token each (their time to the last first token), for each prefill
   configuration: the recipe's default (prefill CUDA graphs on) and prefill graphs off. The engine's prefill
   steps for those prompts are counted: one batched step is what the goal asks.
2. Decode at batch 32 and 64: the engine's tokens/s once every request decodes, against the memory bound it
   prints: a step reads every weight but the embeddings and each row's KV, at this GPU's copy bandwidth.

Prints one table; `--json PATH` writes the figures. The served stack's figures (llama8b-agg at 1,024 / 128) come
from `hpc bench`; this script measures the engine and its plain reference only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check import copy_bandwidth, weight_bytes  # noqa: E402

from hpc.engine_args.precedence import TORCH_ENGINE_DEFAULTS, deep_update  # noqa: E402
from hpc.model.info import ModelInfo  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402

ROUNDS = 5


@torch.inference_mode()
def transformers_prefill(model_dir, prompts: int, tokens: int, device: str = "cuda") -> float:
    """Seconds of one batched forward over `prompts` x `tokens` in transformers' Llama (median of ROUNDS)."""
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in ModelInfo.read(model_dir).config.items()
                                         if not k.startswith("hpc_")})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    ids = torch.randint(100, config.vocab_size - 1, (prompts, tokens), device=device)
    times = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(ROUNDS + 2):
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)  # the first tokens' logits, as a server needs
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(times)


def _request(i: int, ids: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", token_ids=ids,
                           sampling=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


async def _prefill_round(engine: TorchEngine, prompts: list[list[int]]) -> tuple[float, int]:
    """Seconds until every prompt has its first token, and the engine's prefill steps for them."""
    steps = engine.stats().get("prefill_steps", 0)

    async def one(i: int, ids: list[int]) -> None:
        async for _ in engine.generate(_request(i, ids, 1)):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - t0, int(engine.stats().get("prefill_steps", 0) - steps)


async def _decode_round(engine: TorchEngine, batch: int, prompt: int, steps: int) -> float:
    """Tokens/s while all `batch` requests decode: the tokens that came between the last first token and the
    first request's end, over that time."""
    stamps: list[list[float]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        ids = [100 + (7 * i + j) % min(5000, engine.core.cfg.vocab_size - 100) for j in range(prompt)]
        async for out in engine.generate(_request(i, ids, steps)):
            stamps[i].extend([time.perf_counter()] * len(out.token_ids))

    await asyncio.gather(*(one(i) for i in range(batch)))
    start, end = max(row[0] for row in stamps), min(row[-1] for row in stamps)
    inside = sum(1 for row in stamps for t in row if start < t <= end)
    return inside / max(end - start, 1e-9)


def decode_bound(engine: TorchEngine, bandwidth: float, batch: int, context: int) -> float:
    """Tokens/s if a step only read its bytes at copy speed: the weights (no embeddings) and each row's KV."""
    weights = weight_bytes(engine.core.model)
    cfg = engine.core.cfg
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    return batch * bandwidth / (weights + kv * batch * context)


async def engine_figures(model_dir, args, extra: dict) -> dict:
    engine_args = deep_update(TORCH_ENGINE_DEFAULTS, {"dtype": "bfloat16", "max_seq_len": 2048,
                                                      "max_batch_size": max(64, args.prompts), **extra})
    rng = random.Random(0)
    vocab = int(ModelInfo.read(model_dir).config["vocab_size"])

    def fresh() -> list[list[int]]:  # new prompts each round: a prompt seen before would come from the prefix cache
        return [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]

    out: dict = {}
    async with TorchEngine(model_dir, DisaggregationMode.AGGREGATED, engine_args) as engine:
        await _prefill_round(engine, fresh())  # warm: these shapes
        rounds = [await _prefill_round(engine, fresh()) for _ in range(ROUNDS)]
        out["prefill_s"] = statistics.median(r[0] for r in rounds)
        out["prefill_steps"] = statistics.median(r[1] for r in rounds)
        if args.decode:
            bandwidth = copy_bandwidth(torch.device("cuda"), best_of=5)
            for batch in (32, 64):
                await _decode_round(engine, batch, args.decode_prompt, 16)  # warm
                tok_s = statistics.median([await _decode_round(engine, batch, args.decode_prompt,
                                                               args.decode_steps) for _ in range(3)])
                context = args.decode_prompt + args.decode_steps // 2
                out[f"decode_{batch}"] = {"tok_s": tok_s, "bound_tok_s": decode_bound(engine, bandwidth, batch,
                                                                                       context)}
            out["copy_gb_s"] = bandwidth / 1e9
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-8b-shape")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-prompt", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--no-decode", action="store_true", help="prefill only")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("reference_engine: needs a CUDA GPU")
    model_dir = ensure_model(f"~/.cache/hpc/models/{args.model}", args.model)
    tokens = args.prompts * args.prompt_tokens
    reference = transformers_prefill(model_dir, args.prompts, args.prompt_tokens)
    configs = {"recipe default (prefill graphs on)": {},
               "prefill graphs off": {"torch_compile_config": {"enable_piecewise_cuda_graph": False}}}
    figures: dict = {"gpu": torch.cuda.get_device_name(), "model": args.model, "prompts": args.prompts,
                     "prompt_tokens": args.prompt_tokens, "transformers_prefill_s": reference, "engine": {}}
    for i, (name, extra) in enumerate(configs.items()):
        args.decode = i == 0 and not args.no_decode
        figures["engine"][name] = asyncio.run(engine_figures(model_dir, args, extra))
    print(f"{args.model} on {figures['gpu']}: prefill {args.prompts} x {args.prompt_tokens} (bf16, random weights)")
    print(f"{'path':<40} {'ms':>8} {'tok/s':>9} {'steps':>6} {'x transformers':>15}")
    print(f"{'transformers LlamaForCausalLM (sdpa)':<40} {reference * 1e3:>8.1f} {tokens / reference:>9.0f} "
          f"{1:>6} {1.0:>15.2f}")
    for name, got in figures["engine"].items():
        print(f"{'engine, ' + name:<40} {got['prefill_s'] * 1e3:>8.1f} {tokens / got['prefill_s']:>9.0f} "
              f"{got['prefill_steps']:>6.0f} {reference / got['prefill_s']:>15.2f}")
    decode = next(iter(figures["engine"].values()))
    if "copy_gb_s" not in decode:
        return _write(args.json, figures)
    print(f"decode (context {args.decode_prompt}-{args.decode_prompt + args.decode_steps}, copy "
          f"{decode['copy_gb_s']:.0f} GB/s)")
    print(f"{'batch':<8} {'tok/s':>9} {'memory bound':>13} {'of bound':>9}")
    for batch in (32, 64):
        d = decode[f"decode_{batch}"]
        print(f"{batch:<8} {d['tok_s']:>9.0f} {d['bound_tok_s']:>13.0f} {d['tok_s'] / d['bound_tok_s']:>9.0%}")
    _write(args.json, figures)


def _write(path: str | None, figures: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()

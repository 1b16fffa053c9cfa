"""The scheduler thread's host time for one overlapped decode step of N rows, without a GPU (runs anywhere).

    python benchmarks/decode_host_step.py [--rows 1,8,32,64] [--steps 2000] [--rounds 5] [--profile]
                                          [--steps-a-replay 1,4,8]

The real engine's decode step (`DecodeSteps._decode_step`: the rows carried over, the inputs staged, the graph
replayed, the step before emitted as bare tokens through an engine process's `LinkEmitter`) on rows that never
end, with the device's part left out: a decode graph per size (`DecodeGraphs`, TensorRT-LLM's padded sizes, as
the engine's defaults capture on a GPU) whose replay does nothing, its
outputs (fixed logits, a fixed pick) made once at capture. What is left is the host's work per step, which bounds
a small model's decode step at high concurrency (the tiny model's 64-row replay is ~110 µs on an H200, the
stack's decode step 0.2-0.3 ms), less the graph launch itself. Prints the best and median of the rounds, µs a
launch, and the best per token a row: with several decode steps a replay (DecodeGraphs' `steps`) a launch carries
that many tokens a row.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _cpu_speed import reference_us  # noqa: E402
from hpc.engine_args.cuda_graphs import GraphSizes, generated_sizes  # noqa: E402
from hpc.runtime.engine.torch.decode_graphs import DecodeGraphs  # noqa: E402
from hpc.runtime.engine.builds import ensure_model  # noqa: E402
from hpc.runtime.engine.torch.engine import TorchEngine  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams  # noqa: E402
from hpc.runtime.worker.engine_core import Keyed, LinkEmitter  # noqa: E402

MAX_ROWS = 64
PROMPT = 3


def engine_with_stand_in_graphs(model_dir: Path, steps: int = 1) -> tuple[TorchEngine, list[int]]:
    """A decode engine (not started: no scheduler thread) whose graphs' replays do nothing, and whose outputs are
    counted (tokens sent); `steps` decode steps a replay (their copies then made in the graph, as on a GPU)."""
    engine = TorchEngine(model_dir, DisaggregationMode.DECODE, {"max_batch_size": MAX_ROWS}, device="cpu")
    engine.load()
    logits = torch.zeros(MAX_ROWS, 8)
    picks = torch.full((MAX_ROWS,), 7, dtype=torch.long)
    engine.core.graphs = DecodeGraphs(lambda tokens, positions, slots: logits[:tokens.shape[0]],
                                 GraphSizes(tuple(generated_sizes(MAX_ROWS, True)), padding=True),
                                 scratch_slot=MAX_ROWS,
                                 device=torch.device("cpu"), pick=lambda lg, temperatures: picks[:lg.shape[0]],
                                 copies_in_graph=steps > 1, steps=steps)
    engine.core.graphs.capture(lambda step: (lambda: None, step()))
    sent: list[int] = []
    engine.core.emitter = LinkEmitter(lambda message: sent.append(len(message.tokens)), lambda key: None)
    return engine, sent


def rows_of(engine: TorchEngine, rows: int) -> list:
    """`rows` requests as the scheduler holds them mid-decode: in their slots, streamed already, never ending."""
    running = []
    for i in range(rows):
        request = GenerateRequest(request_id=f"r{i}", token_ids=list(range(2, 2 + PROMPT)), streaming=True,
                                  sampling=SamplingParams(max_tokens=10**9, temperature=0, ignore_eos=True))
        seq = engine._seq(request, None, Keyed(i))
        seq.slot, seq.length, seq.last_token, seq.streamed = i, PROMPT, 5, True
        running.append(seq)
    return running


def steps(engine: TorchEngine, running: list, count: int) -> None:
    for i in range(count):
        # the cache's end is never reached: lengths back to the prompt's
        if i % (1000 // engine.core.graphs.steps) == 0:
            for seq in running:
                seq.length = PROMPT
        engine.decode._decode_step(running)
    assert all(seq.slot >= 0 for seq in running), "a row ended"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest row count's steps after")
    parser.add_argument("--steps-a-replay", default="1,4,8", help="decode steps one graph replay runs (comma list)")
    args = parser.parse_args()
    model_dir = ensure_model(os.path.join(os.environ.get("HPC_TEST_MODELS", "~/.cache/hpc/models"), "tiny"), "tiny")
    print(f"a decode launch's host time, µs (best / median of {args.rounds} rounds of {args.steps} launches), the "
          f"device stood in for on {torch.get_num_threads()} CPU threads")
    print(f"{'rows':>5} {'steps':>6} {'best':>8} {'median':>8} {'best a token':>13} {'best / reference':>17} "
          f"{'tokens sent':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        for per_replay in (int(k) for k in args.steps_a_replay.split(",")):
            engine, sent = engine_with_stand_in_graphs(model_dir, per_replay)
            running = rows_of(engine, rows)
            steps(engine, running, 200)
            rounds, relative = [], []
            for _ in range(args.rounds):
                before = reference_us()
                began = time.perf_counter()
                steps(engine, running, args.steps)
                rounds.append((time.perf_counter() - began) / args.steps * 1e6)
                relative.append(rounds[-1] / min(before, reference_us()))
            carried = engine.core.counters.get("decode_steps_carried_in_graph", 0)
            assert carried >= args.rounds * args.steps, "the launches took the decode worker's path: carried in graph"
            multi = engine.core.counters.get("decode_launches_multi_step_total", 0)
            assert per_replay == 1 or multi >= args.rounds * args.steps, f"not {per_replay} steps a replay: {multi}"
            assert sum(sent) >= rows * per_replay * args.rounds * args.steps, "every row's token of every step was sent"
            print(f"{rows:>5} {per_replay:>6} {min(rounds):>8.1f} {statistics.median(rounds):>8.1f} "
                  f"{min(rounds) / per_replay:>13.1f} {min(relative):>17.3f} {sum(sent):>12}")
            if args.profile and rows == max(int(r) for r in args.rows.split(",")):
                profile = cProfile.Profile()
                profile.runcall(steps, engine, running, args.steps)
                pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

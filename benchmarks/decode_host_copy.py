"""Host time of an overlapped decode step's copy of its tokens to the host (HostCopies.start), on a CUDA GPU:

    python benchmarks/decode_host_copy.py [--steps 20000] [--rows 64] [--rounds 3]

`reused`: the engine's HostCopies (an event per pinned buffer, recorded again); `new event`: a new CUDA event a
step, as HostCopies made until session 19 (created and destroyed once each step). Each step copies `rows` tokens
picked on the device, as the decode scheduler does after each launch; the device runs nothing else, so what is
timed is the host's part (the thread's CPU time per step, microseconds; best round of `rounds`).
"""

from __future__ import annotations

import argparse
import time

import torch

from hpc.runtime.engine.torch.overlap import HostCopies


def new_event_each_step(rows: int):
    buffers = [torch.empty(rows, dtype=torch.long, pin_memory=True) for _ in range(2)]
    turn = [0]

    def start(tokens: torch.Tensor):
        host = buffers[turn[0]][:tokens.shape[0]]
        turn[0] ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done
    return start


def timed(start, tokens: torch.Tensor, steps: int) -> float:
    previous = None
    began = time.thread_time()
    for _ in range(steps):
        step = start(tokens)
        if previous is not None and not previous[1].query():  # read before its buffer comes round, as the engine
            previous[1].synchronize()
        previous = step
    torch.cuda.synchronize()
    return (time.thread_time() - began) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_host_copy: needs a CUDA GPU")
    tokens = torch.arange(args.rows, device="cuda")
    ways = {"reused": HostCopies(args.rows, torch.device("cuda")).start, "new event": new_event_each_step(args.rows)}
    for start in ways.values():
        timed(start, tokens, 100)  # pinned buffers made, CUDA's first calls paid
    results = {name: [] for name in ways}
    for _ in range(args.rounds):  # alternating: a machine's drift hits both
        for name, start in ways.items():
            results[name].append(timed(start, tokens, args.steps))
    print(f"a decode step's tokens to the host, {args.rows} rows, {args.steps} steps, "
          f"{torch.cuda.get_device_name()} (host CPU µs a step, best of {args.rounds}):")
    for name, values in results.items():
        print(f"  {name:10s} {min(values):7.2f}   rounds " + " / ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()

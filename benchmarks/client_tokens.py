"""CPU time per streamed token of `hpc bench`'s load generator, against a fake server (no model, no stack):

    python benchmarks/client_tokens.py [--concurrency 8] [--output-tokens 64] [--requests 400] [--step-ms 0.25]

The server (a process of its own) answers each completion with chunked SSE as the frontend does — one HTTP chunk
per event, `data: {...}` text_completion events, the usage event, `[DONE]` — writing one event to every open
stream each `--step-ms` (a decode step of the whole batch). The client is the real load generator
(`hpc.bench.clients.run_level`, one process, a closed loop); its process CPU time over the level divided by the
tokens it counted is the figure: at 20 µs a token one client process parses 50k tokens/s at most, and a level it
keeps busy measures the client, not the stack (`hpc bench` spreads users over processes, hpc/bench/clients.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

EVENT = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795770000,"model":"hpc/tiny",'
         b'"system_fingerprint":"hpc-torch","choices":[{"index":0,"text":" word","logprobs":null,'
         b'"finish_reason":null}]}\n\n')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(port_file: str, step_s: float) -> None:
    streams: list[list] = []  # [writer, tokens left, done, tokens in all]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            done = asyncio.get_running_loop().create_future()
            streams.append([writer, int(body["max_tokens"]), done, int(body["max_tokens"])])
            await done

    async def tick() -> None:
        while True:
            await asyncio.sleep(step_s)
            for stream in list(streams):
                writer, left, done, total = stream
                stream[1] = left - 1
                if left > 1:
                    writer.write(chunk(EVENT))
                    continue
                usage = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d}}\n\n' % total
                writer.write(chunk(EVENT) + chunk(usage) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                streams.remove(stream)
                done.set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    with open(port_file, "w") as f:
        f.write(str(server.sockets[0].getsockname()[1]))
    await tick()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.step_ms / 1e3))
        return
    from hpc.bench.clients import run_client
    from hpc.bench.clients import run_level
    from hpc.bench.loadgen import Level

    port_file = f"/tmp/client_tokens.{os.getpid()}.port"
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file, "--step-ms", str(args.step_ms)])
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{open(port_file).read()}"
        level = Level(args.concurrency, 8, args.output_tokens, args.requests)
        # on the loop hpc bench's client processes run (uvloop where installed)
        run_client(run_level(url, "hpc/tiny", Level(1, 8, args.output_tokens, 4), True, 0))  # warm
        rows = []
        for _ in range(args.rounds):
            cpu0, t0 = time.process_time(), time.perf_counter()
            result = run_client(run_level(url, "hpc/tiny", level, True, 0))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            tokens = result["output_tokens_per_s"] * result["duration_s"]
            if tokens < args.requests * args.output_tokens:  # every token counted, or the client did not run
                raise SystemExit(f"the client counted {tokens:.0f} of {args.requests * args.output_tokens} tokens")
            rows.append((cpu / tokens * 1e6, cpu / wall, result["output_tokens_per_s"]))
    finally:
        server.kill()
        os.unlink(port_file)
    print(f"load generator, one process, c={args.concurrency}, {args.output_tokens} tokens a request, an event each "
          f"{args.step_ms} ms per stream (best of {args.rounds}):")
    best = min(rows)
    print(f"  client CPU µs a token {best[0]:6.2f}   rounds " + " / ".join(f"{r[0]:.2f}" for r in rows))
    print(f"  client busy           {best[1]:6.0%}   tokens/s {best[2]:,.0f}")


if __name__ == "__main__":
    main()

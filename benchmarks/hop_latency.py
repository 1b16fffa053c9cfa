"""What one hop between two of the stack's processes costs on this machine: a message's round trip, halved.

    python benchmarks/hop_latency.py [--trips 2000] [--spin-us 0,50,200] [--gap-us 0,1000]

A request at c=1 crosses six such hops before its first token is back (client -> frontend -> worker -> engine
process and back), each a wake-up of a process asleep in select/epoll. On a VM each wake-up goes through the
hypervisor (an IPI to a halted vCPU), which bare metal pays far less for. The echo side waits in four ways:
blocking in select() as the engine process's scheduler does when idle (worker/engine_link.py Poller), spinning on
a non-blocking read for up to --spin-us before that select, on an asyncio event loop (uvloop where installed), as
the workers and the frontend do; and the pinger itself always blocks. Prints the median and p99 round trip in µs.

--gap-us: the pinger sleeps that long before each trip, so the echo side has been idle as long. Back-to-back trips
keep its CPU awake; at c=1 a stage of the stack idles about a millisecond between a request's last token and the
next request, and a CPU idle that long may have halted (on a VM, a halted vCPU is woken through the host).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import select
import socket
import statistics
import sys
import time


def echo_select(sock: socket.socket, spin_s: float) -> None:
    sock.setblocking(False)
    while True:
        data = b""
        if spin_s:
            until = time.perf_counter() + spin_s
            while time.perf_counter() < until:
                try:
                    data = sock.recv(64)
                    break
                except BlockingIOError:
                    continue
        if not data:
            select.select([sock], [], [])
            data = sock.recv(64)
        if not data or data == b"q":
            return
        sock.send(data)


def echo_loop(sock: socket.socket) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                if data == b"q":
                    done.set_result(None)
                else:
                    self.transport.write(data)  # type: ignore[attr-defined]

        await asyncio.get_running_loop().create_unix_connection(Echo, sock=sock)
        await done

    asyncio.run(main())


def trips(sock: socket.socket, count: int, gap_s: float) -> list[float]:
    sock.setblocking(True)
    times = []
    for _ in range(count + 100):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        sock.send(b"p")
        sock.recv(64)
        times.append(time.perf_counter() - start)
    sock.send(b"q")
    return times[100:]  # the first hundred warm both sides up


def measure(kind: str, spin_s: float, count: int, gap_s: float) -> tuple[float, float]:
    ours, theirs = socket.socketpair()
    target = echo_loop if kind == "event loop" else echo_select
    args = (theirs,) if kind == "event loop" else (theirs, spin_s)
    child = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    child.start()
    theirs.close()
    try:
        times = sorted(trips(ours, count, gap_s))
    finally:
        child.join(5)
        ours.close()
    return statistics.median(times) * 1e6, times[int(len(times) * 0.99)] * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--spin-us", default="0,50,200", help="comma-separated spins before select, µs")
    parser.add_argument("--gap-us", default="0", help="comma-separated idle times before each trip, µs")
    args = parser.parse_args()
    try:
        spins = [float(value) for value in args.spin_us.split(",")]
        gaps = [float(value) for value in args.gap_us.split(",")]
    except ValueError:
        print(f"hop_latency.py: --spin-us {args.spin_us!r} / --gap-us {args.gap_us!r}: give µs as numbers, "
              f"e.g. 0,50,200", file=sys.stderr)
        return 2
    print(f"round trip over a unix socket pair, {args.trips} trips, µs")
    print(f"{'the echo side waits':>32}  {'idle before':>11}  {'p50':>7}  {'p99':>7}")
    cases = [("select", spin / 1e6) for spin in spins] + [("event loop", 0.0)]
    for gap_us in gaps:
        for kind, spin_s in cases:
            label = kind if kind != "select" else (f"select after a {spin_s * 1e6:g} µs spin" if spin_s else "select")
            p50, p99 = measure(kind, spin_s, args.trips, gap_us / 1e6)
            print(f"{label:>32}  {gap_us:9g} µs  {p50:7.1f}  {p99:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV handoff prefill -> decode through the workers' own code (hpc.runtime.worker.kv_handoff over hpc's RPC), each
transport the machine has: bytes in the RPC answer, CUDA IPC (GPU, one node) and NIXL (the `nixl` extra).

    python benchmarks/kv_handoff.py [--tokens 2000] [--handoffs 8] [--device cuda:0] [--layers 32]

A child process plays the prefill worker: an RPC server answering FetchKv/ReleaseKv through KvHandoff.answer, holding
one fresh KV tensor per handoff ([layers, 2, 8 KV heads, tokens, 128] bf16: Llama-3.1-8B's KV, 262 MB at 2,000
tokens). This process plays the decode worker: it times KvHandoff.fetch — ask, move, land on its device, release —
and checks every KV arrived whole (a checksum the child computed). With two GPUs, `--decode-device cuda:1`.
`--ucx-tls tcp,cuda_copy` holds NIXL's UCX to what two nodes without RDMA have: GPU memory staged through the hosts
and a TCP socket (on one node UCX would otherwise pick CUDA IPC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hpc.runtime.engine.kv import pack as kvpack  # noqa: E402
from hpc.runtime.engine.kv.nixl import NixlTransport, nixl_available  # noqa: E402
from hpc.runtime.serve.rpc import RpcServer  # noqa: E402
from hpc.runtime.engine.types import DisaggregationMode, EngineBase, EngineTraits  # noqa: E402
from hpc.runtime.worker.handlers import HandlerDeps, Peers, make_handler  # noqa: E402
from hpc.runtime.worker.kv_handoff import KvHandoff  # noqa: E402

HOST = "127.0.0.1"


class HeldKv(EngineBase):
    """The prefill engine's side of the handoff (take / lend / release), as TorchEngine keeps it: each KV is made
    when its fetch comes (a prefill just ran) and dropped at release, so the allocator reuses memory as in serving."""

    traits = EngineTraits(lends_kv=True)

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.kvs: dict[str, torch.Tensor] = {}

    def made(self, handle: str) -> torch.Tensor:
        """The KV under `handle` ("<transport>-<i>": the base + i, the same values every time), complete."""
        if handle not in self.kvs:
            self.kvs[handle] = self.base + int(handle.rpartition("-")[2])
            if self.base.is_cuda:
                torch.cuda.synchronize()  # the engine waits on its handoff's event the same way
        return self.kvs[handle]

    def _gone(self, handle: str) -> None:
        """After a handoff: the next one's KV is made now, as the next prefill would have (not timed as the ask)."""
        self.kvs.pop(handle, None)
        setting, _, i = handle.rpartition("-")
        self.made(f"{setting}-{int(i) + 1}")

    def take_handoff(self, handle: str, ipc: bool = False):
        if ipc and self.base.is_cuda:
            return kvpack.share(self.made(handle)), b""
        answer = kvpack.pack(self.made(handle))
        self._gone(handle)
        return answer

    def lend_handoff(self, handle: str) -> torch.Tensor:
        return self.made(handle)

    def release_handoff(self, handle: str) -> None:
        self._gone(handle)


def transports(device: str) -> list[tuple[str, str]]:
    """(label, runtime.kv_transport setting) for each way this machine can move KV."""
    ways = [("bytes over RPC (TCP)", "bytes")]
    if device.startswith("cuda"):
        ways.append(("CUDA IPC, device to device", "auto"))  # auto on one node's GPUs
    if nixl_available():
        ways.append(("NIXL READ (UCX)", "nixl"))
    return ways


async def prefill_side(args: argparse.Namespace) -> None:
    shape = [args.layers, 2, 8, args.tokens, 128]
    held = HeldKv(torch.randn(shape, device=args.device, dtype=torch.bfloat16))
    sums = []
    for setting in dict(transports(args.device)).values():
        for i in range(args.handoffs):
            sums.append(f"{setting}-{i}={float(held.made(f'{setting}-{i}').float().sum())!r}")
            held.kvs.clear()
        held.made(f"{setting}-0")
    nixl = NixlTransport("bench-prefill") if nixl_available() else None
    handoff = KvHandoff(setting="auto", device=args.device, host=HOST, engine=held, peers=None,
                        counters={}, nixl=nixl)

    deps = HandlerDeps(engine=held, mode=DisaggregationMode.PREFILL, peers=None, allowed_local_media_path=None,
                       media_allowed_hosts=[], max_file_size_mb=1.0, image_size=None, has_encode_role=False,
                       kv=handoff)
    server = RpcServer(make_handler(deps).ops())  # the prefill worker's own FetchKv / ReleaseKv handlers
    await server.start(HOST, 0)
    print("READY", server.port, " ".join(sums), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.close()


async def decode_side(args: argparse.Namespace, port: int, sums: dict[str, float]) -> list[tuple[str, list[float]]]:
    peers = Peers()
    rows = []
    nixl = NixlTransport("bench-decode") if nixl_available() else None
    torch.zeros(1, device=args.decode_device)  # the CUDA context exists before timing, as in a worker
    for label, setting in transports(args.device):
        handoff = KvHandoff(setting=setting, device=args.decode_device, host=HOST, engine=None, peers=peers,
                            counters={}, nixl=nixl)
        times = []
        for i in range(args.handoffs):
            # asked for (FetchKv), not taken from a prefill's answer: the longer way, which the ask's round trip
            # is part of
            params = SimpleNamespace(prefill_address=f"{HOST}:{port}", request_handle=f"{setting}-{i}", kv=None)
            t0 = time.perf_counter()
            kv = await handoff.fetch(params)
            if isinstance(kv, kvpack.PendingCopy):  # shared over CUDA IPC: copied as the engine admits it
                kv = kvpack.take_all([kv])[0]
            kv = kv.to(args.decode_device)
            if kv.is_cuda:
                torch.cuda.synchronize(kv.device)
            times.append((time.perf_counter() - t0) * 1e3)
            want = sums[params.request_handle]
            if abs(float(kv.float().sum()) - want) > 1e-3 * max(1.0, abs(want)):
                sys.exit(f"KV handoff FAILED over {label}: the KV that arrived differs from the prefill's")
            del kv  # the decode engine copies it into its cache and lets it go
            await handoff.settle()  # the release reached the prefill (which then made the next KV): not timed
        used = [k for k, v in handoff.counters.items() if v and k.startswith("kv_fetched")]
        want = {"bytes": "kv_fetched_bytes", "auto": "kv_fetched_cuda_ipc", "nixl": "kv_fetched_nixl"}[setting]
        if used != [want]:  # e.g. a prefill side without NIXL answered with bytes: this row would be mislabelled
            sys.exit(f"KV handoff FAILED over {label}: the decode side counted {used}, not {want}")
        phases = {k: handoff.counters.get(f"kv_{k}_seconds_total", 0.0) * 1e3 / args.handoffs for k in ("ask", "move")}
        rows.append((label, used[0], times, phases))
    await peers.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--handoffs", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode-device", default=None)
    parser.add_argument("--ucx-tls", help="UCX_TLS for both sides' NIXL agents, e.g. tcp,cuda_copy")
    parser.add_argument("--json", help="also write each path's figures here")
    parser.add_argument("--prefill-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # the child inherits it
    args.decode_device = args.decode_device or args.device
    try:
        import uvloop  # the workers' event loop (hpc.runtime.worker.entry)

        uvloop.install()
    except ImportError:
        pass
    if args.prefill_side:
        asyncio.run(prefill_side(args))
        return
    child = subprocess.Popen([sys.executable, __file__, "--prefill-side", "--tokens", str(args.tokens),
                              "--handoffs", str(args.handoffs), "--layers", str(args.layers), "--device",
                              args.device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:  # nixl logs to stdout as well
        if line.startswith("READY "):
            break
    else:
        sys.exit("the prefill side exited before it was ready")
    _, port, *pairs = line.split()
    sums = {k: float(v) for k, v in (p.split("=") for p in pairs)}
    try:
        rows = asyncio.run(decode_side(args, int(port), sums))
    finally:
        child.stdin.close()
        child.wait(60)
    mb = args.layers * 2 * 8 * args.tokens * 128 * 2 / 1e6
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    print(f"KV handoff on {where}: {args.tokens} tokens, {args.layers} layers x 8 KV heads x 128 ({mb:.0f} MB bf16), "
          f"prefill {args.device} -> decode {args.decode_device}, {args.handoffs} handoffs each"
          + (f", UCX_TLS={args.ucx_tls}" if args.ucx_tls else ""))
    print(f"{'path [what the decode side counted]':<58} {'first ms':>9} {'median ms':>10} {'min ms':>8} {'GB/s':>6} "
          f"{'ask ms':>7} {'move ms':>8}")
    paths = []
    for label, counted, times, phases in rows:  # ask: the RPC round trip; move: open/read + copy + sync (means)
        med = statistics.median(times[1:] or times)
        print(f"{label + f' [{counted}]':<58} {times[0]:>9.2f} {med:>10.2f} {min(times):>8.2f} {mb / med:>6.1f} "
              f"{phases['ask']:>7.2f} {phases['move']:>8.2f}")
        paths.append({"path": label, "counted": counted, "first_ms": times[0], "median_ms": med, "min_ms": min(times)})
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "layers": args.layers, "mb": mb,
                                               "prefill_device": args.device, "decode_device": args.decode_device,
                                               "paths": paths}, indent=1))


if __name__ == "__main__":
    main()

"""Upstream: tensorrt_llm/llmapi/mgmn_leader_node.py — rank 0 of a job started by trtllm-llmapi-launch serves the
MPI comm session (RemoteMpiCommSessionServer) at TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR until the launcher's
`--action stop`. The fake serves the line protocol of tensorrt_llm/llmapi/mpi_session.py (fake) and logs what it
served and how it ended."""

from __future__ import annotations

import os
import signal
import socket
import sys

from tensorrt_llm.llmapi.llm import _log
from tensorrt_llm.llmapi.mpi_session import _address, send


def serve() -> int:
    host, port = _address()
    server = socket.create_server((host, port))
    world = int(os.environ.get("tllm_mpi_size", "1"))
    signal.signal(signal.SIGTERM, lambda *_: (_log("mgmn_leader_exit", signal="SIGTERM"), sys.exit(143)))
    _log("mgmn_leader_start", world=world)
    while True:
        conn, _ = server.accept()
        with conn:
            line = conn.makefile().readline().strip()
            if line == "stop":
                conn.sendall(b"ok\n")
                _log("mgmn_leader_exit", signal=None)
                return 0
            verb, _, n = line.partition(" ")
            ok = verb == "attach" and n.isdigit() and int(n) <= world
            _log("mgmn_leader_attach", n_workers=int(n) if n.isdigit() else None, world=world, ok=ok)
            conn.sendall(b"ok\n" if ok else f"the job has {world} ranks, the LLM wants {n}\n".encode())


def main(argv: list[str]) -> int:
    if argv[:2] == ["--action", "stop"]:
        print(send("stop"), flush=True)
        return 0
    return serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Upstream: tensorrt_llm/llmapi/mpi_session.py, tensorrt_llm/executor/utils.py and tensorrt_llm/executor/proxy.py
(`_create_mpi_session`): how an LLM of several ranks finds them.

Modelled:
- model world size = tensor_parallel_size x pipeline_parallel_size; one rank needs no session.
- TLLM_SPAWN_PROXY_PROCESS == "1" (`get_spawn_proxy_process_env`, set by trtllm-llmapi-launch): the ranks were
  started by the job's MPI launcher, and the LLM binds to them through the RemoteMpiCommSessionServer that
  `mgmn_leader_node` serves at TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR (`create_mpi_comm_session`). No server there
  is an error.
- otherwise the LLM spawns its ranks itself on this machine (MpiPoolSession(n_workers=model_world_size)), each
  on the device its rank indexes among CUDA_VISIBLE_DEVICES.
The "session" here is a line over TCP: "attach N" from the LLM, "stop" from `mgmn_leader_node --action stop`.
"""

from __future__ import annotations

import os
import socket
import time


def _address() -> tuple[str, int]:
    addr = os.environ.get("TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR", "")
    if not addr.startswith("tcp://"):
        raise RuntimeError(f"TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR is {addr!r}; trtllm-llmapi-launch sets it")
    host, port = addr[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def send(line: str) -> str:
    with socket.create_connection(_address(), timeout=10) as conn:
        conn.sendall(line.encode() + b"\n")
        return conn.makefile().readline().strip()


def create_session(model_world_size: int) -> dict:
    """What the executor's proxy would create, as a record for the fake's log."""
    if model_world_size == 1:
        return {"mpi_session": None}
    if os.environ.get("TLLM_SPAWN_PROXY_PROCESS") == "1":
        deadline = time.monotonic() + 30  # the launcher starts the server beside the command: it may come later
        while True:
            try:
                reply = send(f"attach {model_world_size}")
                break
            except OSError as exc:
                if not isinstance(exc, ConnectionRefusedError) or time.monotonic() > deadline:
                    raise RuntimeError(f"no MPI comm session server at "
                                       f"{os.environ['TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR']} ({exc}): start the "
                                       "ranks with trtllm-llmapi-launch") from exc
                time.sleep(0.2)
        if reply != "ok":
            raise RuntimeError(f"the MPI comm session server refused: {reply}")
        return {"mpi_session": "comm", "n_workers": model_world_size}
    return {"mpi_session": "pool", "n_workers": model_world_size,
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

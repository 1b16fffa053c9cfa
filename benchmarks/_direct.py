"""The engines a disaggregated stack runs, driven directly: a prefill engine and a decode engine in this process,
on the devices the stack gives its workers (two GPUs when there are two), the prefill's KV handed to the decode
engine as a tensor (across GPUs, copied on the handoff streams as the stack's decode worker copies it). The same
work as the stack's workers without the frontend, the RPC hops, the engine processes and the CUDA IPC share: the
baseline that says what the disaggregated stack itself costs (an aggregated engine alone also saves
disaggregation's own hop, the first token's trip through a second engine)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch

from hpc.runtime.engine.kv.pack import copy_stream
from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregatedParams, DisaggregationMode, GenerateOutput, GenerateRequest
from hpc.runtime.serve.wire import replace


def pair_devices(visible_gpus: int) -> tuple[str | None, str | None]:
    """(prefill, decode) devices as the local launch places them: a GPU each when there are two, else shared."""
    if visible_gpus >= 2:
        return "cuda:0", "cuda:1"
    return (None, None)  # the engine's default: the one GPU, or the CPU


def on_device_apart(kv: Any, device: Any) -> Any:
    """A KV on another GPU copied onto `device` as the stack's decode worker copies one: on the handoff streams of
    both GPUs (kv.copy_stream), tied to neither engine's compute stream; the decode engine's admission waits for
    that stream on the device (kv.arrived). The decode engine's own `kv.to(device)` would copy on the prefill
    GPU's current stream, the prefill engine's, behind its next step, and the decode steps queued after the copy
    would wait for it too. A KV on the CPU or on `device` already is returned as it is."""
    if not kv.is_cuda or kv.device == torch.device(device):
        return kv
    source, target = copy_stream(kv.device), copy_stream(torch.device(device))
    with torch.cuda.stream(source), torch.cuda.stream(target):  # each GPU's current stream its handoff stream
        copied = torch.empty_like(kv, device=device)
        copied.copy_(kv)  # on the source's stream, with a barrier each way to the target's
    kv.record_stream(source)  # the prefill's buffer is not reused before the copy has read it
    return copied


class DirectPair:
    """`stream(request, deliver)` as a TorchEngine's: the prompt prefilled by one engine, its first token delivered,
    the rest decoded by the other from the prefill's KV (taken from the prefill engine's held KVs)."""

    def __init__(self, model_dir: Path, engine_args: dict[str, Any], devices: tuple[str | None, str | None]) -> None:
        self.prefill = TorchEngine(model_dir, DisaggregationMode.PREFILL, engine_args, device=devices[0])
        self.decode = TorchEngine(model_dir, DisaggregationMode.DECODE, engine_args, device=devices[1],
                                  fetch_kv=self._take_kv)
        self.kv_handed_over = 0
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "DirectPair":
        await self._stack.enter_async_context(self.prefill)
        await self._stack.enter_async_context(self.decode)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.aclose()

    @property
    def warmup_s(self) -> float:
        return self.prefill.warmup_s + self.decode.warmup_s

    async def _take_kv(self, params: DisaggregatedParams) -> Any:
        """The prefilled KV (complete: its copy's event waited for), no longer held by the prefill engine, on the
        decode engine's device (on_device_apart)."""
        kv = self.prefill.lend_handoff(params.request_handle)
        self.prefill.release_handoff(params.request_handle)
        self.kv_handed_over += 1
        return on_device_apart(kv, self.decode.device)

    async def stream(self, request: GenerateRequest, deliver: Callable[[GenerateOutput], None]) -> None:
        answers: list[GenerateOutput] = []
        await self.prefill.stream(replace(request, streaming=False), answers.append)
        params = answers[-1].disaggregated_params
        if params is None:
            raise RuntimeError(f"the prefill engine answered without a KV handle: {answers[-1]}")
        last = request.sampling.max_tokens == 1
        deliver(GenerateOutput(token_ids=[params.first_token_id], finished=last, finish_reason="length" if last
                               else None, prompt_tokens=len(request.token_ids)))
        if last:  # no decode comes for its KV
            self.prefill.release_handoff(params.request_handle)
            return
        await self.decode.stream(replace(request, disaggregated_params=params), deliver)

    def stats(self) -> dict[str, float]:
        """The decode engine's (its scheduler clock is the one a level's figures are read from)."""
        return self.decode.stats()

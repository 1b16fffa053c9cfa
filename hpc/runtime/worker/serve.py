"""The worker's lifecycle: engine in `async with`, RPC + HTTP servers, discovery lease, drain on SIGTERM.

Rank 0 serves; ranks > 0 of a tensor-parallel worker follow rank 0's forward passes. The supervisor and
the failure policy live in entry.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from pathlib import Path

from hpc.manifest import Manifest
from hpc.rundir import Endpoint
from hpc.plan.placement import WorkerPlan, device_for
from hpc.runtime.engine.builds import ensure_model
from hpc.spec.recipe import Backend
from hpc.runtime.services.discovery import Instance, open_discovery
from hpc.runtime.worker.engines import build_engine
from hpc.model.info import ModelInfo
from hpc.runtime.engine.types import DisaggregationMode, Engine
from hpc.runtime.serve.http import HttpServer
from hpc.runtime.services.node import (IdleSpin, LoopLatency, Reporter, freeze_startup_objects, idle_spin_seconds,
                                       node_address, publish_endpoint, rpc_token, wait_endpoint, watch_gc)
from hpc.runtime.serve.rpc import RpcServer
from hpc.runtime.worker.handlers import HandlerDeps, Peers, make_handler
from hpc.runtime.worker.engine_process import EngineHandoff, EngineProcess, engine_in_own_process
from hpc.runtime.worker.kv_handoff import KvHandoff, TransferDeadline, open_nixl
from hpc.runtime.worker.lifecycle import Opened, WorkerHttp, until_stopped

log = logging.getLogger("hpc.worker")


async def serve(manifest: Manifest, role: str, index: int, manifest_file: str, restarting: bool = False) -> int:
    """`restarting`: the role's failure policy starts this worker again if it fails (entry.restarts_left)."""
    from hpc.runtime.engine.torch.tp import init_group, world_rank

    plan = manifest.plan.worker(role, index)
    name = plan.name
    rank, world, _ = world_rank()
    if plan.tasks == 1 or manifest.recipe.backend is not Backend.TORCH:
        rank, world = 0, 1  # TensorRT-LLM forms its own MPI world (trtllm-llmapi-launch); mock has none
    elif world != plan.tasks or not 0 <= rank < world:
        # The plan is the contract: a launcher that started another world would shard the model wrongly.
        raise RuntimeError(f"{name}: MPI started rank {rank} of {world}, the plan has {plan.tasks} ranks "
                           f"(TP x PP); launch it with the job's srun step")
    host = node_address(manifest)
    reporter = Reporter(manifest, name if rank == 0 else f"{name}.rank{rank}")
    device = planned_device(plan, rank, whole_node=manifest.cluster.is_local)
    reporter.phase("started", rank=rank, world=world, device=device, planned_gpu=plan.ranks[rank].gpu,
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    await asyncio.to_thread(ensure_model, manifest.recipe.model.path, manifest.recipe.model.generate)
    tp = None
    if world > 1:
        if rank == 0:
            publish_endpoint(manifest, f"{name}-dist", Endpoint(host, plan.ports["dist"]))
        ep = await asyncio.to_thread(wait_endpoint, manifest, f"{name}-dist", 600)
        import torch

        tp = await asyncio.to_thread(init_group, rank, world, f"{ep.host}:{ep.port}", torch.device(device))
        reporter.phase("group_ready")
    rpc_address = f"{host}:{plan.ports['rpc']}"
    peers = Peers(token=rpc_token(manifest))

    recipe = manifest.recipe
    handoff: KvHandoff | EngineHandoff
    if engine_in_own_process(recipe.runtime.engine_process, recipe.backend, recipe.modality, DisaggregationMode(role),
                             world, device.startswith("cuda")):
        # the engine's own process fetches, shares and lends its KV itself; this one serves RPC and HTTP
        engine = EngineProcess(manifest_file, role, index, device, recipe.runtime.readiness_timeout_s)
        handoff = EngineHandoff(engine, peers)
    else:
        handoff = KvHandoff(setting=recipe.runtime.kv_transport, device=device, host=host, engine=None, peers=peers,
                            counters={},
                            deadline=TransferDeadline(recipe.runtime.kv_transfer_min_s,
                                                      recipe.runtime.kv_transfer_floor_gb_s))
        if rank == 0 and DisaggregationMode(role) in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE) \
                and recipe.backend is Backend.TORCH:
            handoff.nixl = open_nixl(recipe.runtime.kv_transport, device.startswith("cuda"), name)
        engine = build_engine(manifest, role, self_address=rpc_address, tp=tp, fetch_kv=handoff.fetch,
                              device=device, group=plan.group)
    if rank > 0:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        await asyncio.to_thread(engine.load)
        reporter.phase("weights_loaded")
        await asyncio.to_thread(engine.follow)
        reporter.phase("stopped")
        return 0
    if isinstance(handoff, KvHandoff):
        handoff.engine = engine  # the prefill side answers from it
    began = time.monotonic()
    async with engine:
        load_s = time.monotonic() - began  # weights, warm-up, an engine's own ranks: what a restart costs
        reporter.phase("weights_loaded", load_seconds=round(load_s, 2),
                       **({"engine_pid": engine.pid} if isinstance(engine, EngineProcess) else {}))
        try:
            code = await _serve_engine(manifest, role, index, engine, peers, host, reporter, handoff, restarting,
                                       load_s)
        finally:
            handoff.close()
        engine.stop_followers()
    if code == 0:
        reporter.phase("stopped")
    return code


def attention_dp_ranks(args: dict) -> int:
    """An engine with attention-DP runs one attention rank per TP rank, each with its own KV cache."""
    tp = args.get("tensor_parallel_size", 1)
    return tp if args.get("enable_attention_dp") and isinstance(tp, int) and tp > 1 else 1


def planned_device(plan: WorkerPlan, rank: int, whole_node: bool = False) -> str:
    """This rank's device from the plan's rank -> GPU map (see device_for); `whole_node`: a local launch, whose
    processes see every GPU of the machine."""
    try:
        import torch
    except ImportError:
        return "cpu"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, shared = device_for(plan, rank, visible, whole_node)
    if shared:
        log.warning("%s rank %d: planned GPU %d but this machine has %d; sharing %s with other workers",
                    plan.name, rank, plan.ranks[rank].gpu, visible, device)
    return device


async def _serve_engine(manifest: Manifest, role: str, index: int, engine: Engine, peers: Peers, host: str,
                        reporter: Reporter, handoff: KvHandoff | EngineHandoff, restarting: bool = False,
                        load_s: float = 0.0) -> int:
    """Serve until stopped or the engine fails; `restarting`: the role's policy starts this worker again if so."""
    plan = manifest.plan.worker(role, index)
    recipe = manifest.recipe
    mode = DisaggregationMode(role)
    gc_clock = watch_gc()
    loop_latency = LoopLatency().start()
    # through every call, and a prefill worker's longer window, only where the engine has a process of its own:
    # one on a thread here (several ranks, TensorRT-LLM, runtime.engine_process worker) would wait for the GIL
    # behind the spinning loop
    apart = isinstance(engine, EngineProcess)
    idle_spin = IdleSpin(idle_spin_seconds(recipe.runtime.idle_spin_us, role if apart else ""),
                         through_calls=apart)
    events = await _open_events(manifest, plan.name, engine)
    deps = _handler_deps(manifest, mode, engine, peers, handoff, _FirstToken(reporter))
    deps.counters["engine_load_seconds"] = round(load_s, 3)
    rpc = RpcServer(make_handler(deps).ops(), token=rpc_token(manifest), on_activity=idle_spin.calls)
    await rpc.start(host, plan.ports["rpc"])
    http = WorkerHttp(engine, deps.counters, role, index, {"role": role, "index": str(index), "run": manifest.run_id},
                      inflight=lambda: rpc.inflight, clocks=[gc_clock, loop_latency, idle_spin])
    web = HttpServer(http)
    await web.start(host, plan.ports["http"])
    discovery = open_discovery(manifest)
    opened = Opened(rpc=rpc, web=web, discovery=discovery, peers=peers, handoff=handoff, events=events)
    if recipe.roles.encode is not None or mode is DisaggregationMode.DECODE:
        def keep(snapshot):
            peers.update(snapshot)  # a request that needs a role not listed yet waits for it (Peers.pick)
            peers.preconnect(("prefill", "encode"))  # the first handoff or image does not connect

        opened.watch_task = asyncio.create_task(discovery.watch(keep))
    instance = Instance(role=role, index=index, pool=plan.pool or "", instance_id=uuid.uuid4().hex[:12],
                        host=host, rpc_port=plan.ports["rpc"], http_port=plan.ports["http"], node=os.uname().nodename,
                        dp_size=attention_dp_ranks(manifest.engine_args[plan.group or role]))
    http.frozen_objects = freeze_startup_objects()
    await discovery.register(instance)
    reporter.phase("registered", address=instance.address, http=f"http://{host}:{plan.ports['http']}")
    if events is not None:
        events.start_load_reports(lambda: {**engine.stats(), **deps.counters})
    return await until_stopped(engine, opened, http, reporter, restarting)


class _FirstToken:
    """The worker's first token, reported once."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter, self.seen = reporter, False

    def __call__(self) -> None:
        if not self.seen:
            self.seen = True
            self.reporter.phase("first_token")


async def _open_events(manifest: Manifest, name: str, engine: Engine):
    """The worker's publisher of KV events and load on NATS, wired to the engine; None without NATS."""
    recipe = manifest.recipe
    if not (recipe.infra.nats and recipe.runtime.publish_kv_events):
        return None
    from hpc.runtime.services.events import EventPublisher

    try:
        events = await EventPublisher(manifest, name).connect()
    except Exception as exc:  # the event plane is optional for serving
        log.warning("NATS unavailable, no events: %s", exc)
        return None
    if engine.traits.kv_events:
        events.kv_event("cleared")  # a (re)started worker holds nothing: routers forget what it held before
        engine.on_kv_event = events.engine_kv_event
        engine.on_stats = events.engine_stats
    return events


def _handler_deps(manifest: Manifest, mode: DisaggregationMode, engine: Engine, peers: Peers,
                  handoff: KvHandoff | EngineHandoff, on_first_token) -> HandlerDeps:
    recipe = manifest.recipe
    vision = None
    if recipe.model.multimodal:
        vision = ModelInfo.read(Path(recipe.model.path).expanduser()).image_size
    deps = HandlerDeps(engine=engine, mode=mode, peers=peers,
                       allowed_local_media_path=recipe.runtime.allowed_local_media_path,
                       media_allowed_hosts=list(recipe.runtime.media_allowed_hosts),
                       max_file_size_mb=recipe.runtime.max_file_size_mb, image_size=vision,
                       has_encode_role=recipe.roles.encode is not None and mode is not DisaggregationMode.ENCODE,
                       on_first_token=on_first_token, kv=handoff)
    handoff.counters = deps.counters  # what arrived by which transport shows in /metrics and stats
    return deps

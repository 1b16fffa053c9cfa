"""One frontend process of a job: the OpenAI-compatible server, its router over discovery, and (process 0 of a
group) the group's start. `python -m hpc.runtime.frontend` starts it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
import signal
from typing import Any

from hpc.engine_args.scheduling import tokens_per_block
from hpc.manifest import Manifest
from hpc.rundir import Endpoint
from hpc.runtime.services.discovery import open_discovery
from hpc.runtime.frontend.app import Frontend
from hpc.runtime.frontend.dealer import Dealer, Taker, listen
from hpc.runtime.frontend.group import FrontendGroup
from hpc.runtime.frontend.router import SETTLE_S, Router
from hpc.runtime.frontend.kv_index import KvIndex
from hpc.runtime.frontend.parsers import HARMONY
from hpc.runtime.frontend.tokenizer import TextCodec
from hpc.runtime.engine.builds import ensure_model
from hpc.runtime.serve.http import HttpLimits, HttpServer
from hpc.runtime.services.node import (IdleSpin, LoopLatency, Reporter, freeze_startup_objects, idle_spin_seconds,
                                       node_address, publish_endpoint, rpc_token, watch_gc)
from hpc.spec.recipe import RouterPolicy

log = logging.getLogger(__name__)


async def serve(manifest: Manifest, bind: str | None = None, group: FrontendGroup | None = None) -> int:
    """One frontend process; with a group, process 0 also starts the others and reports for all of them."""
    first = group is None or group.index == 0
    reporter = Reporter(manifest, "frontend")
    if first:
        reporter.phase("started")
    # A generated model is built by the job (the launcher stays free of torch); the workers race for the same lock.
    # Built apart if this process gets there first: a frontend never holds torch (its tokenizer is all it reads).
    await asyncio.to_thread(ensure_model, manifest.recipe.model.path, manifest.recipe.model.generate, True)
    app, router, kv_feed = await _frontend_app(manifest)
    host = bind or node_address(manifest)
    port = manifest.plan.service("frontend").ports["http"]
    server = _http_server(manifest, app)
    share: Taker | Dealer | None = None
    dealer: Dealer | None = None
    if group is None:
        await server.start(host, port)
    elif first:  # process 0 alone listens, and deals the connections over the group
        share = dealer = Dealer(listen(host, port), server.adopt).start()
    else:
        share = Taker(group.own_channel(), server.adopt).start()
    if share is not None:
        server.state.on_close = share.closed_here
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: None)  # drain tier: keep serving while workers leave
    if group is not None:
        app.group = group
        await group.start(app.health_view, app.metrics_text)
        group.gone.add_done_callback(lambda _: stop.set())
        if dealer is not None:
            # before discovery starts gRPC's threads (the etcd client): a process forked beside them can crash
            # before it runs anything of its own (gRPC's fork handlers; 4 in 40 starts of 4 processes here)
            await group.spawn(host, dealer)
    discovery = await asyncio.to_thread(open_discovery, manifest)

    def on_change(snapshot) -> None:
        router.update(snapshot)
        router.preconnect()

    watch = asyncio.create_task(discovery.watch(on_change))
    expiry = asyncio.create_task(_expire_unlisted(router))
    url = f"http://{host}:{port}"
    freeze_startup_objects()
    if group is not None and not first:
        print(f"ready {group.port}", flush=True)  # to process 0, which waits for every process
    if first:
        publish_endpoint(manifest, "frontend", Endpoint(host, port, url))
        reporter.phase("ready", url=url)
    await stop.wait()
    watch.cancel()
    expiry.cancel()
    if share is not None:
        share.close()
    await server.close()
    if group is not None:
        await group.close()
        if first and group.gone.done() and group.gone.result():  # a process died: so does the frontend, visibly
            raise RuntimeError(group.gone.result())
    await router.close()
    if kv_feed is not None:
        await kv_feed.close()
    if first:
        reporter.phase("stopped")
    return 0


async def _frontend_app(manifest: Manifest) -> tuple[Frontend, Router, Any]:
    """The OpenAI frontend with its tokenizer and router, and the KV events' feed of a kv_aware router (or None)."""
    model = manifest.recipe.model
    # the harmony parser reads gpt-oss's message markers, which are special tokens: keep them in the text
    codec = TextCodec(await asyncio.to_thread(model_dir, manifest), model.chat_template,
                      keep_special_tokens=bool({model.reasoning_parser, model.tool_call_parser} & set(HARMONY)))
    spec = manifest.recipe.frontend
    kv = KvIndex(_block_size(manifest)) if spec.router is RouterPolicy.KV_AWARE else None
    router = Router(spec.router, token=rpc_token(manifest), kv=kv, overlap_weight=spec.kv_overlap_weight,
                    temperature=spec.router_temperature)
    kv_feed = await _follow_kv_events(manifest, kv) if kv is not None else None
    app = Frontend(manifest, router, codec)
    app.gc_clock = watch_gc()
    app.loop_latency = LoopLatency().start()
    app.idle_spin = IdleSpin(idle_spin_seconds(manifest.recipe.runtime.idle_spin_us))
    return app, router, kv_feed


def _http_server(manifest: Manifest, app: Frontend) -> HttpServer:
    http = manifest.recipe.frontend.http
    spin = app.idle_spin
    return HttpServer(app.handle, HttpLimits(
        max_body_bytes=int(http.max_request_body_mb * 1024 * 1024), header_timeout_s=http.header_timeout_s,
        body_timeout_s=http.body_timeout_s, keepalive_timeout_s=http.keepalive_timeout_s,
        max_concurrent=http.max_concurrent_requests), on_activity=spin.calls if spin is not None else lambda _: None)


# what the frontend reads of a checkpoint (TextCodec): the fast tokenizer, its config and the chat templates
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json",
                   "chat_template.jinja", "config.json", "generation_config.json"]


def model_dir(manifest: Manifest) -> Path:
    """The directory of the tokenizer's files: the recipe's own, or for a hub id (TensorRT-LLM fetches such a
    model's weights itself) those files alone, fetched as it fetches (huggingface_hub: HF_HOME's cache,
    HF_TOKEN, HF_HUB_OFFLINE)."""
    from hpc.model.fit import is_local_path

    ref = manifest.recipe.model.tokenizer or manifest.recipe.model.path
    if is_local_path(ref):
        return Path(ref).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=TOKENIZER_FILES))
    except Exception as exc:  # no network on the nodes, a gated repo without a token, a wrong id
        raise RuntimeError(f"the frontend needs the tokenizer of {ref!r} and could not fetch it from the Hugging "
                           f"Face hub ({type(exc).__name__}: {exc}); set recipe model.tokenizer to a directory the "
                           f"nodes mount that holds tokenizer.json") from None


def _block_size(manifest: Manifest) -> int:
    """The KV block the routed engines cut prompts by (kv_cache_config.tokens_per_block)."""
    for role in ("prefill", "agg"):
        args = manifest.engine_args.get(role)
        if args is not None:
            return tokens_per_block(args)
    return tokens_per_block({})


async def _follow_kv_events(manifest: Manifest, kv: KvIndex):
    """The workers' KV events into the index. While NATS is away the index is stale and routing goes by load.
    Once subscribed, and each time NATS is back, the workers are asked to resend every block they hold (a frontend
    restarted by its supervisor would otherwise know nothing its workers cached before)."""
    import json

    import nats

    from hpc.runtime.services.events import subject
    from hpc.runtime.services.node import nats_token, wait_endpoint

    async def apply(msg) -> None:
        message = json.loads(msg.data)
        kv.apply(message.get("worker", ""), message)
        kv.stale = False

    async def lost() -> None:
        log.warning("KV event stream lost: routing by load until it is back")
        kv.reset()

    async def resync() -> None:
        await nc.publish(subject(manifest, "kv_resync", "all"), b"")
        kv.resyncs += 1

    if not manifest.recipe.infra.nats:
        log.warning("router kv_aware without NATS: no KV events, routing by load")
        return None
    ep = await asyncio.to_thread(wait_endpoint, manifest, "nats", 60)
    nc = await nats.connect(ep.base_url(), token=nats_token(manifest), max_reconnect_attempts=-1,
                            reconnect_time_wait=0.5, disconnected_cb=lost, reconnected_cb=resync)
    await nc.subscribe(subject(manifest, "kv_events", "*"), cb=apply)
    await nc.flush()  # the subscription is in place before the workers answer
    await resync()
    kv.stale = False  # what the workers held arrives in order with their live events
    return nc


async def _expire_unlisted(router: Router) -> None:
    while True:
        await asyncio.sleep(SETTLE_S / 3)
        router.expire_unlisted()

"""`python -m hpc.runtime.frontend MANIFEST`: the OpenAI-compatible frontend of one job."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from hpc.manifest import Manifest
from hpc.runtime.services.discovery import open_discovery
from hpc.runtime.frontend.app import Frontend, model_dir
from hpc.runtime.frontend.router import SETTLE_S, Router
from hpc.runtime.frontend.parsers import HARMONY
from hpc.runtime.frontend.tokenizer import TextCodec
from hpc.runtime.engine.tiny import ensure_model
from hpc.runtime.serve.http import HttpLimits, HttpServer
from hpc.runtime.services.node import Reporter, node_address, publish_endpoint, rpc_token


async def serve(manifest: Manifest, bind: str | None = None) -> int:
    reporter = Reporter(manifest, "frontend")
    reporter.phase("started")
    # A generated model is built by the job (the launcher stays free of torch); the workers race for the same lock.
    await asyncio.to_thread(ensure_model, manifest.recipe.model.path, manifest.recipe.model.generate)
    model = manifest.recipe.model
    # the harmony parser reads gpt-oss's message markers, which are special tokens: keep them in the text
    codec = TextCodec(model_dir(manifest), model.chat_template,
                      keep_special_tokens=bool({model.reasoning_parser, model.tool_call_parser} & set(HARMONY)))
    router = Router(manifest.recipe.frontend.router, token=rpc_token(manifest))
    app = Frontend(manifest, router, codec)
    host = bind or node_address(manifest)
    port = manifest.plan.service("frontend").ports["http"]
    http = manifest.recipe.frontend.http
    server = HttpServer(app.handle, HttpLimits(
        max_body_bytes=int(http.max_request_body_mb * 1024 * 1024), header_timeout_s=http.header_timeout_s,
        body_timeout_s=http.body_timeout_s, keepalive_timeout_s=http.keepalive_timeout_s,
        max_concurrent=http.max_concurrent_requests))
    await server.start(host, port)
    discovery = await asyncio.to_thread(open_discovery, manifest)
    watch = asyncio.create_task(discovery.watch(router.update))
    expiry = asyncio.create_task(_expire_unlisted(router))
    url = f"http://{host}:{port}"
    publish_endpoint(manifest, "frontend", host=host, port=port, url=url)
    reporter.phase("ready", url=url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: None)  # drain tier: keep serving while workers leave
    await stop.wait()
    watch.cancel()
    expiry.cancel()
    await server.close()
    await router.close()
    reporter.phase("stopped")
    return 0


async def _expire_unlisted(router: Router) -> None:
    while True:
        await asyncio.sleep(SETTLE_S / 3)
        router.expire_unlisted()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.runtime.frontend")
    parser.add_argument("manifest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    manifest = Manifest.load(args.manifest)
    try:
        return asyncio.run(serve(manifest))
    except Exception as exc:  # where readiness and status look: the job's checks stop at once, not at a timeout
        Reporter(manifest, "frontend").phase("failed", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())

"""One frontend as several processes on one port (recipe `frontend.processes`).

A Python frontend parses, routes and streams every request in one event loop; at tens of thousands of tokens/s
that loop is the stack's limit (one H100, tiny model, c=64: 23.7k tok/s with one process, 32.9k with two). The
first process listens on the port and deals each client connection to the process holding the fewest
(dealer.py). It starts the others and watches them; they watch it through their stdin (closed when it dies). Each
process discovers the workers and follows the KV events itself; /health and /metrics on any of them answer for
the whole group: the first process gathers every process's own view over loopback and merges them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from typing import Any, Awaitable, Callable

from hpc.net.httpclient import Connection
from hpc.runtime.frontend.dealer import Dealer, channel_pair
from hpc.runtime.serve.http import HttpServer, Request, Response, json_response

log = logging.getLogger(__name__)

REPLICA_START_S = 120.0
# Metrics that every process reads off the same shared state (workers in discovery, the KV event stream) or sets
# alike (which spin it runs): the group's value is the largest, not the sum. Start times of histograms: the earliest.
_SHARED_SUFFIXES = ("_instances", "_kv_index_stale", "_kv_events_total", "_pool_live", "_idle_spin_in_flight")


def health_status(live: dict[str, int], expected: dict[str, int]) -> str:
    """healthy: every role at its count; degraded: every role served by at least one; else unhealthy."""
    if all(live.get(role, 0) >= n for role, n in expected.items()):
        return "healthy"
    return "degraded" if all(live.get(role, 0) > 0 for role in expected) else "unhealthy"


def live_counts(instances: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Per role, the listed workers that take new requests (a draining one is listed until it has left)."""
    return {role: sum(1 for item in items if not item["draining"]) for role, items in instances.items()}


def merge_health(views: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's /health from each process's own: a worker counts as live when every process can route to it
    (readiness waits for all of them), requests routed are summed."""
    first = views[0]
    instances: dict[str, list[dict[str, Any]]] = {}
    for role, items in first["instances"].items():
        others = [{i["instance_id"]: i for i in v["instances"].get(role, [])} for v in views[1:]]
        instances[role] = [{**item, "routed": item["routed"] + sum(o[item["instance_id"]]["routed"] for o in others),
                            "draining": item["draining"] or any(o[item["instance_id"]]["draining"] for o in others)}
                           for item in items if all(item["instance_id"] in o for o in others)]
    live = live_counts(instances)
    router = dict(first["router"])
    if "prompt_blocks" in router:
        router.update(stale=any(v["router"]["stale"] for v in views), events=max(v["router"]["events"] for v in views),
                      prompt_blocks=sum(v["router"]["prompt_blocks"] for v in views),
                      cached_blocks=sum(v["router"]["cached_blocks"] for v in views),
                      # the least a process knows of the workers' caches: each keeps its own index
                      indexed_blocks=min(v["router"]["indexed_blocks"] for v in views),
                      resyncs=sum(v["router"]["resyncs"] for v in views))
    if "pools" in router:
        router["pools"] = [_merge_pool([v["router"]["pools"][k] for v in views]) for k in range(len(router["pools"]))]
    if "kv_pairs" in router:
        router["kv_pairs"] = merge_pairs([v["router"].get("kv_pairs", []) for v in views])
    return {**first, "status": health_status(live, first["expected"]), "live": live, "instances": instances,
            "router": router, "processes": len(views)}


def merge_pairs(views: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each process's KV-transfer timeouts by pair, summed; a pair sits out where any process benched it."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for pairs in views:
        for p in pairs:
            row = merged.setdefault((p["prefill"], p["decode"]), {**p, "timeouts": 0, "retried": 0, "in_a_row": 0,
                                                                     "benched_s": 0.0})
            row.update(timeouts=row["timeouts"] + p["timeouts"], retried=row["retried"] + p["retried"],
                       in_a_row=max(row.get("in_a_row", 0), p.get("in_a_row", 0)),
                       benched_s=max(row["benched_s"], p["benched_s"]))
    return [merged[key] for key in sorted(merged)]


def _merge_pool(rows: list[dict[str, Any]]) -> dict[str, Any]:
    reasons: dict[str, int] = {}
    for row in rows:
        for reason, n in row["chosen_by"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {**rows[0], "live": min(r["live"] for r in rows), "routed": sum(r["routed"] for r in rows),
            "retried_away": sum(r["retried_away"] for r in rows), "chosen_by": reasons}


def merge_metrics(texts: list[bytes]) -> bytes:
    """Prometheus text of several processes as one: each sample summed over the processes (counters, histogram
    buckets, requests in flight), except views of shared state (the largest) and creation times (the earliest).
    Comment lines are kept once, samples in the order they first appear."""
    order: list[str] = []
    seen_comments: set[str] = set()
    values: dict[str, float] = {}
    for text in texts:
        for line in text.decode().splitlines():
            if not line:
                continue
            if line.startswith("#"):
                if line not in seen_comments:
                    seen_comments.add(line)
                    order.append(line)
                continue
            key, _, raw = line.rpartition(" ")
            value = float(raw)
            if key not in values:
                order.append(key)
                values[key] = value
                continue
            name = key.split("{", 1)[0]
            if name.endswith("_created"):
                values[key] = min(values[key], value)
            elif name.endswith(_SHARED_SUFFIXES):
                values[key] = max(values[key], value)
            else:
                values[key] += value
    lines = [item if item.startswith("#") else f"{item} {values[item]!r}" for item in order]
    return ("\n".join(lines) + "\n").encode()


async def _get(port: int, path: str, timeout: float = 5.0) -> bytes:
    conn = Connection("127.0.0.1", port)
    try:
        status, body = await asyncio.wait_for(conn.request("GET", path), timeout)
    finally:
        conn.close()
    if status != 200:
        raise ConnectionError(f"GET {path} on frontend process port {port}: {status}")
    return body


class FrontendGroup:
    """This process's place in the group: process 0 starts and watches the others and merges their views."""

    def __init__(self, index: int, size: int, manifest_path: str, primary_port: int | None = None,
                 channel: socket.socket | None = None) -> None:
        self.index, self.size = index, size
        self.channel = channel  # another process's end of its socketpair with process 0: connections come on it
        self.dealer: Dealer | None = None  # process 0's, once it listens
        self.manifest_path = manifest_path
        self.primary_port = primary_port  # process 0's loopback port, for the others
        self.replica_ports: list[int] = []
        self.replicas: list[asyncio.subprocess.Process] = []
        # set when a process of the group ends: the frontend stops (the result: why it failed, None if it did not)
        self.gone: asyncio.Future[str | None]  # made by start()
        self._peer: HttpServer | None = None
        self._own_health: Callable[[], dict[str, Any]] = dict
        self._own_metrics: Callable[[], bytes] = bytes
        self._tasks: list[asyncio.Task] = []

    @property
    def port(self) -> int:
        if self._peer is None:
            raise RuntimeError("the group's loopback server is not started")
        return self._peer.port

    def own_channel(self) -> socket.socket:
        """Another process's end of its socketpair with process 0 (given as --channel-fd)."""
        if self.channel is None:
            raise RuntimeError(f"frontend process {self.index} of the group was started without its channel")
        return self.channel

    def _primary_port(self) -> int:
        if self.primary_port is None:
            raise RuntimeError(f"frontend process {self.index} of the group was started without --primary-port")
        return self.primary_port

    async def start(self, own_health: Callable[[], dict[str, Any]], own_metrics: Callable[[], bytes]) -> None:
        """The loopback server the processes ask each other on."""
        self._own_health, self._own_metrics = own_health, own_metrics
        self.gone = asyncio.get_running_loop().create_future()
        self._peer = HttpServer(self._answer)
        await self._peer.start("127.0.0.1", 0)
        if self.index > 0:
            self._tasks.append(asyncio.create_task(self._watch_primary()))

    async def _answer(self, req: Request) -> Response:
        routes: dict[str, Callable[[], Awaitable[Response]]] = {
            "/own/health": self._own_health_response, "/own/metrics": self._own_metrics_response}
        if self.index == 0:
            routes.update({"/group/health": self._group_health_response,
                           "/group/metrics": self._group_metrics_response})
        route = routes.get(req.path)
        return await route() if route else Response(status=404)

    async def _own_health_response(self) -> Response:
        return json_response(self._own_health())

    async def _own_metrics_response(self) -> Response:
        return Response(body=self._own_metrics(), content_type="text/plain")

    async def _group_health_response(self) -> Response:
        return json_response(await self.health())

    async def _group_metrics_response(self) -> Response:
        return Response(body=await self.metrics(), content_type="text/plain")

    async def health(self) -> dict[str, Any]:
        """Every process's own view, merged (asked of process 0 when this is another)."""
        if self.index > 0:
            return json.loads(await _get(self._primary_port(), "/group/health"))
        others = await asyncio.gather(*(_get(p, "/own/health") for p in self.replica_ports))
        return merge_health([self._own_health(), *map(json.loads, others)])

    async def metrics(self) -> bytes:
        if self.index > 0:
            return await _get(self._primary_port(), "/group/metrics")
        texts = [self._own_metrics(), *await asyncio.gather(*(_get(p, "/own/metrics") for p in self.replica_ports))]
        return merge_metrics(texts) + _per_process(texts) + (_dealt(self.dealer) if self.dealer else b"")

    async def spawn(self, host: str, dealer: Dealer) -> None:
        """Process 0: start the others on the same manifest (together), each answering `ready PORT` once it
        serves; then `dealer` passes connections to them too."""
        self.dealer = dealer
        channels = []
        for index in range(1, self.size):
            ours, theirs = channel_pair()
            channels.append(ours)
            try:
                self.replicas.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "hpc.runtime.frontend", self.manifest_path, "--bind", host,
                    "--replica", str(index), "--primary-port", str(self.port), "--channel-fd", str(theirs.fileno()),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=(theirs.fileno(),),
                    # a crash before its first log line (a signal during start-up) still leaves its Python stack
                    env={**os.environ, "PYTHONFAULTHANDLER": "1"}))
            finally:
                theirs.close()  # the child holds it now
        ports = await asyncio.gather(*(self._ready_port(proc) for proc in self.replicas))
        for index, (proc, port) in enumerate(zip(self.replicas, ports), start=1):
            if port is None:
                code = proc.returncode if proc.returncode is not None else "none yet"
                raise RuntimeError(f"frontend process {index} of {self.size} did not start (exit code {code}; "
                                   f"its log lines are the frontend[{index}] ones)")
            self.replica_ports.append(port)
            self._tasks.append(asyncio.create_task(self._watch_replica(index, proc)))
        for channel in channels:
            dealer.add(channel)

    @staticmethod
    async def _ready_port(proc: asyncio.subprocess.Process) -> int | None:
        """The loopback port in the process's `ready PORT` line; None if it ended or took too long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLICA_START_S
        while proc.stdout is not None:  # asked for as a pipe
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), max(deadline - loop.time(), 0.01))
            except asyncio.TimeoutError:
                return None
            if not line:
                await proc.wait()
                return None
            word, _, port = line.decode().strip().partition(" ")
            if word == "ready" and port.isdigit():
                return int(port)
        return None

    async def _watch_replica(self, index: int, proc: asyncio.subprocess.Process) -> None:
        """A process that dies takes the group down: as a failure, unless it stopped cleanly (code 0: the signal
        that stops a Slurm step or a local run reaches every process of the group, this one too)."""
        code = await proc.wait()
        if not self.gone.done():
            self.gone.set_result(f"frontend process {index} of {self.size} exited with code {code}" if code else None)

    async def _watch_primary(self) -> None:
        """Process 0 holds our stdin open: end of file is its death (even a SIGKILL)."""
        await asyncio.get_running_loop().connect_read_pipe(lambda: _EofProtocol(self.gone), sys.stdin)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for proc in self.replicas:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.replicas:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
        if self._peer is not None:
            await self._peer.close()


class _EofProtocol(asyncio.Protocol):
    def __init__(self, gone: asyncio.Future) -> None:
        self.gone = gone

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.gone.done():
            self.gone.set_result("frontend process 0 is gone")


def _dealt(dealer: Dealer) -> bytes:
    """The connections each process holds and was given, as process 0 counts them."""
    lines = ["# TYPE hpc_frontend_process_connections gauge"]
    lines += [f'hpc_frontend_process_connections{{process="{i}"}} {n}' for i, n in enumerate(dealer.open)]
    lines.append("# TYPE hpc_frontend_process_connections_dealt_total counter")
    lines += [f'hpc_frontend_process_connections_dealt_total{{process="{i}"}} {n}' for i, n in enumerate(dealer.dealt)]
    return ("\n".join(lines) + "\n").encode()


def _per_process(texts: list[bytes]) -> bytes:
    """Requests each process took."""
    lines = ["# TYPE hpc_frontend_process_requests_total counter"]
    for index, text in enumerate(texts):
        for line in text.decode().splitlines():
            if line.startswith("hpc_frontend_requests_total{"):
                labels = line[len("hpc_frontend_requests_total{"):line.index("}")]
                labels += "," if labels else ""
                lines.append(f'hpc_frontend_process_requests_total{{{labels}process="{index}"}} '
                             f'{line.rpartition(" ")[2]}')
    lines.append("# TYPE hpc_frontend_processes gauge")
    lines.append(f"hpc_frontend_processes {len(texts)}")
    return ("\n".join(lines) + "\n").encode()

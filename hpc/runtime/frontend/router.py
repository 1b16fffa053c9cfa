"""Live worker instances per role, one RPC connection each; round-robin or least-loaded choice.

An instance leaves routing the moment its connection drops (a killed worker) or its discovery lease
expires (a hung or partitioned worker), whichever comes first. One exception: when most known instances lose
their leases at once, that is discovery's fault (an etcd pause or restart expires every lease when it resumes),
not theirs, so the ones still connected keep serving for a grace period while they re-register. etcd's watch
reports each expired lease as its own event, so "at once" is a window: a connected instance whose lease expired
waits SETTLE_S for others to follow before it leaves routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import time
from collections.abc import Set
from typing import Any, AsyncGenerator, Awaitable, Callable, cast

from hpc.runtime.frontend.kv_index import KvIndex, holder
from hpc.runtime.services.discovery import Instance, Snapshot
from hpc.runtime.engine.types import GenerateOutput, GenerateRequest
from hpc.runtime.serve.rpc import OpenAhead, PeerGone, RpcClient
from hpc.runtime.serve.wire import replace
from hpc.spec.recipe import RouterPolicy

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
SYNC_WAIT_S = 10.0  # a request before discovery's first answer waits this long for it (a restarted frontend)
MASS_EXPIRY_GRACE_S = 5.0  # workers refresh every LEASE_TTL_S / 4 and re-register at once when a lease expired
SETTLE_S = 0.3  # how far apart the watch events of one mass expiry may arrive


def _component(key: str) -> str:
    """An instance key ("prefill/0") as the worker names itself in its events ("prefill-0")."""
    return key.replace("/", "-")


class NoInstance(Exception):
    def __init__(self, role: str, pool: str | None = None, draining: int = 0) -> None:
        where = f" in pool {pool}" if pool else ""
        # Draining workers are on their way out (hpc cancel, or the job's time limit is near): say so, since
        # waiting for them to come back would be in vain.
        why = f" ({draining} draining: the job is being cancelled or is near its time limit)" if draining else ""
        super().__init__(f"no live {role} worker{where}{why}")
        self.role, self.draining = role, draining


class NotStarted(PeerGone):
    """Every worker tried failed before producing anything: the request may go elsewhere as it is."""


class Router:
    def __init__(self, policy: RouterPolicy, token: str | None = None, kv: KvIndex | None = None,
                 overlap_weight: float = 1.0, temperature: float = 0.0, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.token = token
        self.kv = kv  # kv_aware: the workers' cached prefixes, from their KV events
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.rng = rng or random.Random()
        self.inflight_blocks: dict[str, int] = {}  # uncached prompt blocks being computed per instance (kv_aware)
        self.routed: dict[str, int] = {}  # requests per instance
        self.pool_routed: dict[tuple[str, str], int] = {}  # (role, pool) -> requests sent to the pool
        self.pool_retried: dict[tuple[str, str], int] = {}  # (role, pool) -> requests that left it for the next
        self.kv_blocks = {"prompt": 0, "overlap": 0}  # kv_aware: the prompts' full blocks, and those found cached
        self.instances: dict[str, Instance] = {}
        self.clients: dict[str, RpcClient] = {}
        self.inflight: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self.dead: set[str] = set()  # instance ids whose connection dropped
        self.unlisted: dict[str, float] = {}  # key -> when it leaves routing unless it re-registers
        self.vanished_at: dict[str, float] = {}  # key -> when its lease expired (connected instances only)
        self._rr: dict[str, itertools.count] = {}  # one turn order per role
        self._ahead = OpenAhead("worker")
        self.synced = asyncio.Event()  # discovery answered once: "no live worker" means none, not "not asked yet"
        self.picked_rank: int | None = None  # the attention-DP rank of the last pick (kv_aware), else None

    def update(self, snapshot: Snapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.synced.set()
        self.expire_unlisted(now)
        fresh = {k: i for k, i in snapshot.items() if i.instance_id not in self.dead}
        for key in list(self.instances):
            if key in fresh and fresh[key].instance_id == self.instances[key].instance_id:
                self.instances[key] = fresh[key]  # the same process, perhaps draining now
                self.unlisted.pop(key, None)
                self.vanished_at.pop(key, None)
            elif key in fresh:  # restarted under the same name: the old process is gone
                self._drop(key)
            elif self.instances[key].draining:
                self._drop(key)  # drained and deregistered: gone on purpose, not discovery's fault
            elif key in self.unlisted:
                pass  # still within its settle window or grace (expire_unlisted dropped those past it)
            elif self._connected(key):  # wait a moment: others may follow (then it is discovery's fault)
                self.unlisted[key] = now + SETTLE_S
                self.vanished_at[key] = now
            else:
                self._drop(key)
        recent = [k for k, t in self.vanished_at.items() if now - t <= SETTLE_S and k in self.unlisted]
        if len(recent) >= 2 and 2 * len(recent) > len(self.instances):
            for key in recent:
                grace = self.vanished_at[key] + MASS_EXPIRY_GRACE_S
                if self.unlisted[key] < grace:
                    self.unlisted[key] = grace
                    log.warning("lease of %s expired with most others (discovery paused?): kept for %.0f s", key,
                                MASS_EXPIRY_GRACE_S)
        for key, inst in fresh.items():
            if key not in self.instances:
                self.instances[key] = inst
                self.inflight[key] = 0
                log.info("instance up: %s at %s", key, inst.address)

    def _connected(self, key: str) -> bool:
        client = self.clients.get(key)
        return client is not None and client.alive and client.connected

    def expire_unlisted(self, now: float | None = None) -> None:
        """Drop the instances whose grace ran out without re-registering (called on a timer by the frontend)."""
        now = time.monotonic() if now is None else now
        for key, until in list(self.unlisted.items()):
            if now >= until:
                self._drop(key)

    def _drop(self, key: str) -> None:
        self.unlisted.pop(key, None)
        self.vanished_at.pop(key, None)
        inst = self.instances.pop(key, None)
        client = self.clients.pop(key, None)
        self.inflight.pop(key, None)
        if inst is not None:
            log.info("instance gone: %s", key)
        if client is not None and client.alive:
            try:
                asyncio.get_running_loop().create_task(client.close())
            except RuntimeError:  # no loop running (a caller outside the frontend's loop): nothing to close on
                pass

    def _lost(self, key: str, client: RpcClient) -> None:
        inst = self.instances.get(key)
        if inst is not None and self.clients.get(key) is client:
            self.dead.add(inst.instance_id)
            self._drop(key)

    def live(self, role: str) -> list[Instance]:
        """The instances of `role` that take new requests (listed, not draining)."""
        return [i for i in self.instances.values() if i.role == role and not i.draining]

    def draining(self, role: str) -> list[Instance]:
        """The instances of `role` that finish what they hold and take nothing new."""
        return [i for i in self.instances.values() if i.role == role and i.draining]

    def pick(self, role: str, exclude: set[str], tokens: list[int] | None = None,
             pool: str | None = None) -> tuple[str, RpcClient, int]:
        """(instance key, its client, the prompt blocks it will compute: kv_aware's load on it); within `pool`
        when given. For an instance with attention-DP ranks, kv_aware picks the rank too (`picked_rank`)."""
        self.picked_rank = None
        ours = [(k, i) for k, i in self.instances.items() if i.role == role and (pool is None or i.pool == pool)]
        keys = sorted(k for k, i in ours if k not in exclude and not i.draining)
        if not keys:
            raise NoInstance(role, pool, draining=sum(1 for _, i in ours if i.draining))
        turn = next(self._rr.setdefault(f"{role}/{pool}" if pool else role, itertools.count()))
        new_blocks = 0
        keys = keys[turn % len(keys):] + keys[:turn % len(keys)]  # ties go round the role's instances
        if self.policy is RouterPolicy.KV_AWARE and tokens and role in ("agg", "prefill") and self.kv is not None \
                and not self.kv.stale:
            total, held = self.kv.overlaps(tokens)
            weight = self.overlap_weight
            ranks = {k: self._best_rank(k, held, turn) for k in keys}

            def cost(k: str) -> tuple[float, int]:
                return weight * (total - ranks[k][1]) + self.inflight_blocks.get(k, 0), self.inflight.get(k, 0)
            key = self._draw(keys, cost) if self.temperature > 0 else min(keys, key=cost)
            self.picked_rank, cached = ranks[key]
            new_blocks = total - cached
            self.kv_blocks["prompt"] += total
            self.kv_blocks["overlap"] += total - new_blocks
        elif self.policy is RouterPolicy.ROUND_ROBIN:
            key = keys[0]
        else:  # least loaded, and kv_aware without an event stream
            key = min(keys, key=lambda k: self.inflight.get(k, 0))
        self.routed[key] = self.routed.get(key, 0) + 1
        return key, self._client(key), new_blocks

    def _best_rank(self, key: str, held: dict[str, int], turn: int) -> tuple[int | None, int]:
        """(the attention-DP rank of `key` holding most of the prompt, its blocks); ties go round the ranks.
        (None, blocks) for an instance without ranks."""
        size = self.instances[key].dp_size
        if size == 1:
            return None, held.get(_component(key), 0)
        order = [(turn + r) % size for r in range(size)]
        best = max(order, key=lambda r: held.get(holder(_component(key), r), 0))
        return best, held.get(holder(_component(key), best), 0)

    def _client(self, key: str) -> RpcClient:
        client = self.clients.get(key)
        if client is None or not client.alive:
            inst = self.instances[key]
            client = RpcClient(inst.host, inst.rpc_port, on_lost=lambda c, k=key: self._lost(k, c), token=self.token)
            self.clients[key] = client
        return client

    def preconnect(self) -> None:
        """Connect to every listed instance not connected yet (after update, on the event loop)."""
        for key, inst in self.instances.items():
            if not inst.draining:
                self._ahead.open(self._client(key))

    def _draw(self, keys: list[str], cost) -> str:
        """A worker drawn with weight exp(-(cost - cheapest) / temperature)."""
        costs = [cost(k)[0] for k in keys]
        low = min(costs)
        return self.rng.choices(keys, [math.exp(-(c - low) / self.temperature) for c in costs])[0]

    async def generate(self, role: str, request: GenerateRequest, deadline: float | None = None,
                       pools: list[str] | None = None,
                       before_next_pool: Callable[[Exception, Any], Awaitable[Any]] | None = None,
                       avoid: Set[str] = frozenset(), chosen: list[str] | None = None,
                       ) -> AsyncGenerator[GenerateOutput, None]:
        """Stream from one instance of `role`. A request that produced nothing yet is retried elsewhere: on other
        instances, and with `pools` (the global router's order: the chosen pool, then the faster ones to retry on)
        in the next pool when its own has no live worker or all that were tried failed before the first byte.
        `before_next_pool(failure, request)` gives the request the next pool gets (a decode whose KV may have gone
        with the failed worker needs a fresh prefill). Instances in `avoid` are not picked; each one picked is
        appended to `chosen`."""
        if not self.synced.is_set():  # a frontend started again takes requests before it has read discovery
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.synced.wait(), SYNC_WAIT_S)
        order: list[str | None] = list(pools) if pools else [None]
        for n, pool in enumerate(order):
            if pool is not None:
                self.pool_routed[(role, pool)] = self.pool_routed.get((role, pool), 0) + 1
            try:
                async with contextlib.aclosing(self._generate_in(role, request, deadline, pool, avoid,
                                                                 chosen)) as outs:
                    async for out in outs:
                        yield out
                return
            except (NoInstance, NotStarted) as exc:
                if n == len(order) - 1 or pool is None:  # the last pool (None: no pools, the only one)
                    raise
                self.pool_retried[(role, pool)] = self.pool_retried.get((role, pool), 0) + 1
                log.warning("%s pool %s: %s; retrying on pool %s", role, pool, exc, order[n + 1])
                if before_next_pool is not None:
                    request = await before_next_pool(exc, request)

    async def _generate_in(self, role: str, request: GenerateRequest, deadline: float | None,
                           pool: str | None, avoid: Set[str],
                           chosen: list[str] | None) -> AsyncGenerator[GenerateOutput, None]:
        tried: set[str] = set()
        while True:
            key, client, blocks = self.pick(role, tried | set(avoid), getattr(request, "token_ids", None), pool)
            if chosen is not None:
                chosen.append(key)
            if self.picked_rank is not None:  # the engine schedules it on the rank whose cache holds its prefix
                request = replace(request, dp_rank=self.picked_rank)
            started = False
            self.inflight[key] = self.inflight.get(key, 0) + 1
            self.inflight_blocks[key] = self.inflight_blocks.get(key, 0) + blocks
            self.served[role] = self.served.get(role, 0) + 1
            try:
                # closed here when the caller stops early (a stop string): the worker's stream is cancelled at
                # once, not when the event loop's finalizer gets to the generator
                async with contextlib.aclosing(client.stream(request, deadline=deadline)) as replies:
                    async for out, _ in replies:
                        started = True
                        yield cast(GenerateOutput, out)  # a generate call's replies are outputs
                return
            except asyncio.TimeoutError:
                raise  # the request's deadline, not the worker's fault (TimeoutError is an OSError)
            except (PeerGone, ConnectionError, OSError) as exc:
                tried.add(key)
                self._lost(key, client)
                if started:
                    raise PeerGone(f"{role} worker {key} failed mid-request: {exc}") from None
                if len(tried) >= MAX_ATTEMPTS:
                    raise NotStarted(f"{role} worker {key} failed before starting: {exc}") from None
                log.warning("%s worker %s unreachable before starting; retrying elsewhere", role, key)
            finally:
                if key in self.inflight:
                    self.inflight[key] -= 1
                if key in self.inflight_blocks:
                    self.inflight_blocks[key] -= blocks

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

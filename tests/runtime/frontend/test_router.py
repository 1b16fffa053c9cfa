"""The router's view of discovery: one lost lease drops a worker; most leases lost at once (etcd paused and
resumed: one watch event per lease, a few ms apart) keep the connected ones for a grace period while they
re-register."""

from __future__ import annotations

import pytest

from hpc.runtime.frontend.router import MASS_EXPIRY_GRACE_S, SETTLE_S, Router
from hpc.runtime.services.discovery import Instance
from hpc.spec.recipe import RouterPolicy

pytestmark = pytest.mark.unit


class Connected:
    """What the router asks of an RPC client here: whether its connection is up."""

    def __init__(self, up: bool = True) -> None:
        self.alive = self.connected = up
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def _instance(role: str, index: int, generation: int = 0) -> Instance:
    return Instance(role=role, index=index, instance_id=f"{role}-{index}-g{generation}", host="127.0.0.1",
                    rpc_port=30000 + index, http_port=31000 + index, node="n0")


def _router(*instances: Instance, down: tuple[str, ...] = ()) -> Router:
    router = Router(RouterPolicy.ROUND_ROBIN)
    router.update({i.key: i for i in instances}, now=0.0)
    for inst in instances:
        router.clients[inst.key] = Connected(inst.key not in down)
    return router


def test_one_expired_lease_drops_that_worker_within_the_settle_window():
    a, b, c = _instance("decode", 0), _instance("decode", 1), _instance("prefill", 0)
    router = _router(a, b, c)
    router.update({a.key: a, c.key: c}, now=1.0)
    router.expire_unlisted(now=1.0 + SETTLE_S)  # nobody followed it: a worker's fault, not discovery's
    assert sorted(router.instances) == ["decode/0", "prefill/0"] and not router.unlisted


def test_a_disconnected_worker_whose_lease_expired_goes_at_once():
    a, b = _instance("decode", 0), _instance("decode", 1)
    router = _router(a, b, down=("decode/1",))
    router.update({a.key: a}, now=1.0)
    assert sorted(router.instances) == ["decode/0"]


def test_mass_expiry_keeps_connected_workers_until_they_re_register():
    a, b, c = _instance("decode", 0), _instance("decode", 1), _instance("prefill", 0)
    router = _router(a, b, c, down=("decode/1",))
    # etcd resumed after a pause: every lease expired, one watch event each, milliseconds apart
    router.update({a.key: a, c.key: c}, now=10.0)
    router.update({a.key: a}, now=10.01)
    router.update({}, now=10.02)
    assert sorted(router.instances) == ["decode/0", "prefill/0"]  # decode/1's connection is down: gone
    router.expire_unlisted(now=10.0 + SETTLE_S + 0.1)  # past the settle window: the grace holds them
    assert [i.key for i in router.live("decode")] == ["decode/0"]
    router.update({a.key: a}, now=10.3)  # decode/0 registered again under its lease
    assert "decode/0" not in router.unlisted and "prefill/0" in router.unlisted
    router.expire_unlisted(now=10.01 + MASS_EXPIRY_GRACE_S - 0.1)  # prefill/0's lease expired at 10.01
    assert "prefill/0" in router.instances
    router.expire_unlisted(now=10.01 + MASS_EXPIRY_GRACE_S)
    assert sorted(router.instances) == ["decode/0"]  # prefill/0 never came back: dropped after the grace


def test_a_restarted_worker_replaces_the_old_process():
    a = _instance("decode", 0)
    router = _router(a, _instance("prefill", 0))
    again = _instance("decode", 0, generation=1)
    router.update({again.key: again, "prefill/0": _instance("prefill", 0)}, now=1.0)
    assert router.instances["decode/0"].instance_id == again.instance_id
    assert "decode/0" not in router.clients  # the old connection is not reused for the new process


def test_a_listed_worker_is_connected_before_its_first_request():
    # The first request to a new worker should not pay for the connection (nor its token's Hello).
    import asyncio

    async def main():
        accepted = []

        async def worker_side(reader, writer):  # a worker's RPC port: holds what connects
            accepted.append(await reader.read(1))
        server = await asyncio.start_server(worker_side, "127.0.0.1", 0)
        worker = Instance(role="decode", index=0, instance_id="d0", host="127.0.0.1",
                          rpc_port=server.sockets[0].getsockname()[1], http_port=1, node="n0")
        router = Router(RouterPolicy.ROUND_ROBIN, token="t 'x' $(y)")
        router.update({worker.key: worker})
        router.preconnect()
        for _ in range(200):
            if accepted:
                break
            await asyncio.sleep(0.01)
        _, client, _ = router.pick("decode", set())
        state = (len(accepted), client is router.clients[worker.key], client.connected)
        await router.close()
        server.close()
        return state

    assert asyncio.run(main()) == (1, True, True)  # connected ahead, and that connection is the one used


def test_a_draining_worker_gets_no_new_requests_but_keeps_its_connection():
    """Draining (hpc cancel, the job's time limit) is not a lost worker: what it serves finishes on the same
    connection; once every worker of a role drains, the refusal says why."""
    from hpc.runtime.frontend.router import NoInstance

    a, b = _instance("agg", 0), _instance("agg", 1)
    router = _router(a, b)
    router.update({a.key: a.model_copy(update={"draining": True}), b.key: b}, now=1.0)
    router.expire_unlisted(now=1.0 + SETTLE_S)
    assert sorted(router.instances) == ["agg/0", "agg/1"] and not router.clients["agg/0"].closed
    assert [i.key for i in router.live("agg")] == ["agg/1"]
    assert {router.pick("agg", set())[0] for _ in range(4)} == {"agg/1"}
    router.update({k: i.model_copy(update={"draining": True}) for k, i in ((a.key, a), (b.key, b))}, now=2.0)
    with pytest.raises(NoInstance, match=r"^no live agg worker \(2 draining: the job is being cancelled or is near"):
        router.pick("agg", set())
    router.update({}, now=3.0)  # drained and gone together: on purpose, not a mass expiry to wait out
    assert router.instances == {} and router.clients == {} and not router.unlisted


def test_a_request_before_discoverys_first_answer_waits_for_it():
    """A frontend started again (its supervisor, after a crash) takes connections at once; its first requests wait
    for the workers' list instead of being refused for want of it."""
    import asyncio

    class Streaming(Connected):
        async def stream(self, request, deadline=None):
            yield "token", None

    async def main() -> list:
        router = Router(RouterPolicy.ROUND_ROBIN)
        a = _instance("agg", 0)
        router.clients[a.key] = Streaming()
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, router.update, {a.key: a})
        started = loop.time()
        outs = [out async for out in router.generate("agg", object())]
        return [outs, loop.time() - started]

    outs, waited = asyncio.run(main())
    assert outs == ["token"] and 0.15 < waited < 2


def test_no_live_worker_asks_clients_to_retry_unless_the_workers_are_leaving():
    """Clients (the OpenAI SDK) honour Retry-After: worth it while a worker starts again, not when the job ends."""
    from hpc.runtime.frontend.openai import upstream_error as _api_error
    from hpc.runtime.frontend.router import NoInstance

    restarting = _api_error(NoInstance("decode")).response()
    assert restarting.status == 503 and restarting.headers["retry-after"] == "1"
    leaving = _api_error(NoInstance("decode", draining=2)).response()
    assert leaving.status == 503 and "retry-after" not in leaving.headers


def test_the_frontend_imports_no_torch():
    """A frontend process (one to four a job) is HTTP, tokenizing and routing: torch would cost each 3-4 s to
    start and hundreds of MB. The KV-aware index's block hashes come from a torch-free module."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "import hpc.runtime.frontend.server, hpc.runtime.frontend.app, hpc.runtime.frontend.kv_index\n"
             "print('torch' in sys.modules, 'hpc.runtime.frontend.kv_index' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr

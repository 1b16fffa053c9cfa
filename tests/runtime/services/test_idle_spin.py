"""runtime.idle_spin_us: while a request is in flight and for a while after, each serving process polls its sockets
without sleeping (event loops: IdleSpin; an engine process's scheduler thread, after its last work: Poller), and the
servers say when a call starts and ends."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from hpc.runtime.services.node import SPIN_AUTO_PREFILL_S, SPIN_AUTO_S, IdleSpin, idle_spin_seconds
from hpc.runtime.worker.engine_link import Poller, Submit, ToEngine, encode
from hpc.runtime.engine.types import GenerateRequest

pytestmark = pytest.mark.unit


class CountingSpin(IdleSpin):
    """Counts the loop's turns while it spins: one _spin a turn."""

    turns = 0

    def _spin(self) -> None:
        self.turns += 1
        super()._spin()


def test_a_touch_keeps_the_loop_turning_without_sleeping_for_the_window_then_lets_it_sleep():
    async def main() -> tuple[CountingSpin, list]:
        spin = CountingSpin(0.02)
        seen = []
        spin.touch()
        assert spin.spinning
        await asyncio.sleep(0.01)
        spin.touch()  # a second touch moves the window's end
        await asyncio.sleep(0.05)
        seen.append((spin.turns, spin.spinning, spin.seconds))
        await asyncio.sleep(0.03)  # no touch: the loop sleeps, nothing turns
        seen.append((spin.turns, spin.spinning, spin.seconds))
        return spin, seen

    spin, ((turns, spinning, seconds), after) = asyncio.run(main())
    # a sleeping loop turns once or twice in 30 ms (its timers); a spinning one thousands of times
    assert turns > 100 and not spinning
    assert 0.028 <= seconds < 0.06  # from the first touch to 20 ms after the second
    assert after == (turns, False, seconds)


def test_a_call_in_flight_keeps_the_loop_turning_past_the_window_and_its_end_starts_one():
    async def main() -> list[tuple[int, bool]]:
        spin = CountingSpin(0.01)
        seen = []
        spin.calls(+1)
        spin.calls(+1)
        spin.calls(-1)  # one of two ended: the other still holds the spin
        await asyncio.sleep(0.04)  # four windows long
        seen.append((spin.turns, spin.spinning))
        spin.calls(-1)
        await asyncio.sleep(0.005)  # within the window after the last end
        seen.append((spin.turns, spin.spinning))
        await asyncio.sleep(0.03)
        seen.append((spin.turns, spin.spinning))
        await asyncio.sleep(0.03)
        seen.append((spin.turns, spin.spinning))
        return seen

    (during, in_flight), (after_end, in_window), (ran_out, spinning), (later, _) = asyncio.run(main())
    assert during > 100 and in_flight  # a sleeping loop turns once or twice in 40 ms; a spinning one thousands
    assert after_end > during and in_window
    assert not spinning and later == ran_out  # the window ran out: the loop sleeps


def test_a_worker_whose_engine_shares_its_process_spins_the_window_alone():
    async def main() -> tuple[bool, bool]:
        spin = CountingSpin(0.01, through_calls=False)
        spin.calls(+1)
        spinning_at_start = spin.spinning
        await asyncio.sleep(0.04)  # the call still in flight, four windows on
        return spinning_at_start, spin.spinning

    # the engine's thread gets the GIL back once the window after the call's start has run out
    assert asyncio.run(main()) == (True, False)
    assert CountingSpin(0.01, through_calls=False).stats("")["idle_spin_in_flight"] == 0.0
    assert CountingSpin(0.01).stats("")["idle_spin_in_flight"] == 1.0


def test_no_window_no_spin():
    async def main() -> CountingSpin:
        spin = CountingSpin(0.0)
        spin.touch()
        spin.calls(+1)  # a call in flight does not spin either: idle_spin_us 0 is off
        await asyncio.sleep(0.01)
        return spin

    spin = asyncio.run(main())
    assert spin.turns == 0 and not spin.spinning
    assert spin.stats("worker_") == {"worker_idle_spin_seconds_total": 0.0, "worker_idle_spin_in_flight": 0.0}


def test_auto_spins_where_the_process_may_use_eight_cpus(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert idle_spin_seconds("auto") == idle_spin_seconds("auto", "decode") == SPIN_AUTO_S
    # a prefill worker's next call comes a whole decode after its last one ended
    assert idle_spin_seconds("auto", "prefill") == SPIN_AUTO_PREFILL_S > SPIN_AUTO_S
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert idle_spin_seconds("auto") == idle_spin_seconds("auto", "prefill") == 0.0  # a small machine's CPUs
    assert idle_spin_seconds(500) == 0.0005 == idle_spin_seconds(500, "prefill") and idle_spin_seconds(0) == 0.0


def _submit(key: int) -> bytes:
    return encode(Submit(key=key, request=GenerateRequest(request_id=str(key), token_ids=[1, 2])))


def test_an_idle_scheduler_spins_after_work_and_finds_a_message_without_sleeping():
    ours, theirs = socket.socketpair()
    poller = Poller(ours, ToEngine, spin_s=0.5)
    assert poller.poll(0) == []  # a busy scheduler's look: the spin's window starts here
    sender = threading.Timer(0.01, lambda: theirs.sendall(_submit(7)))
    sender.start()
    start = time.perf_counter()
    (message,) = poller.poll(2.0)
    sender.join()
    assert message.key == 7 and poller.spin_finds == 1
    assert 0.005 < poller.spin_seconds < time.perf_counter() - start + 1e-3
    # idle longer than the window: no spin, a plain wait (here running out)
    poller.busy_at = time.perf_counter() - 1.0
    spun = poller.spin_seconds
    assert poller.poll(0.01) == [] and poller.spin_seconds == spun and poller.spin_finds == 1
    # a wake() from another thread ends a spin as it ends a wait
    poller.poll(0)
    threading.Timer(0.01, poller.wake).start()
    start = time.perf_counter()
    assert poller.poll(2.0) == [] and time.perf_counter() - start < 0.4 and poller.spin_finds == 2
    theirs.close()
    ours.close()


def test_without_a_window_the_scheduler_sleeps_at_once():
    ours, theirs = socket.socketpair()
    poller = Poller(ours, ToEngine)
    poller.poll(0)
    threading.Timer(0.01, lambda: theirs.sendall(_submit(3))).start()
    (message,) = poller.poll(2.0)
    assert message.key == 3 and poller.spin_finds == 0 and poller.spin_seconds == 0.0
    theirs.close()
    ours.close()


def test_the_servers_say_when_a_request_starts_and_ends():
    from hpc.runtime.serve.http import HttpServer, Response
    from hpc.runtime.serve.rpc import RpcClient, RpcServer
    from hpc.runtime.serve.wire import StatsQuery, WorkerStats

    async def stats(call, payload):
        yield WorkerStats(values={}), b""

    async def answer(request) -> Response:
        return Response(body=b"ok")

    async def main() -> tuple[list[int], list[int]]:
        rpc_touches: list[int] = []
        http_touches: list[int] = []
        rpc = RpcServer({StatsQuery: stats}, on_activity=rpc_touches.append)
        await rpc.start("127.0.0.1", 0)
        client = RpcClient("127.0.0.1", rpc.port)
        web = HttpServer(answer, on_activity=http_touches.append)
        await web.start("127.0.0.1", 0)
        try:
            await client.call(StatsQuery())
            reader, writer = await asyncio.open_connection("127.0.0.1", web.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")  # a probe: no spin
            await reader.readuntil(b"ok")
            writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            await reader.readuntil(b"ok")
            writer.close()
        finally:
            await client.close()
            await rpc.close()
            await web.close()
        return rpc_touches, http_touches

    # each: its start and its end (the HTTP server's POST alone), so that a spin lasts while a call is in flight
    assert asyncio.run(main()) == ([1, -1], [1, -1])


@pytest.mark.parametrize("bad", ["-1", "100001", "true", "often", "1.5", "$(id)"])
def test_a_bad_setting_is_one_line_naming_the_recipe_and_field_exit_2(bad, capsys, tmp_path, monkeypatch):
    from hpc.cli.main import main
    from hpc.spec.recipe import RuntimeSpec

    assert RuntimeSpec().idle_spin_us == "auto" and RuntimeSpec(idle_spin_us=0).idle_spin_us == 0
    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["launch", "-r", "tiny-agg", "--dry-run", "--set", f"runtime.idle_spin_us={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tiny-agg.yaml" in err[0] and "idle_spin_us" in err[0], err
    assert "microseconds from 0 to 100000 or 'auto'" in err[0] or "boolean" in err[0], err
    assert not (tmp_path / "runs").exists()  # nothing written

"""The frontend group's dealer on its own, over real sockets in one event loop: the process holding the fewest
open connections gets the next (ties in turn), running out of file descriptors pauses accepting instead of
spinning on a readable port, and a process whose channel to process 0 is full tells of its closed connections
later instead of losing them."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from hpc.runtime.frontend import dealer as dealing
from hpc.runtime.frontend.dealer import Dealer, Taker, channel_pair, listen

pytestmark = pytest.mark.unit


def test_the_fewest_open_gets_the_next_and_equals_take_turns():
    d = Dealer(socket.socket(), lambda conn: None)
    d.open = [2, 0, 0, 1]
    assert [d.pick() for _ in range(2)] == [1, 2]
    d.open = [1, 1, 1, 1]
    assert [d.pick() for _ in range(4)] == [3, 0, 1, 2]  # in turn from the last pick on
    d.listener.close()


class _Exhausted:
    """A listening socket whose first accept fails as with no file descriptor left (EMFILE)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.failed = sock, 0

    def accept(self):
        if not self.failed:
            self.failed += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_out_of_file_descriptors_pauses_accepting_then_takes_the_connection(monkeypatch):
    monkeypatch.setattr(dealing, "_PAUSE_S", 0.2)

    async def main():
        served: list[socket.socket] = []
        listener = _Exhausted(listen("127.0.0.1", 0))
        d = Dealer(listener, served.append).start()
        loop = asyncio.get_running_loop()
        wakes = 0
        accept = d._accept

        def counted():
            nonlocal wakes
            wakes += 1
            accept()
        d._accept = counted
        loop.remove_reader(listener.fileno())
        loop.add_reader(listener.fileno(), counted)
        client = socket.create_connection(listener.getsockname())
        await asyncio.sleep(0.1)
        paused_wakes, paused_served = wakes, list(served)
        await asyncio.sleep(0.3)
        d.close()
        client.close()
        for conn in served:
            conn.close()
        return paused_wakes, paused_served, served, d.open

    paused_wakes, paused_served, served, open_ = asyncio.run(main())
    assert paused_wakes == 1 and paused_served == []  # one failed accept, then no spinning on the readable port
    assert len(served) == 1 and open_ == [1]  # taken after the pause, by process 0 (alone here)


def test_a_full_channel_tells_of_closed_connections_later_not_never():
    async def main():
        d = Dealer(listen("127.0.0.1", 0), lambda conn: None).start()
        ours, theirs = channel_pair()
        taker = Taker(theirs, lambda conn: None).start()
        d.add(ours)
        loop = asyncio.get_running_loop()
        loop.remove_reader(ours.fileno())  # process 0 busy: it reads nothing for a while
        d.open[1] = 100_000
        told = 0
        while not taker._untold:  # closes until the channel is full and one is kept for later
            taker.closed_here()
            told += 1
        loop.add_reader(ours.fileno(), d._closed_there, 1)  # process 0 reads again
        for _ in range(200):
            await asyncio.sleep(0.01)
            if d.open[1] == 100_000 - told:
                break
        left, untold = d.open[1], taker._untold
        taker.close()
        d.close()
        return told, left, untold

    told, left, untold = asyncio.run(main())
    assert told > 10 and untold == 0 and left == 100_000 - told, (told, left, untold)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_listener_takes_an_address_or_a_name(host):
    # as asyncio's create_server: a name is resolved (the frontend binds what the manifest says of its node)
    try:
        listener = listen(host, 0)
    except OSError as exc:  # a machine without IPv6 on its loopback
        pytest.skip(f"{host}: {exc}")
    with listener, socket.create_connection(listener.getsockname()[:2], timeout=5):
        listener.setblocking(True)
        accepted, _ = listener.accept()
        accepted.close()

"""A frontend group's connections, dealt by process 0 to whichever process holds the fewest open.

With SO_REUSEPORT the kernel picks a process by a hash of each connection's addresses. A client's few keep-alive
connections (a benchmark's 8 users, an OpenAI SDK's pool) then land unevenly: 8 over 4 processes are 2 each only
4 % of the time, and the requests of a process holding 4 wait in a busier event loop while another idles. So
process 0 alone listens; it accepts each connection and keeps it, or passes it (SCM_RIGHTS, over a socketpair made
before the others start) to the process with the fewest open, ties taken in turn. Each process says on that
socketpair when one of its connections closes. A connection is placed once: a client that keeps one connection
busy and the others idle is still uneven, as it would be with any balancer that does not split HTTP/1.1 streams.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Callable

log = logging.getLogger(__name__)

_CONNECTION = b"x"  # process 0 to another: the connection in this message's SCM_RIGHTS is yours
_CLOSED = b"c"  # another process to process 0: one of my connections closed
_ACCEPTS_PER_WAKE = 64  # then back to the loop: a burst of connections does not starve the requests in flight
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_PAUSE_S = 1.0


def listen(host: str, port: int) -> socket.socket:
    """Process 0's listening socket (no SO_REUSEPORT: nothing else may take the port's connections). `host`: an
    address or a name, resolved as asyncio's create_server resolves it (its first address)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(process 0's end, the other process's end): messages keep their bounds, each carrying one connection."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    return ours, theirs


class Dealer:
    """Process 0: accepts on `listener`, serves a connection itself (`serve_here`) or passes it to a process added
    with `add`, whichever holds the fewest open."""

    def __init__(self, listener: socket.socket, serve_here: Callable[[socket.socket], None]) -> None:
        self.listener = listener
        self.serve_here = serve_here
        self.channels: list[socket.socket | None] = [None]  # index 0: this process
        self.open = [0]  # connections each process holds, as it last told
        self.dealt = [0]  # connections each process was given
        self._turn = 0
        self._loop: asyncio.AbstractEventLoop  # start()'s: the loop every reader is on
        self._started = False
        self._resume: asyncio.TimerHandle | None = None  # accepting again after running out of descriptors

    def start(self) -> "Dealer":
        self._loop, self._started = asyncio.get_running_loop(), True
        self._loop.add_reader(self.listener.fileno(), self._accept)
        return self

    def add(self, channel: socket.socket) -> None:
        """A process that is ready for connections, at the other end of `channel`."""
        index = len(self.channels)
        self.channels.append(channel)
        self.open.append(0)
        self.dealt.append(0)
        self._loop.add_reader(channel.fileno(), self._closed_there, index)

    def closed_here(self) -> None:
        self.open[0] -= 1

    def pick(self) -> int:
        """The process with the fewest open connections; among equals, the next in turn."""
        fewest = min(self.open)
        n = len(self.open)
        for step in range(n):
            index = (self._turn + step) % n
            if self.open[index] == fewest:
                self._turn = index + 1
                return index
        raise AssertionError("unreachable: some process holds the fewest")

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client left before we took it
                continue
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:  # the port stays readable: stop a while, as asyncio's server does
                    log.warning("accept on the frontend's port failed (%s): trying again in %.1f s", exc, _PAUSE_S)
                    self._loop.remove_reader(self.listener.fileno())
                    self._resume = self._loop.call_later(_PAUSE_S, self._loop.add_reader, self.listener.fileno(),
                                                         self._accept)
                    return
                log.warning("accept on the frontend's port failed: %s", exc)  # that connection's: go on
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # kept by whoever serves it
            except OSError:  # reset already
                conn.close()
                continue
            self._deal(conn)

    def _deal(self, conn: socket.socket) -> None:
        index = self.pick()
        channel = self.channels[index]
        if channel is not None:
            try:
                socket.send_fds(channel, [_CONNECTION], [conn.fileno()])
            except OSError as exc:  # that process is going (the group stops with it): served here instead
                log.warning("passing a connection to frontend process %d failed (%s): served by process 0",
                            index, exc)
                index = 0
            else:
                conn.close()  # the other process holds it now
        self.open[index] += 1
        self.dealt[index] += 1
        if index == 0:
            self.serve_here(conn)

    def _closed_there(self, index: int) -> None:
        channel = self.channels[index]
        while channel is not None:  # index 0, this process, has no channel
            try:
                message = channel.recv(16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message = b""
            if not message:  # that process ended: its watcher stops the group; deal to it no more
                self._loop.remove_reader(channel.fileno())
                self.open[index] = 1 << 30
                return
            self.open[index] -= 1

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        if self._started:
            self._loop.remove_reader(self.listener.fileno())
            for channel in self.channels[1:]:
                if channel is not None:
                    self._loop.remove_reader(channel.fileno())
                    channel.close()
        self.listener.close()


class Taker:
    """Another process: serves each connection process 0 passes it, and tells it when one closes."""

    def __init__(self, channel: socket.socket, serve_here: Callable[[socket.socket], None]) -> None:
        self.channel = channel
        self.serve_here = serve_here
        self._loop: asyncio.AbstractEventLoop  # start()'s
        self._started = False
        self._untold = 0  # connections closed here that process 0 has not been told of yet

    def start(self) -> "Taker":
        self.channel.setblocking(False)
        self._loop, self._started = asyncio.get_running_loop(), True
        self._loop.add_reader(self.channel.fileno(), self._take)
        return self

    def closed_here(self) -> None:
        self._untold += 1
        self._tell()

    def _tell(self) -> None:
        """Each closed connection as a message of its own (process 0 counts messages)."""
        while self._untold:
            try:
                self.channel.send(_CLOSED)
            except BlockingIOError:  # process 0 reads later: try again soon, the count kept
                self._loop.call_later(0.01, self._tell)
                return
            except OSError:  # process 0 is gone: this process is stopping too
                self._untold = 0
                return
            self._untold -= 1

    def _take(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.channel, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            if not message:  # process 0 closed its end: its stdin watch stops this process
                self._loop.remove_reader(self.channel.fileno())
                return
            for fd in fds:
                self.serve_here(socket.socket(fileno=fd))

    def close(self) -> None:
        if self._started:
            self._loop.remove_reader(self.channel.fileno())
        self.channel.close()

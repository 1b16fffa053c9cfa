"""The media fetcher's guard: only public addresses unless the recipe names a host, checked at the decision point
with a stub resolver; real traffic only to this machine's loopback."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hpc.runtime.worker.media import UNREACHABLE, MediaError, address_allowed, read_image_bytes

pytestmark = pytest.mark.unit


def resolver_for(*addresses: str):
    def resolve(host, port, type=0):  # noqa: A002 - getaddrinfo's keyword
        family = socket.AF_INET6 if ":" in addresses[0] else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]
    return resolve


@pytest.mark.parametrize("addresses, allowed, verdict", [
    (("127.0.0.1",), [], None),                       # loopback
    (("169.254.169.254",), [], None),                 # link-local: cloud metadata
    (("10.1.2.3",), [], None),                        # private
    (("192.168.0.7",), [], None),
    (("::1",), [], None),
    (("fd00::5",), [], None),                         # unique local
    (("0.0.0.0",), [], None),
    (("8.8.8.8", "10.0.0.1"), [], None),              # one bad answer spoils the lot
    (("8.8.8.8",), [], "8.8.8.8"),                    # public: allowed
    (("10.1.2.3",), ["10.0.0.0/8"], "10.1.2.3"),      # a CIDR the recipe names
    (("127.0.0.1",), ["images.internal"], "127.0.0.1"),  # a host name the recipe names
])
def test_the_guard_decides_on_every_resolved_address(addresses, allowed, verdict):
    assert address_allowed("images.internal", 80, allowed, resolver_for(*addresses)) == verdict


class _Server(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/redirect-to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
            return
        body = b"\x89PNG fake image bytes"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def loopback_server():
    server = HTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def _read(url, allowed=()):
    return read_image_bytes(url, allowed_local_path=None, max_file_size_mb=1, allowed_hosts=allowed)


def test_loopback_is_refused_unless_the_recipe_names_it(loopback_server):
    with pytest.raises(MediaError, match="not allowed, or not reachable"):
        _read(loopback_server + "/img.png")
    assert _read(loopback_server + "/img.png", ["127.0.0.1"]).startswith(b"\x89PNG")


def test_a_redirect_to_link_local_is_refused_before_connecting(loopback_server):
    with pytest.raises(MediaError) as err:
        _read(loopback_server + "/redirect-to-metadata", ["127.0.0.1"])
    assert str(err.value) == UNREACHABLE


def test_a_closed_port_reads_the_same_as_a_blocked_address(loopback_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(MediaError) as err:
        _read(f"http://127.0.0.1:{closed}/x.png", ["127.0.0.1"])
    assert str(err.value) == UNREACHABLE  # no port-probing through error messages

"""The address a node's services bind to and publish, from the cluster profile's network settings alone (the
preflight reads them from the manifest's JSON, before pydantic is known to be there)."""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """IPv4 address of a network interface (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def advertised_address(interface: str | None, address_family: str = "ipv4") -> str:
    """The interface's address, else the first non-loopback address of this host's name: never 0.0.0.0, and not
    the 127.0.1.1 that Debian's /etc/hosts gives the hostname (a peer cannot reach it)."""
    if interface:
        return interface_address(interface)
    family = socket.AF_INET6 if address_family == "ipv6" else socket.AF_INET
    host = socket.gethostname()
    for info in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM):
        addr = str(info[4][0])
        if not addr.startswith("127.") and addr != "::1":
            return addr
    return str(socket.getaddrinfo(host, None, family)[0][4][0])

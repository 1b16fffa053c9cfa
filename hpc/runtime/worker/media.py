"""Images for multimodal requests: URL, data URL or a local path inside `allowed_local_media_path`."""

from __future__ import annotations

import base64
import io
import os
import http.client
import ipaddress
import socket
import ssl
import urllib.parse
from pathlib import Path
from typing import Callable, Sequence


class MediaError(ValueError):
    """The request's image cannot be used (a 400 for the client)."""


Resolver = Callable[..., list]
MAX_REDIRECTS = 3
# One answer for a blocked address, a closed port and a dead host alike: the fetcher must not be a port scanner.
UNREACHABLE = "cannot fetch the image URL (not allowed, or not reachable)"


def address_allowed(host: str, port: int, allowed_hosts: Sequence[str], resolver: Resolver = socket.getaddrinfo
                    ) -> str | None:
    """The address to connect to, or None when the host resolves to anything but a public address that the
    recipe's `runtime.media_allowed_hosts` (names or CIDRs) does not name. Every resolved address is checked,
    and the caller connects to the one checked here, so a second DNS answer cannot swap in another."""
    try:
        infos = resolver(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    addresses = [info[4][0] for info in infos]
    if not addresses:
        return None
    networks = []
    for entry in allowed_hosts:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            pass
    name_allowed = host.lower() in {h.lower() for h in allowed_hosts}
    for text in addresses:
        ip = ipaddress.ip_address(text.split("%")[0])
        if name_allowed or any(ip in net for net in networks):
            continue
        if not ip.is_global or ip.is_multicast:  # loopback, link-local (169.254/16), private, reserved, ...
            return None
    return addresses[0]


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a checked address, with the URL's host name for SNI and certificate checks."""

    def __init__(self, address: str, host: str, port: int, timeout: float) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self._tls)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


def fetch_url(url: str, limit: int, allowed_hosts: Sequence[str], resolver: Resolver = socket.getaddrinfo,
              timeout: float = 10.0) -> bytes:
    """GET an image over http(s): each hop's address checked before connecting, redirects followed by hand."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError(UNREACHABLE)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = address_allowed(parts.hostname, port, allowed_hosts, resolver)
        if address is None:
            raise MediaError(UNREACHABLE)
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn = (_PinnedHTTPS(address, parts.hostname, port, timeout) if parts.scheme == "https"
                else http.client.HTTPConnection(address, port, timeout=timeout))
        try:
            conn.request("GET", path, headers={"Host": parts.netloc, "User-Agent": "hpc-media"})
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("location"):
                url = urllib.parse.urljoin(url, resp.getheader("location"))
                continue
            if resp.status != 200:
                raise MediaError(UNREACHABLE)
            declared = resp.getheader("content-length")
            if declared and declared.isdigit() and int(declared) > limit:
                raise MediaError(f"the image is larger than max_file_size_mb ({limit / 2**20:g})")
            data = resp.read(limit + 1)  # stop reading as soon as the limit is passed
        except (OSError, http.client.HTTPException):
            raise MediaError(UNREACHABLE) from None
        finally:
            conn.close()
        if len(data) > limit:
            raise MediaError(f"the image is larger than max_file_size_mb ({limit / 2**20:g})")
        return data
    raise MediaError(UNREACHABLE)


def read_image_bytes(ref: str, *, allowed_local_path: str | None, max_file_size_mb: float,
                     allowed_hosts: Sequence[str] = (), resolver: Resolver = socket.getaddrinfo) -> bytes:
    limit = int(max_file_size_mb * 1024 * 1024)
    if ref.startswith("data:"):
        header, _, data = ref.partition(",")
        raw = base64.b64decode(data) if ";base64" in header else data.encode()
        if len(raw) > limit:
            raise MediaError(f"image exceeds max_file_size_mb ({max_file_size_mb})")
        return raw
    if ref.startswith(("http://", "https://")):
        return fetch_url(ref, limit, allowed_hosts, resolver)
    path_text = ref.removeprefix("file://")
    if allowed_local_path is None:
        raise MediaError("local image paths are disabled (set runtime.allowed_local_media_path in the recipe)")
    root = Path(allowed_local_path).expanduser().resolve()
    candidate = Path(path_text)
    if ".." in candidate.parts:
        raise MediaError("image path must not contain '..'")
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = candidate.resolve()  # follows symlinks, so one pointing outside is caught below
    if resolved != root and root not in resolved.parents:
        raise MediaError(f"image path is outside allowed_local_media_path ({root})")
    if not resolved.is_file():
        raise MediaError(f"image not found: {path_text}")
    if os.path.getsize(resolved) > limit:
        raise MediaError(f"image is larger than max_file_size_mb ({max_file_size_mb})")
    return resolved.read_bytes()


def to_pixels(data: bytes, size: int):
    """Bytes of any PIL-readable image -> float tensor [3, size, size] in [0, 1]."""
    import torch
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size))
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"not a readable image: {exc}") from None
    raw = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(size, size, 3)
    return raw.permute(2, 0, 1).float() / 255.0

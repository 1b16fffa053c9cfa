"""Small blocking HTTP helpers for probes, readiness and smoke checks (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator


def get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def reach_json(url: str, timeout: float = 2.0) -> tuple[int, Any] | None:
    """get_json, or None when nothing answers at `url` (refused, unreachable, timed out): an endpoint not listening
    yet, or any more, is an answer for a prober to act on, not an error."""
    try:
        return get_json(url, timeout)
    except OSError:
        return None


def get_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def post_json(url: str, body: Any, timeout: float = 60.0) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def post_sse(url: str, body: Any, timeout: float = 60.0) -> Iterator[Any]:
    """Each `data:` event of a streaming response, parsed; stops at [DONE]."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            yield json.loads(payload)


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Sum of a Prometheus metric's samples for each value of one of its labels (samples without it left out)."""
    totals: dict[str, float] = {}
    marker = f'{label}="'
    for line in text.splitlines():
        if line.startswith(name + "{") and marker in line:
            value = line.split(marker, 1)[1].split('"', 1)[0]
            totals[value] = totals.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def metric_values(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total

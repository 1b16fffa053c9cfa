"""A local launch's port range: free on loopback and not claimed by another launch that has not bound its ports
yet (two launches at the same moment both saw 23000-23063 free, and the second's etcd failed to bind)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from hpc.launch import local
from hpc.launch.local import PORT_CLAIM_S, free_port_base

pytestmark = pytest.mark.unit


def test_two_launches_in_a_row_get_two_ranges_before_either_binds(tmp_path):
    claims = tmp_path / "claims.json"
    first = free_port_base(41000, 8, claims)
    second = free_port_base(41000, 8, claims)
    assert second >= first + 8  # nothing bound in between: the claim alone kept the second off the first
    assert sorted(map(int, json.loads(claims.read_text()))) == [first, second]


def test_a_claim_lapses_and_a_bound_range_is_skipped_all_the_same(tmp_path, monkeypatch):
    claims = tmp_path / "claims.json"
    first = free_port_base(41000, 8, claims)
    later = local.time.time() + PORT_CLAIM_S + 1
    monkeypatch.setattr(local.time, "time", lambda: later)
    assert free_port_base(41000, 8, claims) == first  # the launch that claimed it bound nothing: reused
    with socket.socket() as held:  # a running stack holds a port of that range
        held.bind(("127.0.0.1", first + 3))
        held.listen()
        later += PORT_CLAIM_S + 1
        assert free_port_base(41000, 8, claims) > first


def test_launches_at_the_same_moment_never_share_a_range(tmp_path):
    claims = tmp_path / "claims.json"
    bases: list[int] = []
    threads = [threading.Thread(target=lambda: bases.append(free_port_base(41000, 8, claims))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bases) == 8 and len(set(bases)) == 8

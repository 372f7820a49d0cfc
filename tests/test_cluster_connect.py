"""`raysched.cluster`: an address is checked before `ray.init`, in one line (no Ray started here).

The whole path with a real `ray start --head` and token auth is `tests/test_long_lived.py`.
"""

from __future__ import annotations

import socket

import pytest

from raysched import cluster, ray_compat
from raysched.cluster import ClusterError, PortInUseError, check_port_free, check_reachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_nothing_listens_is_one_line() -> None:
    port = _closed_port()
    with pytest.raises(ClusterError) as info:
        check_reachable(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
    assert str(info.value) == f"no Ray cluster answers at 127.0.0.1:{port} (127.0.0.1:{port}: connection refused)"


def test_a_listening_address_passes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}", "x")


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:", ":6379", "host:port"])
def test_a_malformed_address_is_one_line(address: str) -> None:
    with pytest.raises(ClusterError, match=f"^Ray address {address!r} is not HOST:PORT or 'auto'$"):
        check_reachable(address, address)


def test_auto_without_a_cluster_says_how_to_start_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def none_found(address: str) -> str:
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(ray_compat, "bootstrap_address", none_found)
    with pytest.raises(ClusterError) as info:
        cluster.attach("auto")
    assert str(info.value) == ("no Ray cluster found for address 'auto': Could not find any running Ray instance. "
                               "Please specify the one to connect to. (start one with `ray start --head`, or pass "
                               "--address HOST:PORT)")


def test_a_taken_port_is_found_before_anything_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"^cannot listen on 127.0.0.1:{port}: "):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again

"""Which address a node gives its peers, and which names a node may go by.

A node that is not told its address (`host=None`) uses the address of the interface that
reaches the coordinator: `connect()` on a UDP socket picks the route and the source address
without sending a packet. Everything peers reach the node at (its gloo groups, a trainer's
checkpoint server) should bind and advertise that one address, so they agree.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from prime_mesh.errors import CoordinatorLost
from prime_mesh.wire import parse_address

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def check_name(name: str) -> str:
    """`name` if it can name a node (letters, digits, '.', '_', '-'; at most 255), else ValueError."""
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError(
            f"node name {name!r}: use 1 to 255 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def is_this_machine_only(host: str) -> bool:
    """True when `host` names only loopback (or wildcard) addresses: other machines cannot
    reach a node there."""
    addrs = _addresses(host)
    return bool(addrs) and all(a.is_loopback or a.is_unspecified for a in addrs)


def route_host(coordinator: str) -> str:
    """The address of this machine's interface that reaches `coordinator` ("host:port")."""
    host, port = parse_address(coordinator)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise CoordinatorLost(
            f"cannot resolve the coordinator's host {host!r} ({e.strerror or e}); check the address"
        ) from None
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(addr)  # UDP: chooses the route and source address, sends nothing
                return str(s.getsockname()[0]).split("%")[0]
            except OSError as e:
                last = e
    raise CoordinatorLost(
        f"no route from this machine to the coordinator at {coordinator} "
        f"({last.strerror if last else 'no address'}); check the address and this machine's network"
    )


def node_host(coordinator: str, host: str | None = None) -> str:
    """The address a node binds and advertises to its peers: `host` when given, else the
    address of the interface that reaches the coordinator (`route_host`).

    ValueError for a `host` only this machine can reach (127.0.0.1, localhost) while the
    coordinator is elsewhere: the peers on other machines could never connect to it."""
    if host is None or host == "":
        return route_host(coordinator)
    coord_host, _ = parse_address(coordinator)
    if is_this_machine_only(host) and not is_this_machine_only(coord_host):
        try:
            routed = f" ({route_host(coordinator)})"
        except CoordinatorLost:
            routed = ""
        raise ValueError(
            f"host {host!r} is reachable from this machine only, but the coordinator at "
            f"{coordinator} is not on loopback: peers on other machines could not connect to "
            "this node. Give this machine's address on the network the nodes share, or leave "
            f"it out to use the one that reaches the coordinator{routed}"
        )
    return host

"""Free TCP ports for a torch.distributed rendezvous (MASTER_PORT) that is bound later.

Binding port 0 returns a port from the kernel's ephemeral range, the range every outgoing
connection takes its local port from; between the pick and the TCPStore's bind (seconds, in a
process still starting) such a connection may take it, and the store fails with EADDRINUSE.
`free_port` draws from outside that range. Outside it, the other bidders are the draws of
other processes (OpenRLHF's four actor groups each draw one before any binds): `free_port(hold=True)`
keeps the port bound until `release(port)`, so no draw or connection can take it meanwhile. Used
by OpenRLHF's actor groups (the compat patch `master_port_held_until_bound`), the learn task's
trainers and `zero3_check`.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux default 32768-60999)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_held: dict[int, socket.socket] = {}


def free_port(tries: int = 64, hold: bool = False) -> int:
    """A port that binds now, drawn outside the ephemeral range where the kernel can; a port
    inside it (what binding port 0 returns) can be taken as the local port of any outgoing
    connection before its owner binds it again.

    `hold=True` keeps the socket bound until `release(port)`: a draw binds without
    SO_REUSEADDR and fails on it, a connection skips it, and the owner's TCPStore, which binds
    with SO_REUSEADDR, binds it beside the held socket (set to reuse once bound)."""
    low, high = _ephemeral_ports()
    ranges = [r for r in ((10000, low - 1), (high + 1, 65535)) if r[1] - r[0] >= 1000]
    rng = random.SystemRandom()
    draws = (rng.randint(*rng.choice(ranges)) for _ in range(tries if ranges else 0))
    for port in (*draws, 0):  # 0 last: no such range, or every try taken: the kernel's choice
        sock = socket.socket()
        try:
            sock.bind(("", port))
        except OSError:
            sock.close()
            continue
        port = sock.getsockname()[1]
        if not hold:
            sock.close()
            return port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _held[port] = sock
        return port
    raise OSError("no free TCP port: port 0 did not bind")


def release(port: int) -> None:
    """Close the socket `free_port(hold=True)` keeps on `port` (nothing if none)."""
    sock = _held.pop(port, None)
    if sock is not None:
        sock.close()

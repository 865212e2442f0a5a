"""Free TCP ports for a torch.distributed rendezvous (MASTER_PORT) that is bound later.

Binding port 0 returns a port from the kernel's ephemeral range, the range every outgoing
connection takes its local port from; between the pick and the TCPStore's bind (seconds, in a
process still starting) such a connection may take it, and the store fails with EADDRINUSE.
`free_port` draws from outside that range. Used by OpenRLHF's actor groups (the compat patch
`master_port_outside_ephemeral_range`), the learn task's trainers and `zero3_check`.
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


def free_port(tries: int = 64) -> int:
    """A port that binds now, drawn outside the ephemeral range where the kernel can; a port
    inside it (what binding port 0 returns) can be taken as the local port of any outgoing
    connection before its owner binds it again."""
    low, high = _ephemeral_ports()
    ranges = [r for r in ((10000, low - 1), (high + 1, 65535)) if r[1] - r[0] >= 1000]
    rng = random.SystemRandom()
    for _ in range(tries if ranges else 0):
        port = rng.randint(*rng.choice(ranges))
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no such range, or every try taken: the kernel's choice
        sock.bind(("", 0))
        return sock.getsockname()[1]

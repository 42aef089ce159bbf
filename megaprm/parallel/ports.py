"""A free TCP port for a rendezvous (torch.distributed's MASTER_PORT, a Ray head)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now ("" = every interface, for a port other nodes
    connect to). The OS picks it; another process may take it before it is used, so callers
    bind it soon after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

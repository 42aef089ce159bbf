"""Rendezvous endpoints: a free TCP port (torch.distributed's MASTER_PORT on another node, a Ray
head), and a store the launching process holds for ranks it starts on this machine."""
from __future__ import annotations

import socket

# the ranks of `held_store` connect to it as clients (torch.distributed's env:// rendezvous reads
# these, as under torchrun's agent), instead of rank 0 binding MASTER_PORT itself
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now ("" = every interface, for a port other nodes
    connect to). The OS picks it; another process may take it before it is used, so callers
    bind it soon after - or, for ranks on this machine, use `held_store`, which has no gap."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def held_store(host: str = "127.0.0.1"):
    """A TCPStore server on a port the OS picks and this process holds from the first moment
    (so no other job on the machine can take it between choosing and binding: the race of
    `free_port`). Ranks reach it at `store.port`: with `AGENT_STORE_ENV` set, env:// rendezvous
    connects every rank as a client; or they pass a client `TCPStore` to init_process_group.
    Keep the returned object alive until the ranks have finished."""
    # deferred: torch is heavy, and `free_port` callers (the launcher's --help) need none of it
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size=None, is_master=True, wait_for_workers=False)

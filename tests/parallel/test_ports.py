"""The rendezvous store a launcher holds: its port is bound from the first moment (nothing else
can take it between choosing and binding, the race `free_port` leaves), ranks reach it as
clients, and the port is free again once the holder lets it go."""
import errno
import socket

import pytest
import torch.distributed as dist

from megaprm.parallel.ports import held_store


def test_the_held_port_cannot_be_taken_and_clients_share_the_store():
    store = held_store()
    port = store.port
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind(("127.0.0.1", port))
    assert e.value.errno == errno.EADDRINUSE
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    with socket.socket() as s:  # released with the holder
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

"""Start `world_size` local ranks without torchrun (tests, `checkpoint_tools verify`, benches).

Each child gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), runs `fn(*args)` and sends back its return value or its traceback.
Children use the spawn start method, so `fn` must be importable (a module-level function).
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, queue, threads):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
        # Serialise here: a tensor put on the queue as-is lives in shared memory that
        # disappears when this process exits, before the parent reads it.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, timeout_s: float = 600.0) -> List[Any]:
    """Run fn(*args) on `world_size` fresh processes; return each rank's result, rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                # A rank killed (os._exit, a signal, OOM) never reports: notice its exit code
                # instead of waiting out the timeout.
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    errors[dead[0][0]] = (f"rank {dead[0][0]} exited with code {dead[0][1]} "
                                          "without reporting a result or a traceback")
                elif time.monotonic() > deadline:
                    errors[-1] = f"timed out after {timeout_s}s waiting for ranks"
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        rank, tb = sorted(errors.items())[0]
        raise RankFailed(f"rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ

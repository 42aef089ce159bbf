"""Run a function on N CPU processes with gloo initialised: the multi-rank test harness.

    from tests.distributed_utils import run_distributed

    def _check(rank, world_size, n):          # module level, so spawn can import it
        ...                                     # torch.distributed is initialised (gloo)
        return {"rank": rank, ...}              # anything torch.save can write

    results = run_distributed(_check, 2, 16)    # [rank 0's return, rank 1's return]

Each call starts `world_size` processes: forks of a server that has imported torch and
megatron-core once (`megaprm.parallel.launch.start_context`), or fresh interpreters (2-8 s of
imports each) when the environment has changed since that server started. Put many checks into
one function rather than one world per check. An exception on any rank is re-raised here as
`DistributedTestError` carrying that rank's traceback; a hung rank is killed after `timeout`
seconds. Return values travel through files (torch.save) rather than
a queue, so tensors need no shared memory between processes.
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megaprm.parallel.ports import held_store


class DistributedTestError(RuntimeError):
    """A rank raised, exited abnormally or timed out."""


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any],
            args: tuple, env: dict | None) -> None:
    from megaprm.parallel.launch import enter_rank

    enter_rank(env)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # N ranks share 2 cores in CI
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        # the caller holds the store's port (ports.held_store): every rank is a client of it
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # report everything, including assertion errors inside fn
        result = {"ok": False, "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, path)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = 180.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be importable by name (a module-level function) and its arguments and return
    value must be picklable by torch.save.
    """
    from megaprm.parallel.launch import gpu_count, hidden_gpus, rank_env, start_context

    ctx = start_context()  # forks of a server that has imported torch and megatron-core
    with tempfile.TemporaryDirectory(prefix="megaprm-dist-") as out_dir:
        store = held_store()  # bound now and held until the ranks end: no port to race for
        port = store.port
        with hidden_gpus(world_size > gpu_count()):  # one GPU, several ranks: gloo on the CPU
            env = rank_env(ctx)
            procs = [ctx.Process(target=_worker,
                                 args=(r, world_size, port, out_dir, fn, args, env),
                                 daemon=True) for r in range(world_size)]
            for p in procs:
                p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            raise DistributedTestError(f"ranks {hung} of {world_size} did not finish within "
                                       f"{timeout:.0f}s running {fn.__name__} (deadlock?)")
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r} exited with code {p.exitcode} and no result")
                continue
            res = torch.load(path, weights_only=False)
            if res["ok"]:
                results.append(res["value"])
            else:
                errors.append(f"rank {r} raised:\n{res['traceback']}")
        if errors:
            raise DistributedTestError(f"{fn.__name__} failed on {len(errors)} of {world_size} "
                                       f"ranks:\n" + "\n".join(errors))
        return results

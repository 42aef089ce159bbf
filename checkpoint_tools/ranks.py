"""How a conversion runs its ranks: under torchrun this process is one of them, otherwise the
leader starts tp*pp local ranks (or runs a world of one in this process); steps that may fail
on some ranks only are agreed, so every rank raises the same one line and none waits in a
collective; the leader's last step (compare, write, rename) is awaited by all ranks."""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from checkpoint_tools import layout
from checkpoint_tools.layout import ConversionError
from megaprm.models.hf_spec import UnsupportedModelError
from megaprm.parallel import cpu, launch
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import run_agreed
from megaprm.parallel.init import ParallelConfigError, init_distributed

# Errors a user causes (wrong paths, configs, weights, layouts); anything else is a bug.
USER_ERRORS = (ConversionError, UnsupportedModelError, ParallelConfigError, FileNotFoundError)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def agree(phase: str, fn: Callable[[], object]):
    """Run a step that may fail on some ranks only; all ranks then raise the same error
    (a rank that failed alone would leave the others waiting in the next collective)."""
    def failure_of(e: Exception) -> str:
        if isinstance(e, USER_ERRORS):
            return f"{e}"
        if isinstance(e, ValueError):  # mapping's shape / missing-tensor errors name the tensor
            return f"{phase}: {e}"
        raise e  # a bug: its traceback, not a line

    def world() -> tuple:  # conversion ranks are one gloo world (`init_ranks`), once it is up
        up = dist.is_initialized()
        return (dist.group.WORLD if up else None), (dist.get_world_size() if up else 1)

    result, found = run_agreed(fn, world, failure_of)
    if found:
        raise ConversionError(found[0][1])
    return result


@contextlib.contextmanager
def shared_tmp(tmp_dir: str | None, out_dir: str):
    """The target's tmp dir: given by the spawning leader (who cleans it up), else made by
    rank 0, broadcast, and removed by rank 0 if this rank half fails."""
    if tmp_dir is not None:
        yield tmp_dir
        return
    box = [layout.make_tmp(out_dir) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    except BaseException:
        if dist.get_rank() == 0:
            discard(box[0])
        raise


def init_ranks(tp: int, pp: int, ep: int = 1) -> Groups:
    """This rank's groups. Conversion is host work on a GPU node too: the stages live in host
    memory (file bytes are read into and written from the parameters' storage), gloo connects
    the ranks, and the check forward runs on the CPU (`cpu.host_only`)."""
    cpu.host_only()
    return agree("parallel layout", lambda: init_distributed(tp=tp, pp=pp, ep=ep))


@dataclass
class _Failed:
    message: str


def _catching(fn, *args):
    """Spawned-rank entry: user errors come back as one line, not as a traceback."""
    try:
        return fn(*args)
    except ConversionError as e:
        return _Failed(str(e))


# How local ranks start. `python -m checkpoint_tools` sets "fork"
# (`__main__.main(fork_ranks=True)`): its leader has imported torch and megatron-core and done
# no torch work yet (no OpenMP pool, no GPU context, no threads), so forks start with its
# imports at no cost. Any other caller (a library user, `megaprm convert`, a test calling
# `main`) may have done torch work, and an OpenMP pool is not fork-safe: "forkserver",
# `launch.spawn`'s forks of a server that has only imported them (fresh interpreters, ~3-8 s
# of imports per rank here, where a GPU is present or the environment changed since the
# server started).
RANK_START = "forkserver"


def run_ranks(fn, world: int, *args) -> list:
    """Run fn on this torchrun world, or start `world` local ranks (`RANK_START`); the leader
    gets all results (under torchrun only its own, as a one-item list). A world of one runs
    in this process: a started rank would still cost a process and its teardown."""
    if launch.under_torchrun():
        return [fn(*args)]
    if world == 1:
        return [in_process(fn, *args)]
    results = launch.spawn(_catching, world, fn, *args, start_method=RANK_START)
    failed = next((r for r in results if isinstance(r, _Failed)), None)
    if failed:
        raise ConversionError(failed.message)
    return results


def in_process(fn, *args):
    """fn as the single rank of a world of one in this process; the process group and
    Megatron's parallel state are torn down afterwards (the caller may convert again)."""
    try:
        return fn(*args)
    finally:
        teardown()


def teardown() -> None:
    """Megatron's parallel state and the process group, destroyed (no-op where none is up).
    Under torchrun every rank calls it before it exits: a gloo group left to the interpreter's
    exit is destroyed while its threads are still joinable, and a rank then dies in
    std::terminate ("terminate called without an active exception", SIGABRT) after the
    checkpoint is complete (1 run in 9-10 of a 4-rank import-hf; scripts/repeat_torchrun_import.py)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_leader() -> bool:
    return not launch.under_torchrun() or int(os.environ["RANK"]) == 0


def finish_on_leader(fn: Callable[[], dict]) -> dict:
    """The leader's last step (compare_logits, write, rename). Under torchrun every rank waits for it
    and raises its error too, so no rank runs ahead (e.g. reads a target not yet renamed)."""
    if not launch.under_torchrun():
        return fn()
    report, err = {}, None
    if is_leader():
        try:
            report = fn()
        except ConversionError as e:
            err = str(e)
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConversionError(box[0])
    return report


def rank_report(g: Groups, outputs, **extra) -> dict:
    rss = [None] * g.world_size
    dist.all_gather_object(rss, peak_rss_mb())
    return {"rank": g.rank, "peak_rss_mb_ranks": rss,
            "outputs": outputs if g.rank == 0 else None, **extra}


def world_of(tp: int, pp: int, ep: int = 1) -> int:
    """Ranks to start: torchrun's world, else one per tp x pp x ep position (ep ranks are data
    parallel ranks of the stage, each holding num_experts / ep experts)."""
    return int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else tp * pp * ep


def rss_report(results: list) -> dict:
    return {"peak_rss_mb": {"ranks": results[0]["peak_rss_mb_ranks"], "driver": peak_rss_mb()}}


def discard(tmp_dir: str | None) -> None:
    if tmp_dir and os.path.isdir(tmp_dir):
        shutil.rmtree(tmp_dir, ignore_errors=True)


def leader_owned(tmp_dir: str | None, fn: Callable[[], dict]) -> dict:
    """Run the leader's finishing step; the tmp dir goes away unless it was renamed."""
    try:
        return fn()
    finally:
        discard(tmp_dir)  # after a successful rename the path no longer exists

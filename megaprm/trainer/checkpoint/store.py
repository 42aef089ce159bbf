"""The directory of step checkpoints (`ckpt_root/step_N`, `latest`, leftovers, pruning), the
MANIFEST check of one step, and the collectives the save and load phases agree through."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from typing import Callable, Optional

import torch
import torch.distributed as dist

from checkpoint_tools import manifest as manifest_file
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import run_agreed

MANIFEST = manifest_file.MANIFEST  # one name for import-hf checkpoints and trainer steps
TRAINER_FILE = "trainer.json"
LATEST = "latest"
FORMAT = "megaprm-trainer-checkpoint"
VERSION = 2
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint problem the user can act on; the message is one line."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(name: str) -> int:
    """N of a `step_N` directory name."""
    return int(STEP_DIR.match(name).group(1))


# ---------------------------------------------------------------------------------- agreement
# On the default group: the checkpoint's collectives run between agreed phases only.

def _flag_device(groups: Groups) -> str:
    return "cuda" if groups.backend == "nccl" else "cpu"


def any_rank(flag: bool, groups: Groups) -> bool:
    if groups.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device(groups))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather(obj, groups: Groups) -> list:
    if groups.world_size == 1:
        return [obj]
    out = [None] * groups.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj, groups: Groups):
    if groups.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(groups: Groups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or repr(e)
    return f"{type(e).__name__}: {text[:400]}"


def _errno(e: BaseException) -> Optional[int]:
    """The OS error number of `e` or of an error it wraps (dist_checkpointing wraps writes)."""
    seen = 0
    while e is not None and seen < 10:
        if getattr(e, "errno", None):
            return e.errno
        if "No space left on device" in str(e):
            return errno.ENOSPC
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def agreed(groups: Groups, fn: Callable[[], object]):
    """Run `fn` on every rank. Returns (result, failures): failures is [] on every rank when all
    succeeded, else the same list of (rank, errno, one-line text) on every rank. Agreed on the
    host group over all ranks (`run_agreed`)."""
    result, found = run_agreed(fn, lambda: (groups.world_host, groups.world_size),
                               lambda e: (groups.rank, _errno(e), one_line(e)))
    return result, [f for _, f in found]


# ------------------------------------------------------------------------- one step's manifest

def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def verified_trainer_json(path: str) -> tuple:
    """(trainer.json of checkpoint `path`, None) when that file matches the MANIFEST, else
    (None, problem). Single process; reads and checksums only that one file (cheap), so a
    launcher can look at a checkpoint without trusting unverified bytes."""
    data, problem = manifest_file.read_verified(path, TRAINER_FILE)
    if problem:
        return None, problem
    try:
        state = json.loads(data)
        if not isinstance(state, dict):
            raise TypeError("not a JSON object")
        return state, None
    except (ValueError, TypeError) as e:
        return None, f"{TRAINER_FILE} cannot be checked ({one_line(e)})"


def identity(state: Optional[dict]) -> tuple:
    """Which run wrote a checkpoint: (run id, config digest); a save adopted after a crash must
    come from the run that `latest` names."""
    state = state or {}
    return state.get("run_id"), state.get("config_digest")


def verify(path: str, groups: Groups) -> list:
    """Problems of checkpoint `path` against its MANIFEST (collective; the same list on every
    rank; [] when intact): missing files, wrong sizes, wrong checksums."""
    manifest, problem = manifest_file.read(path) if groups.rank == 0 else (None, None)
    manifest, problem = broadcast((manifest, problem), groups)
    if problem:
        return [problem]
    files = sorted(manifest["files"])
    mine = [manifest_file.file_problem(os.path.join(path, rel), manifest["files"][rel], rel,
                                       checksum=manifest["checksum"])
            for rel in files[groups.rank::groups.world_size]]
    mine = [p for p in mine if p]
    if not any_rank(bool(mine), groups):
        return []
    return sorted(p for part in gather(mine, groups) for p in part)


# ------------------------------------------------------------------------------------- listing

def step_dirs(ckpt_root: str) -> list:
    """Names of complete-looking `step_N` directories, newest first."""
    if not os.path.isdir(ckpt_root):
        return []
    found = [(int(m.group(1)), e) for e in os.listdir(ckpt_root)
             if (m := STEP_DIR.match(e)) and os.path.isdir(os.path.join(ckpt_root, e))]
    return [e for _, e in sorted(found, reverse=True)]


def read_latest(ckpt_root: str) -> Optional[str]:
    try:
        with open(os.path.join(ckpt_root, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(ckpt_root: str, name: str) -> None:
    tmp = os.path.join(ckpt_root, LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_root, LATEST))
    fsync_dir(ckpt_root)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_leftovers(ckpt_root: str) -> None:
    """Leftovers of an interrupted save: `step_N.tmp`, a replaced `step_N.old.tmp`, `latest.tmp`."""
    for entry in os.listdir(ckpt_root):
        if entry.endswith(".tmp"):
            p = os.path.join(ckpt_root, entry)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.remove(p)
                except OSError:
                    pass


def prune(ckpt_root: str, keep_last: int, newest: str) -> list:
    """Delete complete checkpoints older than the `keep_last` newest (rank 0 only). `newest` (just
    saved) is always kept; damaged and newer directories are left alone. Returns the removed."""
    if keep_last <= 0:
        return []
    older = [e for e in step_dirs(ckpt_root) if step_of(e) <= step_of(newest)]
    removed = []
    for e in older[keep_last:]:
        shutil.rmtree(os.path.join(ckpt_root, e), ignore_errors=True)
        removed.append(e)
    return removed

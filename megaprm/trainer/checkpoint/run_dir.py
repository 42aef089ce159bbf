"""A fresh start (trainer.resume=false) in a run directory: what an earlier run left there,
refusing to overwrite it, or moving it aside whole."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

from megaprm.parallel.groups import Groups
from megaprm.trainer.checkpoint.store import CheckpointError, agreed, fsync_dir, step_dirs
from megaprm.trainer.run_lock import LOCK_FILE


def previous_run(run_dir: str) -> Optional[str]:
    """What `run_dir` holds of an earlier run (for messages), or None when nothing."""
    found = []
    steps = step_dirs(os.path.join(run_dir, "checkpoints"))
    if steps:
        found.append(f"{len(steps)} checkpoint(s), the newest {steps[0]}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return ", ".join(found) or None


def refuse_overwrite(run_dir: str, replace: bool) -> None:
    """A fresh start (trainer.resume=false) in a directory holding a run: refused in one line
    naming the flags, unless `replace` (then `start_fresh` moves the old run). Single process."""
    found = previous_run(run_dir)
    if found and not replace:
        raise CheckpointError(
            f"trainer.run_dir={run_dir} holds an earlier run ({found}) and trainer.resume=false "
            "would overwrite it; resume it (trainer.resume=true), use a new trainer.run_dir, or "
            f"set trainer.replace_run=true to move it into {run_dir}/replaced-<time>/")


def start_fresh(run_dir: str, groups: Groups, *, replace: bool,
                log: Callable[[str], None] = print) -> None:
    """trainer.resume=false (collective, before anything is written to `run_dir`): an earlier
    run there is refused, or with `replace` moved whole into `run_dir/replaced-<time>/` (rank 0;
    the run lock stays). Nothing of an earlier run is deleted or mixed into the new one."""

    def claim():
        if groups.rank != 0:
            return
        refuse_overwrite(run_dir, replace)
        if previous_run(run_dir) is None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = os.path.join(run_dir, f"replaced-{stamp}")
        n = 1
        while os.path.exists(aside):
            aside, n = os.path.join(run_dir, f"replaced-{stamp}-{n}"), n + 1
        os.makedirs(aside)
        for entry in sorted(os.listdir(run_dir)):
            if not entry.startswith((LOCK_FILE, "replaced-")):
                os.rename(os.path.join(run_dir, entry), os.path.join(aside, entry))
        fsync_dir(run_dir)
        log(f"[megaprm] trainer.replace_run: the earlier run in {run_dir} was moved to {aside}")

    _, failures = agreed(groups, claim)
    if failures:
        raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))

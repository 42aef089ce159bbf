"""A fresh start (trainer.resume=false) in a run directory: what an earlier run left there,
refusing to overwrite it, or moving it aside whole."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import yaml

from megaprm.parallel.groups import Groups
from megaprm.trainer.checkpoint.store import CheckpointError, agreed, fsync_dir, step_dirs
from megaprm.trainer.metrics import read_metrics
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


def _earlier_cadence(run_dir: str, steps: int, save_every: int) -> tuple:
    """(trainer.steps, trainer.save_every) of the run that wrote `run_dir` (its config.yaml),
    else the given ones."""
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            earlier = (yaml.safe_load(f) or {}).get("trainer", {})
        return int(earlier.get("steps", steps)), int(earlier.get("save_every", save_every))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return steps, save_every


def refuse_lost_checkpoints(run_dir: str, steps: int, save_every: int) -> None:
    """trainer.resume=true in a run directory with no checkpoint: a fresh start, which drops the
    rows of metrics.jsonl. Refused in one line when those rows show that the earlier run saved a
    checkpoint that is gone (a row past its first save, or of its last step: checkpoints/ was
    removed), since starting over would silently rewrite a finished run's history. Rows up to
    the first save are a run killed before it and run again. Single process."""
    if step_dirs(os.path.join(run_dir, "checkpoints")) or not os.path.isfile(
            os.path.join(run_dir, "metrics.jsonl")):
        return
    rows = read_metrics(run_dir)
    if not rows:
        return
    last = max(int(r.get("step", 0)) for r in rows)
    steps, save_every = _earlier_cadence(run_dir, steps, save_every)
    first_save = min(save_every - 1 if save_every else steps - 1, steps - 1)
    if last > first_save or last >= steps - 1:
        raise CheckpointError(
            f"trainer.run_dir={run_dir} holds an earlier run's metrics.jsonl (steps up to "
            f"{last}, so it saved a checkpoint) but no checkpoint (checkpoints/ removed?), and "
            "trainer.resume=true would start over and rewrite that history; use a new "
            "trainer.run_dir, or trainer.resume=false trainer.replace_run=true to move the old "
            f"run into {run_dir}/replaced-<time>/")


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

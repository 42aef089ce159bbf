"""Run metrics: JSONL in the run directory always, wandb (offline by default) when installed.

Only global rank 0 writes. Values are plain floats; the caller reduces them over dp first.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Optional


class PhaseTimer:
    """Wall time per named phase of one RL step (`timing/<phase>_s` in the metrics)."""

    def __init__(self):
        self.times: dict = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{name}_s"] = self.times.get(f"timing/{name}_s", 0.0) + (
                time.perf_counter() - t0)


class MetricsLogger:
    def __init__(self, run_dir: str, *, enabled: bool, wandb_mode: str = "offline",
                 config: Optional[dict] = None, project: str = "megaprm"):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if wandb_mode != "disabled":
            try:
                import wandb

                # quiet by default: wandb's banner and ~30-line history/summary say what
                # metrics.jsonl and megaprm's own last lines say; WANDB_SILENT / WANDB_QUIET set
                # in the environment are the user's choice and win. reinit="finish_previous":
                # what reinit=True meant (the boolean is deprecated, with a warning per run)
                quiet = not ({"WANDB_SILENT", "WANDB_QUIET"} & set(os.environ))
                settings = wandb.Settings(silent=True) if quiet else None
                self._wandb = wandb.init(project=project, dir=run_dir, mode=wandb_mode,
                                         config=config, reinit="finish_previous",
                                         settings=settings)
            except Exception as e:  # wandb missing or unable to start: JSONL still has it all
                print(f"[megaprm] wandb disabled ({type(e).__name__}: {e}); metrics go to "
                      f"{self.path}")

    def truncate_after(self, step: int, saved_row: Optional[dict] = None) -> None:
        """On resume from the checkpoint of `step`, drop lines of steps it had not reached, and
        a torn last line (a full disk or a kill mid-write), saying so. `saved_row`: the row of
        `step` as its checkpoint stored it; it replaces that step's row when the row is missing
        (torn: the step finished and is not run again)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        rows, torn = _parse(self.path)
        rows = [r for r in rows if r.get("step", 0) <= step]
        restore = saved_row is not None and saved_row.get("step") == step and \
            not any(r.get("step") == step for r in rows)
        if torn:
            fate = (f"step {step}'s row restored from its checkpoint" if restore else
                    "its step did not finish and runs again"
                    if any(r.get("step") == step for r in rows) or step < 0 else
                    f"step {step} was checkpointed, so its row is lost and it is not run again")
            print(f"[megaprm] {self.path}: dropped a torn last line ({torn!r:.80}); {fate}",
                  flush=True)
        if restore:
            rows.append(saved_row)
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(self.path + ".tmp", self.path)

    def log(self, step: int, metrics: dict) -> dict:
        """Append step `step`'s row; returns it (a checkpoint of the step stores it too)."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        return row

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _parse(path: str) -> tuple:
    """(rows, torn last line or None) of a metrics.jsonl. A line that is not a JSON object
    before the last one is not a torn write: ValueError naming the file and line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    rows, torn = [], None
    for n, (lineno, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            rows.append(row)
        except ValueError as e:
            if n == len(lines) - 1:
                torn = line.strip()
            else:
                raise ValueError(f"{path}:{lineno} is not a metrics row ({e}); repair or remove "
                                 "that line") from None
    return rows, torn


def read_metrics(run_dir: str) -> list:
    """The rows of a run's metrics.jsonl (a torn last line, from a step that did not finish,
    is left out)."""
    return _parse(os.path.join(run_dir, "metrics.jsonl"))[0]

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

                self._wandb = wandb.init(project=project, dir=run_dir, mode=wandb_mode,
                                         config=config, reinit=True)
            except Exception as e:  # wandb missing or unable to start: JSONL still has it all
                print(f"[megaprm] wandb disabled ({type(e).__name__}: {e}); metrics go to "
                      f"{self.path}")

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps that the restored checkpoint had not reached."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(rows)
        os.replace(self.path + ".tmp", self.path)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

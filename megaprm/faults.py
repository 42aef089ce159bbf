"""Test-only fault hooks: the one place run code asks "should I fail here?".

The reliability tests start real runs with one of these variables set and check that the run
recovers (resume after a kill, every rank skipping a step one rank found bad):

* `MEGAPRM_KILL_AT=STEP:after_log|after_save`: the trainer SIGKILLs itself after logging
  (or after saving) step STEP.
* `MEGAPRM_CRASH_DURING_SAVE_AT=STEP`: the save of step STEP dies after the model files are
  written, leaving a torn `.tmp` checkpoint.
* `MEGAPRM_FAULT=WHERE:RANK:STEP`: a NaN in the tensor named WHERE (e.g. "outcome") on that
  rank at that step.
* `MEGAPRM_KILL_ROLLOUT_AT=N`: a remote rollout rank SIGKILLs itself before its N-th batch.

Every hook is inert unless its variable is set. The environment is read once, on the first
hook call (not at import: a test sets the variable inside the spawned rank before the run
starts, after the test module, and so this one, was imported)."""
from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass
from typing import Optional, Tuple

KILL_AT_ENV = "MEGAPRM_KILL_AT"
CRASH_DURING_SAVE_AT_ENV = "MEGAPRM_CRASH_DURING_SAVE_AT"
NAN_AT_ENV = "MEGAPRM_FAULT"
KILL_ROLLOUT_AT_ENV = "MEGAPRM_KILL_ROLLOUT_AT"


@dataclass(frozen=True)
class Faults:
    kill_at: str = ""  # "STEP:after_log" or "STEP:after_save"; "" = never
    crash_during_save_at: int = -1  # step whose save dies after the model files; -1 = never
    nan_at: Optional[Tuple[str, int, int]] = None  # (where, rank, step)
    kill_rollout_at: int = -1  # remote rollout batch index; -1 = never


def read_env(env=None) -> Faults:
    """The hooks asked for by the environment (`os.environ` unless `env` is given)."""
    env = os.environ if env is None else env
    nan_at = None
    if env.get(NAN_AT_ENV):
        where, rank, step = env[NAN_AT_ENV].split(":")
        nan_at = (where, int(rank), int(step))
    return Faults(kill_at=env.get(KILL_AT_ENV, ""),
                  crash_during_save_at=int(env.get(CRASH_DURING_SAVE_AT_ENV, "-1")),
                  nan_at=nan_at,
                  kill_rollout_at=int(env.get(KILL_ROLLOUT_AT_ENV, "-1")))


@functools.lru_cache(maxsize=None)
def active() -> Faults:
    """This process's hooks, read from the environment on the first call."""
    return read_env()


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(step: int, where: str) -> None:
    """SIGKILL this process if MEGAPRM_KILL_AT names `step` at `where` ("after_log",
    "after_save")."""
    if active().kill_at == f"{step}:{where}":
        _sigkill()


def crash_during_save(step: int) -> bool:
    """Whether the save of `step` should die after writing the model files."""
    return active().crash_during_save_at == step


def nan_at(where: str, rank: int, step: int, t):
    """`t` with a NaN in its first element if MEGAPRM_FAULT names (where, rank, step);
    otherwise `t` itself."""
    if active().nan_at != (where, rank, step):
        return t
    t = t.clone().float()
    t.view(-1)[0] = float("nan")
    return t


def kill_rollout_at(drawn: int) -> None:
    """SIGKILL this remote rollout rank if MEGAPRM_KILL_ROLLOUT_AT names batch `drawn`."""
    if active().kill_rollout_at == drawn:
        _sigkill()

"""Resuming: the newest intact step checkpoint (damaged ones set aside, another run's ignored),
its layout and config checked, the models, optimisers and RNG restored from it."""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

import torch

from checkpoint_tools import layout, stages
from megaprm.parallel.groups import Groups
from megaprm.parallel.pipeline import unwrap
from megaprm.parallel.rng import set_rng_state
from megaprm.trainer.checkpoint.store import (
    TRAINER_FILE,
    STEP_DIR,
    CheckpointError,
    agreed,
    broadcast,
    identity,
    one_line,
    read_latest,
    step_dirs,
    step_of,
    verified_trainer_json,
    verify,
    write_latest,
)
from megaprm.trainer.run_config import config_diff, config_digest


def find_intact(ckpt_root: str, groups: Groups, *, fallback: bool = True,
                log: Callable[[str], None] = print) -> Optional[str]:
    """The newest verified checkpoint under `ckpt_root` (collective), or None when there is none.

    A damaged newer one is reported in one line and renamed to `step_N.damaged` (fallback), or
    refused with CheckpointError (fallback=False). A complete `step_N` that `latest` does not
    name (a crash after its rename) is adopted and `latest` rewritten.
    """
    names = broadcast(step_dirs(ckpt_root) if groups.rank == 0 else None, groups)
    foreign = broadcast(other_runs(ckpt_root, names) if groups.rank == 0 else None, groups)
    names = [n for n in names if n not in dict(foreign)]
    damaged = []
    for name in names:
        path = os.path.join(ckpt_root, name)
        problems = verify(path, groups)
        if not problems:
            break
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        damaged.append((name, f"checkpoint {path} is damaged: {problems[0]}{more}"))
        if not fallback:
            raise CheckpointError(f"{damaged[-1][1]}; resume with checkpoint fallback enabled "
                                  "to use the previous intact checkpoint, or delete it")
    else:
        if damaged:
            raise CheckpointError(f"{damaged[0][1]}, and no earlier intact checkpoint exists in "
                                  f"{ckpt_root}; delete the damaged step_* directories to start "
                                  "fresh")
        return None
    chosen = os.path.join(ckpt_root, name)

    def settle():  # rank 0: set the damaged aside, point `latest` at the chosen one
        if groups.rank != 0:
            return
        for other, line in foreign:
            aside = os.path.join(ckpt_root, other + ".other-run")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(os.path.join(ckpt_root, other), aside)
            log(f"[megaprm] {line}; moved to {other}.other-run, not adopted")
        for bad, line in damaged:
            aside = os.path.join(ckpt_root, bad + ".damaged")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(os.path.join(ckpt_root, bad), aside)
            log(f"[megaprm] {line}; moved to {bad}.damaged, using {name}")
        pointer = read_latest(ckpt_root)
        if pointer != name:
            if not damaged:
                log(f"[megaprm] adopting {chosen}: `latest` named {pointer!r} (a save was "
                    "interrupted after its checkpoint was complete)")
            write_latest(ckpt_root, name)

    _, failures = agreed(groups, settle)
    if failures:
        raise CheckpointError(f"cannot update {ckpt_root} before resuming: {failures[0][2]}")
    return chosen


def other_runs(ckpt_root: str, names: list) -> list:
    """[(name, why)] of the `step_N` newer than the one `latest` names that another run wrote
    (another run id or config digest): leftovers of an earlier run in a reused directory, never
    'a save interrupted after its checkpoint was complete'. Rank 0; only manifest-checked
    trainer.json files are read. Without an intact `latest` target nothing is judged."""
    pointer = read_latest(ckpt_root)
    if not STEP_DIR.match(pointer or "") or pointer not in names:
        return []
    anchor, problem = verified_trainer_json(os.path.join(ckpt_root, pointer))
    if problem:
        return []
    out = []
    for name in names:
        if step_of(name) <= step_of(pointer):
            break
        state, problem = verified_trainer_json(os.path.join(ckpt_root, name))
        if problem is None and identity(state) != identity(anchor):
            run, digest = identity(state)
            out.append((name, f"checkpoint {os.path.join(ckpt_root, name)} is newer than "
                              f"`latest` ({pointer}) but was written by another run (run id "
                              f"{run}, config {digest}; {pointer}: run id {identity(anchor)[0]}, "
                              f"config {identity(anchor)[1]})"))
    return out


def _read_trainer_json(path: str) -> dict:
    tpath = os.path.join(path, TRAINER_FILE)
    try:
        with open(tpath, encoding="utf-8") as f:
            state = json.load(f)
        missing = [k for k in ("step", "world_size", "tp", "pp") if k not in state]
        if missing:
            raise KeyError(f"no {missing}")
        return state
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{tpath} is unreadable ({one_line(e)}); delete {path} to resume "
                              "from the checkpoint before it") from None


def _load_models(path: str, models: dict) -> None:
    from megatron.core import dist_checkpointing  # deferred: megatron's import is seconds

    for key, model in models.items():
        m = unwrap(model)
        d = os.path.join(path, key, layout.MODEL_SUBDIR)
        if not os.path.isdir(d):
            raise CheckpointError(f"{path} holds no {key!r} model ({d} is missing)")
        loaded = dist_checkpointing.load(stages.sharded_state_dict(m), d)
        result = m.load_state_dict(loaded, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"{d} lacks {len(missing)} weight(s): {missing[:10]}")


def _check_layout_and_config(path: str, state: dict, groups: Groups, config: Optional[dict],
                             allow_config_change: bool) -> None:
    written = (state["world_size"], state["tp"], state["pp"])
    if written != (groups.world_size, groups.tp_size, groups.pp_size):
        raise CheckpointError(
            f"{path} was written with (world, tp, pp) = {written} but this run has "
            f"{(groups.world_size, groups.tp_size, groups.pp_size)}; resume with the same "
            "layout (or convert the weights with checkpoint_tools and start a new run)")
    if config is not None and not allow_config_change:
        stored = state.get("config_digest")
        if stored is None:
            raise CheckpointError(f"{path} holds no config digest (written by an older megaprm); "
                                  "allow a config change to resume from it anyway")
        if stored != config_digest(config):
            diff = config_diff(state.get("config") or {}, config)
            shown = "; ".join(diff[:6]) + (f"; +{len(diff) - 6} more" if len(diff) > 6 else "")
            raise CheckpointError(
                f"{path} was written with another config ({shown}); use a new run directory, "
                "or allow a config change to resume from it anyway")


def load(ckpt_root: str, groups: Groups, *, models: dict, optimizers: dict,
         config: Optional[dict] = None, fallback: bool = True, allow_config_change: bool = False,
         log: Callable[[str], None] = print) -> Optional[dict]:
    """Resume from the newest intact checkpoint under `ckpt_root` (collective), or from
    `ckpt_root` itself when it is one `step_N` directory (verified, no fallback).

    Returns None when there is no checkpoint, else trainer.json's dict plus "path". Raises
    CheckpointError (every rank, same line) when: the checkpoint is damaged and fallback=False
    (or no intact one is left); world/tp/pp differ; `config`'s digest differs from the stored
    one (the differing keys are named) and not allow_config_change; loading fails.
    """
    if os.path.isfile(os.path.join(ckpt_root, TRAINER_FILE)):  # one given step_N: no fallback
        path = ckpt_root
        problems = verify(path, groups)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}")
    else:
        path = find_intact(ckpt_root, groups, fallback=fallback, log=log)
    if path is None:
        return None
    state, failures = agreed(groups, lambda: _read_trainer_json(path))
    if failures:
        raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))
    _check_layout_and_config(path, state, groups, config, allow_config_change)

    def restore():
        _load_models(path, models)
        blob = torch.load(os.path.join(path, f"rank_{groups.rank:05d}.pt"), weights_only=False)
        for key, opt in optimizers.items():
            opt.load_state_dict(blob["optimizers"][key])
        set_rng_state(blob["rng"])

    _, failures = agreed(groups, restore)
    if failures:
        rank, _, text = failures[0]
        raise CheckpointError(f"loading {path} failed on rank {rank}: "
                              f"{text.removeprefix('CheckpointError: ')}")
    return {**state, "path": path}

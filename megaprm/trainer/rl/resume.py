"""Checkpointing: what a checkpoint of an RL run holds (the models in `CheckpointParts`: actor,
PRIME's PRM; the run's position in `TrainState`: step, data position, refill queue), saving it,
resuming from the newest intact one, and the run directory's lock. Every function takes the
parts it reads, never the trainer."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from megaprm.config import Config
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree
from megaprm.trainer.checkpoint.load import load
from megaprm.trainer.checkpoint.save import SideFiles
from megaprm.trainer.checkpoint.save import save as save_checkpoint
from megaprm.trainer.checkpoint.run_dir import refuse_lost_checkpoints
from megaprm.trainer.checkpoint.store import CheckpointError, agreed
from megaprm.trainer.rl.policy import Policy
from megaprm.trainer.run_config import LOCK_ENV
from megaprm.trainer.run_lock import RunLock, RunLockError


@dataclass(frozen=True)
class TrainState:
    """The run's position besides the models, one value (replaced, never mutated): what a
    checkpoint's trainer.json keeps and `maybe_resume` restores.

    `step`: the next step to run (a checkpoint of this state is `step_{step - 1}`, the last step
    done); `next_block`: the next unused prompt block (block b = the b-th batch of
    `data.prompts_per_step` prompts: without refill step s uses block s, with refill one block
    per generation round); `requeue`: this rank's global prompt ids to generate again first
    (`rollout.refill_surplus=requeue`); `skipped_steps`: steps every rank skipped on a
    non-finite reward; `run_id`: the run that writes the checkpoints (a resume keeps the
    checkpoint's); `last_row`: the metrics row of the last step logged (a checkpoint keeps it,
    restored on resume where a full disk tore it)."""

    run_id: str
    step: int = 0
    next_block: int = 0
    requeue: Tuple[int, ...] = ()
    skipped_steps: int = 0
    last_row: Optional[dict] = None


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint holds besides the TrainState, by key ("actor", PRIME's "prm"): the
    models, their optimisers and their `model_source` sources (whose HF side files make each
    key a checkpoint_tools checkpoint)."""

    models: dict
    optimizers: dict
    sources: dict


def checkpoint_parts(actor: Policy, implicit: Optional[Policy] = None) -> CheckpointParts:
    """The actor's model, optimiser and source, and PRIME's implicit PRM's (trained, so saved)
    when there is one."""
    models, optims, sources = {"actor": actor.model}, {"actor": actor.opt}, {"actor": actor.src}
    if implicit is not None:
        models["prm"], optims["prm"], sources["prm"] = implicit.model, implicit.opt, implicit.src
    return CheckpointParts(models, optims, sources)


def save(cfg: Config, groups: Groups, state: TrainState, parts: CheckpointParts,
         digest_fields: dict, crash_after_models: bool = False) -> str:
    """Checkpoint `step_{state.step - 1}` of `parts` and `state` under the run's checkpoints/
    (collective); `digest_fields`: the config a resume must match. Returns its path."""
    assert state.step >= 1, f"a checkpoint is of a step done; state.step={state.step}"
    return save_checkpoint(
        checkpoints_dir(cfg), state.step - 1, groups, models=parts.models,
        optimizers=parts.optimizers,
        sources={k: SideFiles(src.hf_dir, cfg.model.dtype) for k, src in parts.sources.items()},
        trainer_state={"next_step": state.step, "skipped_steps": state.skipped_steps,
                       "next_block": state.next_block, "run_id": state.run_id,
                       # the step's metrics row: restored on resume when a full disk tore it
                       "metrics_row": state.last_row,
                       **_requeue_state(cfg, groups, state.requeue)},
        config=digest_fields, keep_last=cfg.trainer.keep_last,
        crash_after_models=crash_after_models)


def _requeue_state(cfg: Config, groups: Groups, requeue: Tuple[int, ...]) -> dict:
    """{"requeue": {dp rank: prompt ids}} for the checkpoint (rank 0 writes it; every rank's
    list is gathered first), or {} without rollout.refill_surplus=requeue."""
    if cfg.rollout.refill_surplus != "requeue":
        return {}
    lists = [list(requeue)]
    if groups.world_size > 1:
        import torch.distributed as dist

        lists = [None] * groups.world_size
        dist.all_gather_object(lists, (groups.dp_rank, list(requeue)), group=groups.agree)
        return {"requeue": {str(r): q for r, q in lists}}
    return {"requeue": {"0": lists[0]}}


def maybe_resume(cfg: Config, groups: Groups, state: TrainState, parts: CheckpointParts,
                 digest_fields: dict) -> TrainState:
    """The newest intact checkpoint's state, its models and optimisers loaded into `parts` (a
    damaged one is reported and skipped; refused when the layout or the digested config
    differ), or `state` unchanged on a fresh start (trainer.resume off, or no checkpoint)."""
    if not cfg.trainer.resume:
        return state
    loaded = load(checkpoints_dir(cfg), groups, models=parts.models, optimizers=parts.optimizers,
                  config=digest_fields,
                  fallback=cfg.trainer.resume_fallback,
                  allow_config_change=cfg.trainer.allow_config_change,
                  log=print if groups.rank == 0 else (lambda _m: None))
    if loaded is None:  # a fresh start: never over a run whose checkpoints were removed
        steps, every = cfg.trainer.steps, cfg.trainer.save_every
        _, failures = agreed(groups, lambda: groups.rank != 0 or refuse_lost_checkpoints(
            cfg.trainer.run_dir, steps, every))
        if failures:
            raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))
        return state
    if groups.rank == 0:
        print(f"[megaprm] resumed from {loaded['path']} (next step {loaded['next_step']})",
              flush=True)
    return TrainState(
        run_id=loaded.get("run_id") or state.run_id, step=loaded["next_step"],
        next_block=loaded.get("next_block", loaded["next_step"]),
        requeue=tuple(loaded.get("requeue", {}).get(str(groups.dp_rank), [])),
        skipped_steps=loaded.get("skipped_steps", 0), last_row=loaded.get("metrics_row"))


def checkpoints_dir(cfg: Config) -> str:
    return os.path.join(cfg.trainer.run_dir, "checkpoints")


def lock_run_dir(run_dir: str, groups: Groups):
    """One run per run directory. The launcher (megaprm train) holds the lock for its ranks;
    started any other way (a hand-written torchrun, tests), global rank 0 takes it here and every
    rank learns the outcome, so a refused start stops all ranks with the same line."""
    lock, err = None, None
    if groups.rank == 0 and os.environ.get(LOCK_ENV) != os.path.abspath(run_dir):
        try:
            lock = RunLock(run_dir).acquire()
        except RunLockError as e:
            err = str(e)
    err = agree(err, groups)
    if err is not None:
        if lock is not None:
            lock.release()
        raise CheckpointError(err.split(": ", 1)[-1])
    return lock



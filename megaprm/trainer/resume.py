"""Checkpointing: what a checkpoint of an RL run holds (actor, PRIME's PRM, the data position
and refill queue), saving it, resuming from the newest intact one, and the run directory's
lock."""
from __future__ import annotations

import os

from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree
from megaprm.trainer.checkpoint.load import load
from megaprm.trainer.checkpoint.save import SideFiles
from megaprm.trainer.checkpoint.save import save as save_checkpoint
from megaprm.trainer.checkpoint.run_dir import refuse_lost_checkpoints
from megaprm.trainer.checkpoint.store import CheckpointError, agreed
from megaprm.trainer.run_config import LOCK_ENV
from megaprm.trainer.run_lock import RunLock, RunLockError


def ckpt_parts(tr):
    models = {"actor": tr.actor.model}
    optims = {"actor": tr.actor.opt}
    sources = {"actor": tr.src}
    if tr.implicit is not None:
        models["prm"], optims["prm"] = tr.implicit.model, tr.implicit.opt
        sources["prm"] = tr.implicit.src
    return models, optims, sources

def save(tr, step: int, crash_after_models: bool = False) -> str:
    models, optims, sources = ckpt_parts(tr)
    dtype = tr.cfg.model.dtype
    return save_checkpoint(
        tr.ckpt_root, step, tr.groups, models=models, optimizers=optims,
        sources={k: SideFiles(src.hf_dir, dtype) for k, src in sources.items()},
        trainer_state={"next_step": step + 1, "skipped_steps": tr.skipped_steps,
                       "next_block": tr.next_block, "run_id": tr.run_id,
                       # the step's metrics row: restored on resume when a full disk tore it
                       "metrics_row": tr.last_row,
                       **_requeue_state(tr)},
        config=tr.digest_fields, keep_last=tr.cfg.trainer.keep_last,
        crash_after_models=crash_after_models)

def _requeue_state(tr) -> dict:
    """{"requeue": {dp rank: prompt ids}} for the checkpoint (rank 0 writes it; every rank's
    list is gathered first), or {} without rollout.refill_surplus=requeue."""
    if tr.cfg.rollout.refill_surplus != "requeue":
        return {}
    lists = [tr.requeue]
    if tr.groups.world_size > 1:
        import torch.distributed as dist

        lists = [None] * tr.groups.world_size
        dist.all_gather_object(lists, (tr.groups.dp_rank, tr.requeue),
                               group=tr.groups.agree)
        return {"requeue": {str(r): q for r, q in lists}}
    return {"requeue": {"0": lists[0]}}

def maybe_resume(tr) -> int:
    """Resume from the newest intact checkpoint (a damaged one is reported and skipped);
    refused when the layout or the digested config differ."""
    if not tr.cfg.trainer.resume:
        return 0
    models, optims, _ = ckpt_parts(tr)
    state = load(tr.ckpt_root, tr.groups, models=models, optimizers=optims,
                 config=tr.digest_fields,
                 fallback=tr.cfg.trainer.resume_fallback,
                 allow_config_change=tr.cfg.trainer.allow_config_change,
                 log=print if tr.groups.rank == 0 else (lambda _m: None))
    if state is None:  # a fresh start: never over a run whose checkpoints were removed
        steps, every = tr.cfg.trainer.steps, tr.cfg.trainer.save_every
        _, failures = agreed(tr.groups, lambda: tr.groups.rank != 0 or refuse_lost_checkpoints(
            tr.cfg.trainer.run_dir, steps, every))
        if failures:
            raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))
        return 0
    tr.skipped_steps = state.get("skipped_steps", 0)
    tr.run_id = state.get("run_id") or tr.run_id
    tr.next_block = state.get("next_block", state["next_step"])
    tr.requeue = list(state.get("requeue", {}).get(str(tr.groups.dp_rank), []))
    tr.logger.truncate_after(state["step"], state.get("metrics_row"))
    tr.sync_weights()
    if tr.groups.rank == 0:
        print(f"[megaprm] resumed from {state['path']} (next step {state['next_step']})",
              flush=True)
    return state["next_step"]

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



"""Save / resume with megatron-core dist_checkpointing, atomically.

Layout of `run_dir/checkpoints/`:

    step_000004/            one complete checkpoint
      actor/                dist_checkpointing of the actor (loadable at any tp/pp)
      prm/                  dist_checkpointing of an online-updated PRM (PRIME), if any
      rank_00000.pt         this rank's optimiser state(s), RNG states
      trainer.json          step, data position, config digest
    latest                  text file naming the newest complete checkpoint

A checkpoint is written into `step_N.tmp/`; after every rank finished, rank 0 renames it to
`step_N/` and then rewrites `latest` (write + os.replace). A crash at any point leaves `latest`
naming the previous complete checkpoint; stale `.tmp` directories are removed on the next save.
Optimiser states are per rank, so a resume must use the same tp/pp/dp layout (the model
weights themselves reshard freely through dist_checkpointing).
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megaprm.parallel.groups import Groups


class CheckpointError(RuntimeError):
    pass


def _barrier(groups: Groups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    pointer = os.path.join(ckpt_root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(ckpt_root, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{pointer} names {name!r}, which does not exist; delete the "
                              "pointer to start fresh or restore the directory")
    return path


def save(ckpt_root: str, step: int, groups: Groups, *, models: dict, optimizers: dict,
         trainer_state: dict, crash_after_models: bool = False) -> str:
    """Write checkpoint `step` for all ranks (collective). Returns the final directory."""
    from megatron.core import dist_checkpointing

    name = f"step_{step:06d}"
    final = os.path.join(ckpt_root, name)
    tmp = final + ".tmp"
    if groups.rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        for entry in os.listdir(ckpt_root):  # leftovers of an interrupted save
            if entry.endswith(".tmp"):
                shutil.rmtree(os.path.join(ckpt_root, entry), ignore_errors=True)
        os.makedirs(tmp)
        for key in models:
            os.makedirs(os.path.join(tmp, key))
    _barrier(groups)
    for key, model in models.items():
        dist_checkpointing.save(_unwrap(model).sharded_state_dict(), os.path.join(tmp, key))
    if crash_after_models:  # fault injection for the kill-during-save test
        os._exit(17)
    torch.save({"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "rng": rng_state()}, os.path.join(tmp, f"rank_{groups.rank:05d}.pt"))
    _barrier(groups)
    if groups.rank == 0:
        with open(os.path.join(tmp, "trainer.json"), "w", encoding="utf-8") as f:
            json.dump({**trainer_state, "step": step, "world_size": groups.world_size,
                       "tp": groups.tp_size, "pp": groups.pp_size}, f, indent=2)
        os.replace(tmp, final)
        with open(os.path.join(ckpt_root, "latest.tmp"), "w", encoding="utf-8") as f:
            f.write(name)
        os.replace(os.path.join(ckpt_root, "latest.tmp"), os.path.join(ckpt_root, "latest"))
    _barrier(groups)
    return final


def load(path: str, groups: Groups, *, models: dict, optimizers: dict) -> dict:
    """Restore models, optimisers and RNG from `path` (collective); returns trainer state."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "trainer.json"), encoding="utf-8") as f:
        state = json.load(f)
    layout = (state["world_size"], state["tp"], state["pp"])
    if layout != (groups.world_size, groups.tp_size, groups.pp_size):
        raise CheckpointError(
            f"{path} was written with (world, tp, pp) = {layout} but this run has "
            f"{(groups.world_size, groups.tp_size, groups.pp_size)}; resume with the same "
            "layout (or convert the weights with checkpoint_tools and start a new run)")
    for key, model in models.items():
        m = _unwrap(model)
        loaded = dist_checkpointing.load(m.sharded_state_dict(), os.path.join(path, key))
        result = m.load_state_dict(loaded, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"{path}/{key} lacks {len(missing)} weight(s): {missing[:10]}")
    blob = torch.load(os.path.join(path, f"rank_{groups.rank:05d}.pt"), weights_only=False)
    for key, opt in optimizers.items():
        opt.load_state_dict(blob["optimizers"][key])
    set_rng_state(blob["rng"])
    return state

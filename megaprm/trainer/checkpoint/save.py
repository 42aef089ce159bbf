"""Writing step checkpoint N in phases that every rank agrees on: finite weights, a fresh
`step_N.tmp/`, the models (dist_checkpointing), the rank files, trainer.json, the MANIFEST, the
rename into place (package docstring: the layout and the failure rules)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from checkpoint_tools import layout, stages
from checkpoint_tools import manifest as manifest_file
from checkpoint_tools.megatron_io import in_process_write_queue
from megaprm.parallel.groups import Groups
from megaprm.parallel.pipeline import unwrap
from megaprm.parallel.rng import rng_state
from megaprm.trainer.checkpoint.store import (
    FORMAT,
    TRAINER_FILE,
    VERSION,
    CheckpointError,
    agreed,
    any_rank,
    barrier,
    broadcast,
    fsync_dir,
    gather,
    one_line,
    prune,
    remove_leftovers,
    step_dirs,
    step_name,
    write_json,
    write_latest,
)
from megaprm.trainer.run_config import config_digest


@dataclass(frozen=True)
class SideFiles:
    """Where a saved model's HF side files come from: an HF directory (or the `hf/` folder of a
    checkpoint_tools checkpoint) holding config.json + tokenizer files; `dtype` (fp32|bf16|fp16)
    is what the stored weights are, as checkpoint_tools records it."""

    hf_dir: str
    dtype: str = "fp32"


@dataclass(frozen=True)
class _Target:
    """Where step N goes: written into `tmp`, renamed to `final` once complete."""

    root: str
    name: str

    @property
    def final(self) -> str:
        return os.path.join(self.root, self.name)

    @property
    def tmp(self) -> str:
        return self.final + ".tmp"


# ------------------------------------------------------------------------------- sizes, checks

def _nonfinite(models: dict) -> Optional[str]:
    for key, model in models.items():
        for name, p in unwrap(model).named_parameters():
            if not torch.isfinite(p.detach()).all():
                return f"{key} parameter {name}"
    return None


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _bytes_needed(ckpt_root: str, groups: Groups, models: dict, optimizers: dict) -> int:
    """Estimated size of one checkpoint (collective): the previous checkpoint's manifest total,
    or the weights (one dp replica) plus every rank's optimiser state."""
    local = sum(_tensor_bytes(o.state_dict()) for o in optimizers.values())
    if groups.dp_rank == 0:
        local += sum(p.numel() * p.element_size() for m in models.values()
                     for p in unwrap(m).parameters())
    estimate = sum(gather(local, groups))
    previous = 0
    if groups.rank == 0:
        for name in step_dirs(ckpt_root):
            manifest, _ = manifest_file.read(os.path.join(ckpt_root, name))
            if manifest:
                previous = int(manifest.get("total_bytes", 0))
                break
    return max(estimate, broadcast(previous, groups))


def _mb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _refuse_nonfinite(target: _Target, models: dict, groups: Groups) -> None:
    bad = [b for b in gather(_nonfinite(models), groups) if b is not None]
    if bad:
        kept = (step_dirs(target.root) or ["none"])[0]
        raise CheckpointError(
            f"not saving checkpoint {target.name}: {bad[0]} holds NaN/inf (on {len(bad)} "
            f"rank(s)); the newest checkpoint stays {kept} (lower the learning rate or check "
            "the rewards)")


def _raise_failed(target: _Target, groups: Groups, models: dict, optimizers: dict,
                  failures: list) -> None:
    """A phase failed on some rank: remove `step_N.tmp` and raise one line on every rank."""
    ckpt_root = target.root
    # Some writers hide ENOSPC behind their own errors: a nearly full disk tells (measured
    # on every rank before the partial checkpoint is removed).
    try:
        free_now = shutil.disk_usage(ckpt_root).free
    except OSError:
        free_now = -1
    if any_rank(0 <= free_now < 1 << 20, groups):
        failures = [(r, errno.ENOSPC, t) for r, _, t in failures]
    barrier(groups)
    if groups.rank == 0:
        shutil.rmtree(target.tmp, ignore_errors=True)
    prev = (step_dirs(ckpt_root) or [None])[0] if os.path.isdir(ckpt_root) else None
    kept = f"the previous checkpoint {os.path.join(ckpt_root, prev)} is intact" if prev \
        else "no earlier checkpoint exists"
    nospace = [f for f in failures if f[1] == errno.ENOSPC]
    if nospace:
        need = _bytes_needed(ckpt_root, groups, models, optimizers)
        free = shutil.disk_usage(ckpt_root).free if os.path.isdir(ckpt_root) else 0
        raise CheckpointError(
            f"saving checkpoint {target.final}: no space left on device (rank {nospace[0][0]}); "
            f"a checkpoint needs about {_mb(need)}, {_mb(free)} is free there; free space "
            f"or point the checkpoint directory at a larger disk ({kept})")
    rank, _, text = failures[0]
    raise CheckpointError(f"saving checkpoint {target.final} failed on rank {rank}: {text} "
                          f"({kept})")


# ------------------------------------------------------------------------- the writing phases

def _prepare(target: _Target, models: dict, sources: dict, groups: Groups) -> None:
    """Rank 0: clean leftovers, create the tmp tree with each model's hf/ + meta files."""
    if groups.rank != 0:
        return
    os.makedirs(target.root, exist_ok=True)
    remove_leftovers(target.root)
    os.makedirs(target.tmp)
    for key in models:
        os.makedirs(os.path.join(target.tmp, key, layout.MODEL_SUBDIR))
    for key, src in sources.items():
        layout.copy_side_files(src.hf_dir, os.path.join(target.tmp, key, layout.HF_SUBDIR))
        with open(os.path.join(src.hf_dir, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or ["unknown"]
        layout.CheckpointMeta(format=layout.FORMAT, version=1, architecture=archs[0],
                              dtype=src.dtype, tp=groups.tp_size, pp=groups.pp_size,
                              source=os.path.abspath(src.hf_dir)).write(
                                  os.path.join(target.tmp, key))


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG); if the parent is
    already gone (it died before the signal was armed), exit now."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


# dist_checkpointing writes through forked worker processes; a rank killed mid-save (SIGKILL,
# os._exit) left them orphaned, some hung for good, holding the rank's stdout open. Children
# forked while a save runs get a parent-death signal (only then: a child forked by a
# short-lived thread would die with that thread).
_saving_pid = 0


def _arm_forked_child() -> None:
    if _saving_pid:
        _die_with_parent(_saving_pid)


if sys.platform.startswith("linux"):
    os.register_at_fork(after_in_child=_arm_forked_child)


@contextlib.contextmanager
def writers_die_with_this_process():
    """Around `dist_checkpointing.save`: its forked writer processes get a parent-death signal,
    and its result queue is an in-process one (megatron_io.in_process_write_queue) instead of a
    spawned Manager server, which outlived a rank killed by SIGKILL/os._exit. So a rank killed
    mid-save leaves no orphan (and a save costs no extra interpreter)."""
    global _saving_pid
    _saving_pid = os.getpid()
    try:
        with in_process_write_queue():
            yield
    finally:
        _saving_pid = 0


def _save_models(tmp: str, models: dict) -> None:
    from megatron.core import dist_checkpointing  # deferred: megatron's import is seconds

    with writers_die_with_this_process():
        for key, model in models.items():
            dist_checkpointing.save(stages.sharded_state_dict(unwrap(model)),
                                    os.path.join(tmp, key, layout.MODEL_SUBDIR))


def _write_rank_file(tmp: str, groups: Groups, optimizers: dict) -> None:
    blob = {"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
            "rng": rng_state()}
    # Through our own file object: torch's zip writer turns a path's write errors into
    # "unexpected pos" riddles; a Python file keeps the OSError (ENOSPC) as the context.
    with open(os.path.join(tmp, f"rank_{groups.rank:05d}.pt"), "wb") as f:
        torch.save(blob, f)


def _write_trainer_json(tmp: str, step: int, groups: Groups, models: dict,
                        trainer_state: dict, config: Optional[dict]) -> list:
    """Rank 0: trainer.json; returns every file of the step for the manifest."""
    state = {**trainer_state, "format": FORMAT, "version": VERSION, "step": step,
             "world_size": groups.world_size, "tp": groups.tp_size, "pp": groups.pp_size,
             "dp": groups.dp_size, "models": sorted(models)}
    if config is not None:
        state["config_digest"] = config_digest(config)
        state["config"] = config
    write_json(os.path.join(tmp, TRAINER_FILE), state)
    return manifest_file.listing(tmp)


def _commit(target: _Target, groups: Groups, crash_at: Optional[str]) -> None:
    """Rank 0: rename `step_N.tmp` into place (an older `step_N` set aside first), then point
    `latest` at it."""
    if groups.rank != 0:
        return
    if os.path.exists(target.final):  # a damaged or superseded step_N of an earlier attempt
        os.rename(target.final, target.final + ".old.tmp")
    os.rename(target.tmp, target.final)
    fsync_dir(target.root)
    if crash_at == "after_rename":
        os._exit(17)
    write_latest(target.root, target.name)
    shutil.rmtree(target.final + ".old.tmp", ignore_errors=True)


def save(ckpt_root: str, step: int, groups: Groups, *, models: dict, optimizers: dict,
         trainer_state: dict, sources: Optional[dict] = None, config: Optional[dict] = None,
         keep_last: int = 0, crash_at: Optional[str] = None, crash_after_models: bool = False,
         log: Callable[[str], None] = print) -> str:
    """Write checkpoint `step` (collective; every rank calls it). Returns `ckpt_root/step_N`.

    models / optimizers: key ("actor", "prm") -> model (DDP-wrapped or not) / optimiser with
    state_dict(); sources: key -> SideFiles, whose HF side files make `step_N/<key>/` a
    checkpoint_tools checkpoint (`export-hf`; a key without one gets no hf/); trainer_state:
    JSON-able (next_step, skipped_steps, ...); config: the sub-config whose digest a resume must
    match; keep_last: keep that many newest checkpoints (0 = all). Raises CheckpointError (on
    every rank, same one line) when the weights are non-finite or a write fails (ENOSPC
    included); the previous checkpoint is intact then and no partial `step_N.tmp` stays behind.
    crash_at in ("after_models", "after_rename") kills the process there (fault tests only).
    """
    sources = sources or {}
    if not set(sources) <= set(models):
        raise AssertionError(f"sources {sorted(sources)} name models not in {sorted(models)}")
    target = _Target(ckpt_root, step_name(step))
    tmp = target.tmp
    crash_at = "after_models" if crash_after_models else crash_at
    _refuse_nonfinite(target, models, groups)

    def phase(fn: Callable[[], object]):
        """Run one phase on every rank; any rank's failure fails the save on all of them.
        Collectives only between phases: a phase that raises on one rank must not leave
        another rank waiting inside a collective."""
        result, failures = agreed(groups, fn)
        if failures:
            _raise_failed(target, groups, models, optimizers, failures)
        return result

    phase(lambda: _prepare(target, models, sources, groups))
    phase(lambda: _save_models(tmp, models))
    if crash_at == "after_models":
        os._exit(17)
    phase(lambda: _write_rank_file(tmp, groups, optimizers))
    files = phase(lambda: _write_trainer_json(tmp, step, groups, models, trainer_state, config)
                  if groups.rank == 0 else None)
    files = broadcast(files, groups)
    mine = phase(lambda: manifest_file.entries(tmp, files[groups.rank::groups.world_size]))
    merged = {}
    for part in gather(mine, groups):
        merged.update(part)
    phase(lambda: groups.rank == 0 and manifest_file.write(
        tmp, merged, format=FORMAT, version=VERSION, step=step))
    phase(lambda: _commit(target, groups, crash_at))
    if groups.rank == 0 and keep_last > 0:
        try:
            prune(ckpt_root, keep_last, target.name)
        except OSError as e:  # a prune failure must not stop training
            log(f"[megaprm] could not prune old checkpoints in {ckpt_root}: {one_line(e)}")
    barrier(groups)
    return target.final

"""Trainer checkpoints: atomic, verified, resumable; each model in checkpoint_tools' format.

Layout of `ckpt_root/` (ARCHITECTURE.md "One checkpoint format"):

    step_000004/                 one complete checkpoint
      actor/                     a checkpoint_tools checkpoint of the actor (`export-hf` takes it)
        model/                   dist_checkpointing of the weights (loadable at any tp/pp)
        hf/                      HF side files of the model (config.json, tokenizer, ...)
        megaprm_checkpoint.json  checkpoint_tools.layout.CheckpointMeta
      prm/                       the same for an online-updated PRM (PRIME), if any
      rank_00000.pt              this rank's optimiser state(s) (with Megatron's distributed
                                 optimizer: this rank's shard of fp32 masters and Adam moments,
                                 `pipeline.Optimizer.state_dict`) and RNG states
      trainer.json               step, next_step, skipped_steps, world/tp/pp, config digest
      MANIFEST.json              size + crc32 of every other file; written last
    step_000002.damaged/         a checkpoint that failed verification (kept for inspection)
    latest                       text file naming the newest complete checkpoint (a hint)

Save: every check is agreed by all ranks (an all-reduce of a failure flag), so either every rank
returns or every rank raises the same CheckpointError; none raises while another waits.
  1. weights finite on every rank (non-finite weights are never saved),
  2. rank 0 removes leftovers (`*.tmp`) and creates `step_N.tmp/`,
  3. dist_checkpointing of each model, the rank files, trainer.json,
  4. MANIFEST.json (each rank checksums a share of the files; rank 0 writes it),
  5. rank 0 renames `step_N.tmp` -> `step_N`, rewrites `latest`, prunes to `keep_last`.
A failure in 2-5 (e.g. ENOSPC) removes `step_N.tmp` and raises one line; the previous
checkpoint is untouched. A crash leaves either a `.tmp` (removed by the next save) or a
complete `step_N` that `latest` does not name yet (adopted by the next load).

Load: the newest `step_N` whose MANIFEST verifies is used; a damaged one is reported in one
line, renamed to `step_N.damaged` and the previous intact one is used (or, with
`fallback=False`, the load refuses). Optimiser states are per rank, so a resume needs the same
world/tp/pp; the weights alone reshard freely (checkpoint_tools). A checkpoint written under
another config (digest of the sub-config the trainer passes) is refused, naming the keys.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from checkpoint_tools import manifest as manifest_file
from megaprm.parallel.groups import Groups

MANIFEST = manifest_file.MANIFEST  # one name for import-hf checkpoints and trainer steps
TRAINER_FILE = "trainer.json"
LATEST = "latest"
FORMAT = "megaprm-trainer-checkpoint"
VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint problem the user can act on; the message is one line."""


@dataclass(frozen=True)
class ModelSource:
    """Where a saved model's HF side files come from: an HF directory (or the `hf/` folder of a
    checkpoint_tools checkpoint) holding config.json + tokenizer files; `dtype` (fp32|bf16|fp16)
    is what the stored weights are, as checkpoint_tools records it."""

    hf_dir: str
    dtype: str = "fp32"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------ config digest

def config_digest(config: dict) -> str:
    """sha256 (16 hex) of a JSON-able config dict, independent of key order."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _flatten(d, prefix=""):
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_diff(old: dict, new: dict) -> list:
    """['advantage.method: prof_grpo -> grpo', ...] for every dotted key that differs."""
    a, b = _flatten(json.loads(json.dumps(old, default=str))), _flatten(
        json.loads(json.dumps(new, default=str)))
    missing = object()
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


# ---------------------------------------------------------------------------------- agreement

def _flag_device(groups: Groups) -> str:
    return "cuda" if groups.backend == "nccl" else "cpu"


def _any_rank(flag: bool, groups: Groups) -> bool:
    if groups.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device(groups))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _gather(obj, groups: Groups) -> list:
    if groups.world_size == 1:
        return [obj]
    out = [None] * groups.world_size
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj, groups: Groups):
    if groups.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or repr(e)
    return f"{type(e).__name__}: {text[:400]}"


def _errno(e: BaseException) -> Optional[int]:
    """The OS error number of `e` or of an error it wraps (dist_checkpointing wraps writes)."""
    seen = 0
    while e is not None and seen < 10:
        if getattr(e, "errno", None):
            return e.errno
        if "No space left on device" in str(e):
            return errno.ENOSPC
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _agreed(groups: Groups, fn: Callable[[], object]):
    """Run `fn` on every rank. Returns (result, failures): failures is [] on every rank when all
    succeeded, else the same list of (rank, errno, one-line text) on every rank."""
    err = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised as one line
        err = (groups.rank, _errno(e), _one_line(e))
    if not _any_rank(err is not None, groups):
        return result, []
    return result, [e for e in _gather(err, groups) if e is not None]


def _barrier(groups: Groups) -> None:
    if groups.world_size > 1:
        dist.barrier()


# ------------------------------------------------------------------------------------ manifest

def _files(root: str) -> list:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _checksum(root: str, files: list, groups: Groups) -> dict:
    """rel -> [size, crc32] of this rank's share (1/world) of `files`. No collective."""
    mine = {}
    for rel in files[groups.rank::groups.world_size]:
        path = os.path.join(root, rel)
        mine[rel] = [os.path.getsize(path), manifest_file.crc32(path)]
    return mine


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(path: str) -> tuple:
    """(manifest dict or None, problem or None), read on one rank."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return None, f"no {MANIFEST} (an incomplete save, or written by an older megaprm)"
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        assert isinstance(files, dict) and files, "no files listed"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as e:
        return None, f"{MANIFEST} is unreadable ({_one_line(e)})"
    return manifest, None


def verified_trainer_json(path: str) -> tuple:
    """(trainer.json of checkpoint `path`, None) when that file matches the MANIFEST, else
    (None, problem). Single process; reads and checksums only that one file (cheap), so a
    launcher can look at a checkpoint without trusting unverified bytes."""
    manifest, problem = _read_manifest(path)
    if problem:
        return None, problem
    tpath = os.path.join(path, TRAINER_FILE)
    try:
        size, crc = manifest["files"][TRAINER_FILE]
        with open(tpath, "rb") as f:
            data = f.read()
        if len(data) != size or f"{zlib.crc32(data):08x}" != crc:
            return None, f"{TRAINER_FILE} does not match {MANIFEST} (torn or edited)"
        state = json.loads(data)
        if not isinstance(state, dict):
            raise TypeError("not a JSON object")
        return state, None
    except (OSError, KeyError, ValueError, TypeError) as e:
        return None, f"{TRAINER_FILE} cannot be checked ({_one_line(e)})"


def _identity(state: Optional[dict]) -> tuple:
    """Which run wrote a checkpoint: (run id, config digest); a save adopted after a crash must
    come from the run that `latest` names."""
    state = state or {}
    return state.get("run_id"), state.get("config_digest")


def verify(path: str, groups: Groups) -> list:
    """Problems of checkpoint `path` against its MANIFEST (collective; the same list on every
    rank; [] when intact): missing files, wrong sizes, wrong checksums."""
    manifest, problem = _read_manifest(path) if groups.rank == 0 else (None, None)
    manifest, problem = _broadcast((manifest, problem), groups)
    if problem:
        return [problem]
    files = sorted(manifest["files"])
    mine = [manifest_file.file_problem(os.path.join(path, rel), manifest["files"][rel], rel)
            for rel in files[groups.rank::groups.world_size]]
    mine = [p for p in mine if p]
    if not _any_rank(bool(mine), groups):
        return []
    return sorted(p for part in _gather(mine, groups) for p in part)


# ------------------------------------------------------------------------------------- listing

def step_dirs(ckpt_root: str) -> list:
    """Names of complete-looking `step_N` directories, newest first."""
    if not os.path.isdir(ckpt_root):
        return []
    found = [(int(m.group(1)), e) for e in os.listdir(ckpt_root)
             if (m := _STEP_DIR.match(e)) and os.path.isdir(os.path.join(ckpt_root, e))]
    return [e for _, e in sorted(found, reverse=True)]


def _read_latest(ckpt_root: str) -> Optional[str]:
    try:
        with open(os.path.join(ckpt_root, LATEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _write_latest(ckpt_root: str, name: str) -> None:
    tmp = os.path.join(ckpt_root, LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_root, LATEST))
    _fsync_dir(ckpt_root)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_leftovers(ckpt_root: str) -> None:
    """Leftovers of an interrupted save: `step_N.tmp`, a replaced `step_N.old.tmp`, `latest.tmp`."""
    for entry in os.listdir(ckpt_root):
        if entry.endswith(".tmp"):
            p = os.path.join(ckpt_root, entry)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.remove(p)
                except OSError:
                    pass


def prune(ckpt_root: str, keep_last: int, newest: str) -> list:
    """Delete complete checkpoints older than the `keep_last` newest (rank 0 only). `newest` (just
    saved) is always kept; damaged and newer directories are left alone. Returns the removed."""
    if keep_last <= 0:
        return []
    step_of = {e: int(_STEP_DIR.match(e).group(1)) for e in step_dirs(ckpt_root)}
    older = [e for e in step_dirs(ckpt_root) if step_of[e] <= step_of[newest]]
    removed = []
    for e in older[keep_last:]:
        shutil.rmtree(os.path.join(ckpt_root, e), ignore_errors=True)
        removed.append(e)
    return removed


# ----------------------------------------------------------------------------------------- save

def _nonfinite(models: dict) -> Optional[str]:
    for key, model in models.items():
        for name, p in _unwrap(model).named_parameters():
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
                     for p in _unwrap(m).parameters())
    estimate = sum(_gather(local, groups))
    previous = 0
    if groups.rank == 0:
        for name in step_dirs(ckpt_root):
            manifest, _ = _read_manifest(os.path.join(ckpt_root, name))
            if manifest:
                previous = int(manifest.get("total_bytes", 0))
                break
    return max(estimate, _broadcast(previous, groups))


def _mb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _prepare(ckpt_root: str, tmp: str, models: dict, sources: dict, groups: Groups) -> None:
    """Rank 0: clean leftovers, create the tmp tree with each model's hf/ + meta files."""
    from checkpoint_tools import layout

    if groups.rank != 0:
        return
    os.makedirs(ckpt_root, exist_ok=True)
    _remove_leftovers(ckpt_root)
    os.makedirs(tmp)
    for key in models:
        os.makedirs(os.path.join(tmp, key, layout.MODEL_SUBDIR))
    for key, src in sources.items():
        layout.copy_side_files(src.hf_dir, os.path.join(tmp, key, layout.HF_SUBDIR))
        with open(os.path.join(src.hf_dir, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or ["unknown"]
        layout.CheckpointMeta(format=layout.FORMAT, version=1, architecture=archs[0],
                              dtype=src.dtype, tp=groups.tp_size, pp=groups.pp_size,
                              source=os.path.abspath(src.hf_dir)).write(os.path.join(tmp, key))


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
    and its result queue is an in-process one (checkpoint_tools.convert.in_process_write_queue)
    instead of a spawned Manager server, which outlived a rank killed by SIGKILL/os._exit. So a
    rank killed mid-save leaves no orphan (and a save costs no extra interpreter)."""
    from checkpoint_tools.convert import in_process_write_queue

    global _saving_pid
    _saving_pid = os.getpid()
    try:
        with in_process_write_queue():
            yield
    finally:
        _saving_pid = 0


def _save_models(tmp: str, models: dict) -> None:
    from megatron.core import dist_checkpointing

    from checkpoint_tools import layout, stages

    with writers_die_with_this_process():
        for key, model in models.items():
            dist_checkpointing.save(stages.sharded_state_dict(_unwrap(model)),
                                    os.path.join(tmp, key, layout.MODEL_SUBDIR))


def save(ckpt_root: str, step: int, groups: Groups, *, models: dict, optimizers: dict,
         trainer_state: dict, sources: Optional[dict] = None, config: Optional[dict] = None,
         keep_last: int = 0, crash_at: Optional[str] = None, crash_after_models: bool = False,
         log: Callable[[str], None] = print) -> str:
    """Write checkpoint `step` (collective; every rank calls it). Returns `ckpt_root/step_N`.

    models / optimizers: key ("actor", "prm") -> model (DDP-wrapped or not) / optimiser with
    state_dict(); sources: key -> ModelSource, whose HF side files make `step_N/<key>/` a
    checkpoint_tools checkpoint (`export-hf`; a key without one gets no hf/); trainer_state: JSON-able
    (next_step, skipped_steps, ...); config: the sub-config whose digest a resume must match;
    keep_last: keep that many newest checkpoints (0 = all). Raises CheckpointError (on every
    rank, same one line) when the weights are non-finite or a write fails (ENOSPC included);
    the previous checkpoint is intact then and no partial `step_N.tmp` stays behind.
    crash_at in ("after_models", "after_rename") kills the process there (fault tests only).
    """
    sources = sources or {}
    if not set(sources) <= set(models):
        raise AssertionError(f"sources {sorted(sources)} name models not in {sorted(models)}")
    name = step_name(step)
    final = os.path.join(ckpt_root, name)
    tmp = final + ".tmp"
    crash_at = "after_models" if crash_after_models else crash_at

    bad = [b for b in _gather(_nonfinite(models), groups) if b is not None]
    if bad:
        kept = (step_dirs(ckpt_root) or ["none"])[0]
        raise CheckpointError(
            f"not saving checkpoint {name}: {bad[0]} holds NaN/inf (on {len(bad)} rank(s)); "
            f"the newest checkpoint stays {kept} (lower the learning rate or check the rewards)")

    def fail(failures: list) -> None:
        # Some writers hide ENOSPC behind their own errors: a nearly full disk tells (measured
        # on every rank before the partial checkpoint is removed).
        try:
            free_now = shutil.disk_usage(ckpt_root).free
        except OSError:
            free_now = -1
        full = _any_rank(0 <= free_now < 1 << 20, groups)
        if full:
            failures = [(r, errno.ENOSPC, t) for r, _, t in failures]
        _barrier(groups)
        if groups.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = (step_dirs(ckpt_root) or [None])[0] if os.path.isdir(ckpt_root) else None
        kept = f"the previous checkpoint {os.path.join(ckpt_root, prev)} is intact" if prev \
            else "no earlier checkpoint exists"
        nospace = [f for f in failures if f[1] == errno.ENOSPC]
        if nospace:
            need = _bytes_needed(ckpt_root, groups, models, optimizers)
            free = shutil.disk_usage(ckpt_root).free if os.path.isdir(ckpt_root) else 0
            raise CheckpointError(
                f"saving checkpoint {final}: no space left on device (rank {nospace[0][0]}); "
                f"a checkpoint needs about {_mb(need)}, {_mb(free)} is free there; free space "
                f"or point the checkpoint directory at a larger disk ({kept})")
        rank, _, text = failures[0]
        raise CheckpointError(f"saving checkpoint {final} failed on rank {rank}: {text} ({kept})")

    def rank_file():
        blob = {"optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "rng": rng_state()}
        # Through our own file object: torch's zip writer turns a path's write errors into
        # "unexpected pos" riddles; a Python file keeps the OSError (ENOSPC) as the context.
        with open(os.path.join(tmp, f"rank_{groups.rank:05d}.pt"), "wb") as f:
            torch.save(blob, f)

    for phase, fn in (("prepare", lambda: _prepare(ckpt_root, tmp, models, sources, groups)),
                      ("models", lambda: _save_models(tmp, models)), ("rank", rank_file)):
        _, failures = _agreed(groups, fn)
        if failures:
            fail(failures)
        if phase == "models" and crash_at == "after_models":
            os._exit(17)

    def trainer_json():
        state = {**trainer_state, "format": FORMAT, "version": VERSION, "step": step,
                 "world_size": groups.world_size, "tp": groups.tp_size, "pp": groups.pp_size,
                 "dp": groups.dp_size, "models": sorted(models)}
        if config is not None:
            state["config_digest"] = config_digest(config)
            state["config"] = config
        _write_json(os.path.join(tmp, TRAINER_FILE), state)
        return _files(tmp)

    # Collectives only between the agreed phases: a phase that raises on one rank must not
    # leave another rank waiting inside a collective.
    files, failures = _agreed(groups, trainer_json if groups.rank == 0 else lambda: None)
    if failures:
        fail(failures)
    files = _broadcast(files, groups)
    sums, failures = _agreed(groups, lambda: _checksum(tmp, files, groups))
    if failures:
        fail(failures)
    merged = {}
    for part in _gather(sums, groups):
        merged.update(part)

    def manifest():
        if groups.rank == 0:
            _write_json(os.path.join(tmp, MANIFEST), {
                "format": FORMAT, "version": VERSION, "step": step, "checksum": "crc32",
                "total_bytes": sum(n for n, _ in merged.values()), "files": merged})

    _, failures = _agreed(groups, manifest)
    if failures:
        fail(failures)

    def commit():
        if groups.rank != 0:
            return
        if os.path.exists(final):  # a damaged or superseded step_N of an earlier attempt
            os.rename(final, final + ".old.tmp")
        os.rename(tmp, final)
        _fsync_dir(ckpt_root)
        if crash_at == "after_rename":
            os._exit(17)
        _write_latest(ckpt_root, name)
        shutil.rmtree(final + ".old.tmp", ignore_errors=True)

    _, failures = _agreed(groups, commit)
    if failures:
        fail(failures)
    if groups.rank == 0 and keep_last > 0:
        try:
            prune(ckpt_root, keep_last, name)
        except OSError as e:  # a prune failure must not stop training
            log(f"[megaprm] could not prune old checkpoints in {ckpt_root}: {_one_line(e)}")
    _barrier(groups)
    return final


# ----------------------------------------------------------------------------------------- load

def find_intact(ckpt_root: str, groups: Groups, *, fallback: bool = True,
                log: Callable[[str], None] = print) -> Optional[str]:
    """The newest verified checkpoint under `ckpt_root` (collective), or None when there is none.

    A damaged newer one is reported in one line and renamed to `step_N.damaged` (fallback), or
    refused with CheckpointError (fallback=False). A complete `step_N` that `latest` does not
    name (a crash after its rename) is adopted and `latest` rewritten.
    """
    names = _broadcast(step_dirs(ckpt_root) if groups.rank == 0 else None, groups)
    foreign = _broadcast(other_runs(ckpt_root, names) if groups.rank == 0 else None, groups)
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
        pointer = _read_latest(ckpt_root)
        if pointer != name:
            if not damaged:
                log(f"[megaprm] adopting {chosen}: `latest` named {pointer!r} (a save was "
                    "interrupted after its checkpoint was complete)")
            _write_latest(ckpt_root, name)

    _, failures = _agreed(groups, settle)
    if failures:
        raise CheckpointError(f"cannot update {ckpt_root} before resuming: {failures[0][2]}")
    return chosen


def other_runs(ckpt_root: str, names: list) -> list:
    """[(name, why)] of the `step_N` newer than the one `latest` names that another run wrote
    (another run id or config digest): leftovers of an earlier run in a reused directory, never
    'a save interrupted after its checkpoint was complete'. Rank 0; only manifest-checked
    trainer.json files are read. Without an intact `latest` target nothing is judged."""
    pointer = _read_latest(ckpt_root)
    m = _STEP_DIR.match(pointer or "")
    if not m or pointer not in names:
        return []
    anchor, problem = verified_trainer_json(os.path.join(ckpt_root, pointer))
    if problem:
        return []
    out = []
    for name in names:
        if int(_STEP_DIR.match(name).group(1)) <= int(m.group(1)):
            break
        state, problem = verified_trainer_json(os.path.join(ckpt_root, name))
        if problem is None and _identity(state) != _identity(anchor):
            run, digest = _identity(state)
            out.append((name, f"checkpoint {os.path.join(ckpt_root, name)} is newer than "
                              f"`latest` ({pointer}) but was written by another run (run id "
                              f"{run}, config {digest}; {pointer}: run id {_identity(anchor)[0]}, "
                              f"config {_identity(anchor)[1]})"))
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
        raise CheckpointError(f"{tpath} is unreadable ({_one_line(e)}); delete {path} to resume "
                              "from the checkpoint before it") from None


def _load_models(path: str, models: dict) -> None:
    from megatron.core import dist_checkpointing

    from checkpoint_tools import layout, stages

    for key, model in models.items():
        m = _unwrap(model)
        d = os.path.join(path, key, layout.MODEL_SUBDIR)
        if not os.path.isdir(d):
            raise CheckpointError(f"{path} holds no {key!r} model ({d} is missing)")
        loaded = dist_checkpointing.load(stages.sharded_state_dict(m), d)
        result = m.load_state_dict(loaded, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"{d} lacks {len(missing)} weight(s): {missing[:10]}")


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
    state, failures = _agreed(groups, lambda: _read_trainer_json(path))
    if failures:
        raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))
    layout = (state["world_size"], state["tp"], state["pp"])
    if layout != (groups.world_size, groups.tp_size, groups.pp_size):
        raise CheckpointError(
            f"{path} was written with (world, tp, pp) = {layout} but this run has "
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

    def restore():
        _load_models(path, models)
        blob = torch.load(os.path.join(path, f"rank_{groups.rank:05d}.pt"), weights_only=False)
        for key, opt in optimizers.items():
            opt.load_state_dict(blob["optimizers"][key])
        set_rng_state(blob["rng"])

    _, failures = _agreed(groups, restore)
    if failures:
        rank, _, text = failures[0]
        raise CheckpointError(f"loading {path} failed on rank {rank}: "
                              f"{text.removeprefix('CheckpointError: ')}")
    return {**state, "path": path}


# ------------------------------------------------------------------------------ run directory

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
    naming the flags, unless `replace` (then `set_aside` moves the old run). Single process."""
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
    from megaprm.trainer.run_lock import LOCK_FILE

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
        _fsync_dir(run_dir)
        log(f"[megaprm] trainer.replace_run: the earlier run in {run_dir} was moved to {aside}")

    _, failures = _agreed(groups, claim)
    if failures:
        raise CheckpointError(failures[0][2].removeprefix("CheckpointError: "))


def latest_checkpoint(ckpt_root: str) -> Optional[str]:
    """The newest `step_N` directory (unverified; single process), or None."""
    names = step_dirs(ckpt_root)
    return os.path.join(ckpt_root, names[0]) if names else None

"""A comparison's resumable state kept outside its run directory (`megaprm compare --state-dir`).

A comparison takes hours; on a machine whose disk does not outlive the session, its run
directory goes with the machine. `save` keeps, in a second directory (one that survives: a
committed folder of the repository, a mounted volume), exactly what a resumed run reads back:
each built start's warm-up policy and PRM (`sft/`, `prm/`: weights, config, tokenizer and the
stage record holding its cache key), its baseline and PRM judgement (`baseline.json`,
`prm_judged.json`), and each finished cell's `result.json` and `metrics.jsonl` (the curves).
Not kept: the RL checkpoints, samples and the random inits (a finished cell never reads them
again), an unfinished cell (it restarts from step 0 anyway), superseded cells.

The state directory holds a MANIFEST.json in checkpoint_tools.manifest's format (size and sha256
of every file; `STATE_FORMAT` in its header). A state saved before that format was shared holds
this module's first one, `{"format": 1, "files": {path: {"sha256", "bytes"}}}` (the committed
docs/compare/*/run-state); `read_manifest` reads both, told apart by their version fields, and
the next save that copies a file writes the shared format. `save` is
incremental (a file whose hash is the manifest's is not copied again) and additive (a file gone
from the run directory stays in the state), each file written to a temporary name and renamed,
the manifest last, so a save cut short leaves the previous manifest true. `restore` verifies
every file against the manifest before it copies anything, then copies each unit (a start's
stage, a cell, a file) the run directory does not hold complete (a complete one there is the
live one and stays); the cache keys of the stages and cells then decide, as for any run
directory, what is reused.
"""
from __future__ import annotations

import json
import os
import shutil

from checkpoint_tools import manifest

MANIFEST = manifest.MANIFEST
STATE_FORMAT = "megaprm-compare-state"  # the manifest header's "format"
LEGACY_FORMAT = 1  # this module's own manifest before it used checkpoint_tools.manifest
STAGES = ("sft", "prm")                          # a start's built models (stage record inside)
START_FILES = ("baseline.json", "prm_judged.json")
CELL_FILES = ("result.json", "metrics.jsonl")    # a finished cell: result.json is there


class StateError(ValueError):
    """A state directory that does not match its manifest (the user's to fix: one line)."""


def _sha256(path: str) -> str:
    return manifest.file_digest(path, "sha256")


def resumable_files(run_dir: str) -> list[str]:
    """The files of `run_dir` a resumed comparison reads back, relative to it, sorted."""
    out = []
    for start in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else ():
        sd = os.path.join(run_dir, start)
        if not (start.startswith("start") and os.path.isdir(sd)):
            continue
        for stage in STAGES:  # a stage counts once its record (written last) is there
            d = os.path.join(sd, stage)
            if os.path.isfile(os.path.join(d, "demo_stage.json")):
                out += [f"{start}/{stage}/{f}" for f in os.listdir(d)
                        if os.path.isfile(os.path.join(d, f)) and not f.endswith(".tmp")]
        out += [f"{start}/{f}" for f in START_FILES if os.path.isfile(os.path.join(sd, f))]
        rl = os.path.join(sd, "rl")
        for cell in sorted(os.listdir(rl)) if os.path.isdir(rl) else ():
            if cell != "superseded" and os.path.isfile(os.path.join(rl, cell, "result.json")):
                out += [f"{start}/rl/{cell}/{f}" for f in CELL_FILES
                        if os.path.isfile(os.path.join(rl, cell, f))]
    return sorted(out)


def read_manifest(state_dir: str) -> dict:
    """{relative path: [size, sha256]} of a state directory ({} when it has none yet), from
    either format: checkpoint_tools.manifest's (any `manifest_version` it reads, with sha256
    checksums) or, by its `"format": 1` and no `manifest_version`, this module's first."""
    path = os.path.join(state_dir, MANIFEST)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if isinstance(raw, dict) and "manifest_version" not in raw \
                and raw.get("format") == LEGACY_FORMAT:
            return {rel: [e["bytes"], e["sha256"]] for rel, e in raw["files"].items()}
        loaded = manifest.load(path)
        if loaded["checksum"] != "sha256":
            raise ValueError(f"its checksums are {loaded['checksum']}, a state's are sha256")
        return loaded["files"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"--state-dir {state_dir}: {MANIFEST} is not a state manifest ({e}); "
                         f"restore it (e.g. `git checkout -- {state_dir}`) or pass another "
                         "directory") from None


def _copy(src: str, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + ".tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def save(run_dir: str, state_dir: str) -> int:
    """Copy what has changed of `resumable_files(run_dir)` into `state_dir`, then its manifest;
    returns how many files were copied."""
    files = read_manifest(state_dir)
    copied = 0
    for rel in resumable_files(run_dir):
        src, dest = os.path.join(run_dir, rel), os.path.join(state_dir, rel)
        digest = _sha256(src)
        if files.get(rel, [None, None])[1] == digest and os.path.isfile(dest):
            continue
        _copy(src, dest)
        files[rel] = [os.path.getsize(dest), digest]
        copied += 1
    if copied or not os.path.isfile(os.path.join(state_dir, MANIFEST)):
        os.makedirs(state_dir, exist_ok=True)
        manifest.write(state_dir, dict(sorted(files.items())), checksum="sha256",
                       format=STATE_FORMAT)
    return copied


def verify(state_dir: str) -> dict:
    """The manifest, once every file it names is there with its sha256 (else StateError)."""
    files = read_manifest(state_dir)
    for rel, (_, digest) in files.items():
        path = os.path.join(state_dir, rel)
        if not os.path.isfile(path):
            raise StateError(f"--state-dir {state_dir}: {rel} is in {MANIFEST} but missing; "
                             f"restore it (e.g. `git checkout -- {state_dir}`)")
        if _sha256(path) != digest:
            raise StateError(f"--state-dir {state_dir}: {rel} does not match its sha256 in "
                             f"{MANIFEST} (changed or cut short); restore it (e.g. `git "
                             f"checkout -- {state_dir}`)")
    return files


def _unit(rel: str) -> tuple[str, str | None]:
    """The unit a state file is restored with, and the file that says the unit is complete in
    a run directory: a start's stage (its record), a cell (its result.json), or the file."""
    parts = rel.split("/")
    if len(parts) >= 3 and parts[1] in STAGES:
        return "/".join(parts[:2]), "demo_stage.json"
    if len(parts) >= 4 and parts[1] == "rl":
        return "/".join(parts[:3]), "result.json"
    return rel, None


def restore(state_dir: str, run_dir: str) -> tuple[int, int]:
    """Copy the verified state's units (a stage, a cell, a file) that `run_dir` does not hold
    complete into it; returns (copied, kept) counts of units. A complete unit of the run
    directory is left as it is (it is the live one); an incomplete one (a stage without its
    record, a cell without result.json: what a resumed run would retrain from step 0) is
    replaced by the state's."""
    a, b = os.path.realpath(state_dir), os.path.realpath(run_dir)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise StateError(f"--state-dir {state_dir} and --run-dir {run_dir} overlap; the state "
                         "is a copy kept apart from the run directory: pass another directory")
    units: dict = {}
    for rel in verify(state_dir):
        units.setdefault(_unit(rel), []).append(rel)
    copied = kept = 0
    for (unit, marker), rels in sorted(units.items()):
        dest = os.path.join(run_dir, unit)
        if os.path.isfile(os.path.join(dest, marker) if marker else dest):
            kept += 1
            continue
        if marker and os.path.isdir(dest):
            shutil.rmtree(dest)
        for rel in rels:
            _copy(os.path.join(state_dir, rel), os.path.join(run_dir, rel))
        copied += 1
    return copied, kept

"""The output-path rule of every command that writes (megaprm train, train-prm, demo, compare,
eval, eval-prm, plot; checkpoint_tools import-hf and export-hf through `layout.check_target`): no
output is, lies inside or contains what the command reads, or a training run's directory.
A refusal is an `OutputPathError`, one line that names the setting and the path.

A leaf: it imports none of megaprm's packages, so the checkpoint tools and the trainer both
use it. It also names what marks a trainer's run directory, which the rule looks for.
"""
from __future__ import annotations

import os
import re

# a trainer's run directory: RUN_DIR/checkpoints/step_NNNNNN/ and RUN_DIR/checkpoints/latest
# naming the last complete step, beside its metrics.jsonl and resolved config.yaml
CHECKPOINTS_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"step_\d+$")
RUN_MARKERS = ("metrics.jsonl", "config.yaml", CHECKPOINTS_SUBDIR)


class OutputPathError(ValueError):
    """An output path the rule refuses; the user picks another (the CLI prints one line)."""


def describe(path: str) -> str:
    """A short listing of what a directory holds, for error messages."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "nothing readable"
    shown = [n + ("/" if os.path.isdir(os.path.join(path, n)) else "") for n in names[:8]]
    return ", ".join(shown) + (f", ... (+{len(names) - 8})" if len(names) > 8 else "") \
        if names else "an empty directory"


def overlap(out_dir: str, src: str) -> str | None:
    """How `out_dir` sits against `src` ("is", "lies inside", "contains"), None if apart.
    Symlinks resolved: a link to the input is the input."""
    out, s = os.path.realpath(out_dir), os.path.realpath(src)
    if out == s:
        return "is"
    if out.startswith(s.rstrip(os.sep) + os.sep):
        return "lies inside"
    if s.startswith(out.rstrip(os.sep) + os.sep):
        return "contains"
    return None


def holds_run(path: str) -> bool:
    """Whether directory `path` is a trainer's run directory: its metrics.jsonl next to its
    config.yaml, or a checkpoints/ of trainer steps (a config.yaml alone is common elsewhere)."""
    ckpts = os.path.join(path, CHECKPOINTS_SUBDIR)
    if os.path.isfile(os.path.join(path, "metrics.jsonl")) and os.path.isfile(
            os.path.join(path, "config.yaml")):
        return True
    try:
        return os.path.isdir(ckpts) and any(n == LATEST_FILE or STEP_DIR.match(n)
                                            for n in os.listdir(ckpts))
    except OSError:
        return False


def _run_around(path: str) -> str | None:
    """The nearest directory above `path` (not `path` itself) that holds a training run."""
    d = os.path.dirname(os.path.realpath(path))
    while True:
        if holds_run(d):
            return d
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def _run_within(path: str, depth: int = 2) -> str | None:
    """A training run in a directory up to `depth` levels below `path`, if any."""
    level = [path] if os.path.isdir(path) else []
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                entries = sorted(e.path for e in os.scandir(d) if e.is_dir())
            except OSError:
                continue
            for sub in entries:
                if holds_run(sub):
                    return sub
                nxt.append(sub)
        level = nxt
    return None


def check_output(out: str, setting: str, inputs: dict, *, own_run: bool = False,
                 holds_runs: bool = False, allowed: tuple = ()) -> None:
    """The rule: a command's output `out` (named by `setting` in the message) is refused in one
    line when it is, lies inside or contains one of `inputs` ({setting: path}; None entries
    skipped), or when it is, lies inside or contains a training run's directory. `own_run`:
    `out` is itself a run directory (train: a resume). `holds_runs`: `out` holds runs of its
    own below it (demo, compare). `allowed`: outputs that are the input's own place for them
    (plot's RUN_DIR/plots). Raises OutputPathError."""
    real = os.path.realpath(out)
    if any(real == os.path.realpath(a) for a in allowed):
        return
    for name, src in inputs.items():
        how = overlap(out, src) if src else None
        if how is not None:
            raise OutputPathError(
                f"{setting}={out!r} {how} the input {name}={src!r}: writing there would change "
                f"what the command reads; choose a {setting} outside it")
    around = _run_around(out)
    if around is not None:
        raise OutputPathError(f"{setting}={out!r} lies inside the training run {around!r}: "
                              f"writing there would mix into its history; choose a {setting} "
                              "outside it")
    if os.path.isdir(out) and holds_run(out) and not own_run:
        raise OutputPathError(f"{setting}={out!r} holds a training run ({describe(out)}); "
                              f"choose a new {setting} (nothing of a run is written over)")
    # a run's own replaced-<time>/ runs are its history, not another run to refuse
    inner = None if holds_runs or (own_run and holds_run(out)) else _run_within(out)
    if inner is not None:
        raise OutputPathError(f"{setting}={out!r} contains the training run {inner!r}; choose "
                              f"a {setting} of its own, outside every run")

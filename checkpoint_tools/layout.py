"""On-disk layout of a megaprm checkpoint, atomic target directories, side files.

A checkpoint written by `import-hf` (and each model of a trainer step) is a directory:

    DIR/model/                    Megatron distributed checkpoint (dist_checkpointing, torch_dist);
                                  global tensor keys, so it loads at any tp/pp
    DIR/hf/                       the HF side files, copied verbatim: config.json,
                                  generation_config.json, tokenizer files, chat template, ...
    DIR/megaprm_checkpoint.json   what wrote it: architecture, dtype, tp/pp at save time

Targets are written to `DIR.tmp-XXXX` next to DIR and renamed at the end, so a crash never
leaves a half-written DIR behind.

The trainer writes the same format per model of a step: RUN_DIR/checkpoints/step_NNNNNN/<key>/
with <key> `actor` (or `prm` for a PRIME run), plus RUN_DIR/checkpoints/latest naming the last
complete step; `resolve_checkpoint` accepts any of those paths.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass

from megaprm.models.hf_files import WEIGHT_FILE
from megaprm.outputs import (
    CHECKPOINTS_SUBDIR,
    LATEST_FILE,
    RUN_MARKERS,
    STEP_DIR,
    OutputPathError,
    check_output,
    describe,
    overlap,
)

HF_EXPORT_FORMAT = "megaprm-hf-export"  # MANIFEST.json's format in an export-hf output
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
META_FILE = "megaprm_checkpoint.json"
FORMAT = "megaprm-megatron-dist-ckpt"

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def _torch_dtypes() -> dict:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def __getattr__(name: str):
    # DTYPES (name -> torch dtype) is built on first use: importing torch here would make
    # `python -m checkpoint_tools --help` pay for it
    if name == "DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_HF_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
HF_DTYPE_NAME = {v: k for k, v in _HF_DTYPE_NAMES.items()}  # fp32 -> float32


class ConversionError(ValueError):
    """A problem the user can fix (paths, config, weights, tp/pp); the CLI prints one line."""


def os_error_line(e: OSError) -> str:
    """One line for an OSError of a conversion: a full disk named as such, with the path."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno == errno.ENOSPC or "No space left on device" in str(e):
        return (f"no space left on device{where} (ENOSPC); nothing was written to the target: "
                "free space or choose a target on a larger disk")
    return f"{e.strerror or e}{where}"


def no_space_in(e: BaseException) -> bool:
    """Whether `e` is, wraps or reports (as torch.distributed.checkpoint's writers do, in the
    text of a CheckpointException) a full disk."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e) or "[Errno 28]" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def out_of_space(path: str, floor: int = 1 << 20) -> bool:
    """Whether the filesystem holding `path` (or its nearest existing parent) has under
    `floor` bytes free: a write that failed there failed for space whatever its text says
    (torch's zip writer, its file cut short on a full tmpfs, reports "unexpected pos N vs M"
    instead of ENOSPC)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free < floor
    except OSError:
        return False


@dataclass
class CheckpointMeta:
    format: str
    version: int
    architecture: str
    dtype: str       # fp32 | bf16 | fp16: the dtype of the stored weights
    tp: int          # layout at save time (any tp/pp can load it)
    pp: int
    source: str      # the HF directory it was imported from

    def write(self, ckpt_dir: str) -> None:
        with open(os.path.join(ckpt_dir, META_FILE), "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=2)

    @staticmethod
    def read(ckpt_dir: str) -> CheckpointMeta:
        path = os.path.join(ckpt_dir, META_FILE)
        if not os.path.isfile(path) or not os.path.isdir(os.path.join(ckpt_dir, MODEL_SUBDIR)):
            raise ConversionError(
                f"{ckpt_dir!r} is not a megaprm checkpoint (no {META_FILE} and {MODEL_SUBDIR}/): "
                "create one with `python -m checkpoint_tools import-hf`")
        with open(path, encoding="utf-8") as f:
            meta = CheckpointMeta(**json.load(f))
        if meta.format != FORMAT:
            raise ConversionError(f"{path}: format={meta.format!r}, expected {FORMAT!r}")
        return meta


MODEL_KEYS = ("actor", "prm")


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE)) and \
        os.path.isdir(os.path.join(path, MODEL_SUBDIR))


def _model_in_step(step_dir: str, model: str) -> str:
    ckpt = os.path.join(step_dir, model)
    if is_checkpoint(ckpt):
        return ckpt
    others = [k for k in MODEL_KEYS if k != model and is_checkpoint(os.path.join(step_dir, k))]
    if others:
        raise ConversionError(
            f"trainer step {step_dir!r} has no {model}/ checkpoint (it has {', '.join(others)}/; "
            f"a PRM is saved only by runs that train one, e.g. PRIME); pass --model {others[0]}")
    if os.path.isdir(ckpt):
        raise ConversionError(
            f"{ckpt!r} is not a complete checkpoint: it holds {describe(ckpt)}, expected "
            f"{MODEL_SUBDIR}/ and {META_FILE} (an interrupted save? use an earlier step)")
    raise ConversionError(f"trainer step {step_dir!r} has no {model}/ checkpoint; it holds "
                          f"{describe(step_dir)}")


def _follow_latest(ckpts_dir: str, model: str) -> str:
    latest = os.path.join(ckpts_dir, LATEST_FILE)
    steps = sorted(n for n in os.listdir(ckpts_dir) if STEP_DIR.match(n))
    if not os.path.isfile(latest):
        hint = f"; pass a step directory, e.g. {os.path.join(ckpts_dir, steps[-1])}" if steps \
            else ""
        raise ConversionError(f"{ckpts_dir!r} has no {LATEST_FILE} file naming the last complete "
                              f"step (found {len(steps)} step dir(s)){hint}")
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    step_dir = name if os.path.isabs(name) else os.path.join(ckpts_dir, name)
    if not name or not os.path.isdir(step_dir):
        raise ConversionError(f"{latest!r} names {name!r}, which is not a directory in "
                              f"{ckpts_dir!r}; pass a step directory instead")
    return _model_in_step(step_dir, model)


def resolve_checkpoint(path: str, model: str = "actor") -> str:
    """The checkpoint_tools checkpoint directory that `path` designates, for model `model`.

    Accepts, in this order: a checkpoint directory itself (`model/` + `megaprm_checkpoint.json`);
    a trainer step directory (`step_NNNNNN/`, whose `<model>/` is one); a trainer `checkpoints/`
    directory or a run directory holding one (its `latest` file names the step). Anything else
    raises ConversionError saying what was found there.
    """
    if model not in MODEL_KEYS:
        raise ConversionError(f"--model={model!r}: choose one of {list(MODEL_KEYS)}")
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ConversionError(f"checkpoint path {path!r} does not exist or is not a directory")
    if is_checkpoint(path):
        return path
    if any(os.path.isdir(os.path.join(path, k)) for k in MODEL_KEYS):
        return _model_in_step(path, model)
    for ckpts in (path, os.path.join(path, CHECKPOINTS_SUBDIR)):
        if os.path.isfile(os.path.join(ckpts, LATEST_FILE)) or (
                os.path.isdir(ckpts) and any(STEP_DIR.match(n) for n in os.listdir(ckpts))):
            return _follow_latest(ckpts, model)
    raise ConversionError(
        f"{path!r} is not a megaprm checkpoint: expected a checkpoint dir ({MODEL_SUBDIR}/ + "
        f"{META_FILE}, from `python -m checkpoint_tools import-hf`), a trainer step dir "
        f"(step_N/{model}/), or a run / checkpoints dir with a {LATEST_FILE} file; it holds "
        f"{describe(path)}")


def write_checkpoint_meta(ckpt_dir: str, hf_dir: str, architecture: str, dtype,
                          tp: int, pp: int) -> None:
    """Complete a checkpoint whose `model/` was saved from `checkpoint_tools.stages.
    sharded_state_dict(model)`: copy `hf_dir`'s side files (config, tokenizer, ...) into
    `ckpt_dir/hf/` and write `megaprm_checkpoint.json`. `dtype`: fp32 | bf16 | fp16 or a torch
    dtype (the stored weights'). Call on one rank, after the save."""
    if not isinstance(dtype, str):  # a torch.dtype
        names = {v: k for k, v in _torch_dtypes().items()}
        if dtype not in names:
            raise ConversionError(f"dtype {dtype} is not one of {sorted(DTYPE_NAMES)}")
        dtype = names[dtype]
    if dtype not in DTYPE_NAMES:
        raise ConversionError(f"dtype={dtype!r}: expected one of {sorted(DTYPE_NAMES)}")
    copy_side_files(hf_dir, os.path.join(ckpt_dir, HF_SUBDIR))
    CheckpointMeta(format=FORMAT, version=1, architecture=architecture, dtype=dtype, tp=tp, pp=pp,
                   source=os.path.abspath(hf_dir)).write(ckpt_dir)


def hf_dtype_name(cfg: dict) -> str:
    """fp32 / bf16 / fp16 from an HF config's `dtype` (transformers 5) or `torch_dtype`."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return _HF_DTYPE_NAMES.get(str(name).removeprefix("torch."), "fp32")


def side_files(hf_dir: str) -> list[str]:
    """Top-level non-weight files of an HF directory (config, tokenizer, generation config...)."""
    return sorted(f for f in os.listdir(hf_dir)
                  if os.path.isfile(os.path.join(hf_dir, f)) and not WEIGHT_FILE.match(f)
                  and f != "MANIFEST.json")  # an export's seal, not the model's


def copy_side_files(src: str, dst: str) -> list[str]:
    os.makedirs(dst, exist_ok=True)
    files = side_files(src)
    for f in files:
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    return files


def check_apart(out_dir: str, inputs: tuple) -> None:
    """Refuse an output that is, lies inside or contains one of `inputs`, whatever --force
    says: replacing it would delete what the command reads."""
    for src in inputs:
        how = overlap(out_dir, src)
        if how is not None:
            raise ConversionError(
                f"--out {out_dir!r} {how} the input {src!r}: writing there would replace the "
                "input; choose an output directory outside it (--force does not change this)")


def check_target(out_dir: str, force: bool, inputs: tuple = ()) -> None:
    """`check_apart`; then refuse an output that holds a trainer run, whatever --force says
    (its history would go); else refuse to write over an existing directory unless --force."""
    check_apart(out_dir, inputs)
    try:
        check_output(out_dir, "--out", {})  # nor inside or around a run
    except OutputPathError as e:  # a conversion refuses with its own error type
        raise ConversionError(str(e)) from None
    out_dir = os.path.abspath(out_dir)
    held = [m for m in RUN_MARKERS if os.path.exists(os.path.join(out_dir, m))]
    if held:
        raise ConversionError(
            f"--out {out_dir!r} holds a training run ({', '.join(held)}); choose a new "
            "directory (--force replaces only a conversion's output, never a run)")
    if os.path.exists(out_dir) and not force:
        raise ConversionError(
            f"target {out_dir!r} already exists; choose a new directory or pass --force to "
            "replace it")
    if os.path.exists(out_dir) and not _earlier_output(out_dir):
        raise ConversionError(
            f"--out {out_dir!r} is not an earlier output of import-hf or export-hf (no "
            f"MANIFEST.json of theirs; it holds {describe(out_dir)}): --force replaces only "
            "those; choose a new directory, or remove it yourself")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise ConversionError(f"parent directory {parent!r} of the target does not exist")


def _earlier_output(path: str) -> bool:
    """Whether `path` is what --force may replace: an empty directory, or an output of
    import-hf / export-hf, recognised by the format its MANIFEST.json names."""
    if os.path.isdir(path) and not os.listdir(path):
        return True
    try:
        with open(os.path.join(path, "MANIFEST.json"), encoding="utf-8") as f:
            return json.load(f).get("format") in (FORMAT, HF_EXPORT_FORMAT)
    except (OSError, ValueError, AttributeError):
        return False


def make_tmp(out_dir: str) -> str:
    """A fresh sibling `DIR.tmp-XXXX` (same filesystem, so the final rename is atomic)."""
    out_dir = os.path.abspath(out_dir)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-",
                           dir=os.path.dirname(out_dir))
    # mkdtemp makes it 700; the renamed output gets the mode any new directory would get
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def commit(tmp_dir: str, out_dir: str, force: bool) -> None:
    """Move the finished tmp dir into place; with force, the old target goes only after."""
    out_dir = os.path.abspath(out_dir)
    old = None
    if os.path.exists(out_dir):
        if not force:
            raise ConversionError(f"target {out_dir!r} appeared while converting; not replacing it")
        old = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".old-",
                               dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "prev"))
    os.rename(tmp_dir, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000' -> bytes (HF's convention: GB = 10**9)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConversionError(f"--max-shard-size={text!r}: expected a size like 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise ConversionError(f"--max-shard-size={text!r}: must be positive")
    return size

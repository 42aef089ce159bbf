"""On-disk layout of a megaprm checkpoint, atomic target directories, side files.

A checkpoint written by `import-hf` is a directory:

    DIR/model/                    Megatron distributed checkpoint (dist_checkpointing, torch_dist);
                                  global tensor keys, so it loads at any tp/pp
    DIR/hf/                       the HF side files, copied verbatim: config.json,
                                  generation_config.json, tokenizer files, chat template, ...
    DIR/megaprm_checkpoint.json   what wrote it: architecture, dtype, tp/pp at save time

Targets are written to `DIR.tmp-XXXX` next to DIR and renamed at the end, so a crash never
leaves a half-written DIR behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass

import torch

MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
META_FILE = "megaprm_checkpoint.json"
FORMAT = "megaprm-megatron-dist-ckpt"

# Weight files of an HF directory; every other top-level file is a side file that travels.
_WEIGHT_FILE = re.compile(
    r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.(safetensors|bin)\.index\.json$")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
HF_DTYPE_NAME = {v: k for k, v in _HF_DTYPE_NAMES.items()}  # fp32 -> float32


class ConversionError(ValueError):
    """A problem the user can fix (paths, config, weights, tp/pp); the CLI prints one line."""


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


def hf_dtype_name(cfg: dict) -> str:
    """fp32 / bf16 / fp16 from an HF config's `dtype` (transformers 5) or `torch_dtype`."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return _HF_DTYPE_NAMES.get(str(name).removeprefix("torch."), "fp32")


def side_files(hf_dir: str) -> list[str]:
    """Top-level non-weight files of an HF directory (config, tokenizer, generation config...)."""
    return sorted(f for f in os.listdir(hf_dir)
                  if os.path.isfile(os.path.join(hf_dir, f)) and not _WEIGHT_FILE.match(f))


def copy_side_files(src: str, dst: str) -> list[str]:
    os.makedirs(dst, exist_ok=True)
    files = side_files(src)
    for f in files:
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    return files


def check_target(out_dir: str, force: bool) -> None:
    """Refuse to write over an existing directory unless --force."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not force:
        raise ConversionError(
            f"target {out_dir!r} already exists; choose a new directory or pass --force to "
            "replace it")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise ConversionError(f"parent directory {parent!r} of the target does not exist")


def make_tmp(out_dir: str) -> str:
    """A fresh sibling `DIR.tmp-XXXX` (same filesystem, so the final rename is atomic)."""
    out_dir = os.path.abspath(out_dir)
    return tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-",
                            dir=os.path.dirname(out_dir))


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

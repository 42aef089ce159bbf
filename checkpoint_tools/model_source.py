"""Where a run's model comes from: an HF directory or a megaprm (Megatron) checkpoint.

`model.path` (and `prm.path`) may name either
* an HF directory (config.json + safetensors + tokenizer files), or
* a megaprm checkpoint in the one format shared by `checkpoint_tools import-hf` and the trainer:
  `DIR/model/` (megatron-core dist checkpoint, loadable at any tp/pp), `DIR/hf/` (config.json and
  tokenizer files), `DIR/megaprm_checkpoint.json`. A trainer checkpoint's `step_N/actor/` is one.
  Its files are checked against their MANIFEST.json (checkpoint_tools.manifest) before use, once
  per process: a damaged checkpoint is refused in one line, never trained from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from checkpoint_tools import layout, manifest

_verified: set = set()  # checkpoint dirs whose manifest this process checked


@dataclass(frozen=True)
class ModelSource:
    path: str
    hf_dir: str                   # config.json and tokenizer files live here
    megatron_dir: Optional[str]   # dist checkpoint of the weights; None: safetensors in hf_dir

    @property
    def is_megatron(self) -> bool:
        return self.megatron_dir is not None


def resolve(path: Optional[str], what: str = "model.path") -> ModelSource:
    """Classify `path` (an HF directory, else whatever `checkpoint_tools.layout.
    resolve_checkpoint` accepts: a checkpoint, a trainer step dir or run dir); a one-line
    ValueError names what is missing and what would work."""
    if path is None or not os.path.isdir(path):
        raise ValueError(f"{what}={path!r} is not a directory; point it at an HF model directory "
                         "(config.json + safetensors) or a megaprm checkpoint "
                         "(checkpoint_tools import-hf, or a trainer's checkpoints/step_N/actor)")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(path, path, None)
    try:
        ckpt = layout.resolve_checkpoint(path)
    except layout.ConversionError:
        raise ValueError(f"{what}={path!r} has no config.json; pass an HF model directory or a "
                         "megaprm checkpoint directory") from None
    if ckpt not in _verified:
        try:
            manifest.check(ckpt)
        except ValueError as e:
            raise ValueError(f"{what}={path!r}: {e}") from None
        _verified.add(ckpt)
    return ModelSource(ckpt, os.path.join(ckpt, layout.HF_SUBDIR),
                       os.path.join(ckpt, layout.MODEL_SUBDIR))


# One of these makes a tokenizer (a tokenizer_config.json alone makes one that encodes nothing).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer(hf_dir: str, what: str = "model.path") -> None:
    """A one-line ValueError when `hf_dir` holds no tokenizer files."""
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"{what}: {hf_dir} holds no tokenizer (none of {list(_TOKENIZER_FILES)})"
                         "; copy the tokenizer files of the model there")


def load_weights(model, src: ModelSource, spec, groups) -> None:
    """Fill this rank's stage from `src` (HF safetensors through the mapping, or the dist
    checkpoint resharded to this run's tp/pp, as checkpoint_tools loads it)."""
    if not src.is_megatron:
        # deferred: megatron (convert and the mapping import it), which resolving a path needs not
        from checkpoint_tools.weight_io import check_hf_weights
        from megaprm.models.mapping import load_hf_weights

        # every tensor's name and shape against config.json first (collective; one line naming
        # the tensor, on every rank, instead of a copy's traceback)
        check_hf_weights(src.hf_dir, model.module if hasattr(model, "module") else model, spec,
                         groups)
        load_hf_weights(model, src.hf_dir, spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                        pp=groups.pp_size, pp_rank=groups.pp_rank, ep=groups.ep_size,
                        ep_rank=groups.ep_rank)
        return
    from checkpoint_tools.megatron_io import load_checkpoint  # deferred: megatron

    load_checkpoint(model.module if hasattr(model, "module") else model, src.megatron_dir)

"""Where a run's model comes from: an HF directory or a megaprm (Megatron) checkpoint.

`model.path` (and `prm.path`) may name either
* an HF directory (config.json + safetensors + tokenizer files), or
* a megaprm checkpoint in the one format shared by `checkpoint_tools import-hf` and the trainer:
  `DIR/model/` (megatron-core dist checkpoint, loadable at any tp/pp), `DIR/hf/` (config.json and
  tokenizer files), `DIR/megaprm_checkpoint.json`. A trainer checkpoint's `step_N/actor/` is one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

META_FILE = "megaprm_checkpoint.json"


@dataclass(frozen=True)
class ModelSource:
    path: str
    hf_dir: str                   # config.json and tokenizer files live here
    megatron_dir: Optional[str]   # dist checkpoint of the weights; None: safetensors in hf_dir

    @property
    def is_megatron(self) -> bool:
        return self.megatron_dir is not None


def resolve(path: Optional[str], what: str = "model.path") -> ModelSource:
    """Classify `path`; a one-line ValueError names what is missing and what would work."""
    if path is None or not os.path.isdir(path):
        raise ValueError(f"{what}={path!r} is not a directory; point it at an HF model directory "
                         "(config.json + safetensors) or a megaprm checkpoint "
                         "(checkpoint_tools import-hf, or a trainer's checkpoints/step_N/actor)")
    if os.path.isfile(os.path.join(path, META_FILE)):
        hf, model = os.path.join(path, "hf"), os.path.join(path, "model")
        if not (os.path.isfile(os.path.join(hf, "config.json")) and os.path.isdir(model)):
            raise ValueError(f"{what}={path!r} has {META_FILE} but lacks hf/config.json or model/;"
                             " the checkpoint is incomplete")
        return ModelSource(path, hf, model)
    if os.path.isdir(os.path.join(path, "actor")) and os.path.isfile(
            os.path.join(path, "actor", META_FILE)):
        return resolve(os.path.join(path, "actor"), what)  # a trainer step_N directory
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{what}={path!r} has no config.json; pass an HF model directory or a "
                         "megaprm checkpoint directory")
    return ModelSource(path, path, None)


def load_weights(model, src: ModelSource, spec, groups) -> None:
    """Fill this rank's stage from `src` (HF safetensors through the mapping, or the dist
    checkpoint resharded to this run's tp/pp)."""
    if not src.is_megatron:
        from megaprm.models.mapping import load_hf_weights

        load_hf_weights(model, src.hf_dir, spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                        pp=groups.pp_size, pp_rank=groups.pp_rank)
        return
    from checkpoint_tools.stages import sharded_state_dict
    from megatron.core import dist_checkpointing

    m = model.module if hasattr(model, "module") else model
    state = dist_checkpointing.load(sharded_state_dict(m), src.megatron_dir)
    result = m.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{src.megatron_dir} lacks {len(missing)} weight(s) the model needs: "
                         f"{missing[:5]}")

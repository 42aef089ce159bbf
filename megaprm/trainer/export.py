"""Write a Megatron model (any tp/pp) as an HF directory that transformers and vLLM load:
the demo's warm-up policy and the trainer's `trainer.export_hf`. Collective; rank 0 writes into
`OUT.tmp` and renames it, so a crash never leaves a half-written directory."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch.distributed as dist

from checkpoint_tools.layout import copy_side_files
from megaprm.parallel.device import to_host
from megaprm.parallel.groups import Groups
from megaprm.rollout import weight_sync


def save_hf(model, groups: Groups, out_dir: str, *, side_files_from: Optional[str] = None,
            hf_config: Optional[dict] = None, tokenizer=None) -> str:
    """Gather the weights (HF names) and write `out_dir`: model.safetensors, and either the side
    files (config.json, tokenizer, generation config) of `side_files_from`, or `hf_config` +
    `tokenizer`."""
    from safetensors.torch import save_file

    tensors = {k: to_host(v.detach()).contiguous().clone()
               for k, v in weight_sync.iter_hf_weights(model, groups)}
    if groups.rank == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        if hf_config is not None:
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(hf_config, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    if groups.world_size > 1:
        dist.barrier()
    return out_dir

"""The HF config.json a plan reads: the path's own (an HF directory or a megaprm checkpoint),
else the copy shipped here for the recipes' models, so a plan needs no download.

The shipped configs (hf_configs/*.json) hold the architecture numbers of the public
config.json files on the Hugging Face Hub (hidden size, layers, heads, KV heads, intermediate
size, vocabulary, tying): Qwen/Qwen2.5-Math-7B, Qwen/Qwen2.5-7B, Qwen/Qwen2.5-Math-1.5B,
Qwen/Qwen2.5-Math-PRM-7B, PRIME-RL/Eurus-2-7B-SFT (a Qwen2.5-Math-7B fine-tune),
jinachris/PURE-PRM-7B (a Qwen2.5-Math-7B token classifier), meta-llama/Llama-3.1-8B,
Qwen/Qwen3-30B-A3B (mixture-of-experts: experts, experts per token, expert width).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from checkpoint_tools import model_source

_SHIPPED = os.path.join(os.path.dirname(__file__), "hf_configs")


@dataclass(frozen=True)
class ModelConfigSource:
    config: dict
    where: str     # the config.json read, or "shipped:<name>"


def shipped_names() -> list:
    return sorted(f[:-5] for f in os.listdir(_SHIPPED) if f.endswith(".json"))


def hf_config_for(path: str | None, what: str) -> ModelConfigSource:
    """config.json of `path` (an HF dir or a megaprm checkpoint), else the shipped config whose
    name is the path's last component (`models/Qwen2.5-Math-7B`, `Qwen/Qwen2.5-Math-7B`)."""
    # deferred: torch (models imports without it)
    from megaprm.models.hf_spec import load_hf_config

    if path is None:
        raise ValueError(f"{what} is not set; a plan needs the model's config.json")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelConfigSource(load_hf_config(path), os.path.join(path, "config.json"))
        src = model_source.resolve(path, what)
        return ModelConfigSource(load_hf_config(src.hf_dir), os.path.join(src.hf_dir,
                                                                          "config.json"))
    if os.path.isfile(path) and path.endswith(".json"):
        return ModelConfigSource(load_hf_config(path), path)
    name = os.path.basename(os.path.normpath(path))
    shipped = {n.lower(): n for n in shipped_names()}
    if name.lower() in shipped:
        file = os.path.join(_SHIPPED, shipped[name.lower()] + ".json")
        with open(file, encoding="utf-8") as f:
            return ModelConfigSource(json.load(f), f"shipped:{shipped[name.lower()]}")
    raise FileNotFoundError(
        f"{what}={path!r}: no config.json there and no shipped config named {name!r}; point it "
        f"at a directory holding the model's config.json (no weights needed) or use one of "
        f"{', '.join(shipped_names())}")

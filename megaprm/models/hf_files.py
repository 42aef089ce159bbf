"""Which files of a Hugging Face model directory hold its weights. Every other top-level file
(config.json, tokenizer files, generation config) is a side file that travels with a checkpoint;
a megaprm checkpoint's hf/ holds side files only."""
from __future__ import annotations

import os
import re

WEIGHT_FILE = re.compile(
    r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.(safetensors|bin)\.index\.json$")


def has_weights(hf_dir: str) -> bool:
    """Whether an HF directory holds weight files (a checkpoint's hf/ holds only side files)."""
    return any(WEIGHT_FILE.match(f) for f in os.listdir(hf_dir))

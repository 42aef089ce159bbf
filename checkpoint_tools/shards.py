"""Write a stream of (hf_name, tensor) as HF safetensors shards, one shard resident at a time.

Shards are filled in stream order up to `max_shard_bytes` (a tensor bigger than the limit gets a
shard of its own, as in transformers), written as soon as they are full, and renamed at the end
to transformers' `model-0000i-of-0000N.safetensors` with a `model.safetensors.index.json`
(a single shard is plain `model.safetensors`, no index).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


class ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self.total_bytes = 0
        self.peak_pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise AssertionError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        # A view into a bigger buffer (vocab padding cut off) would keep that buffer alive.
        if tensor.untyped_storage().nbytes() != nbytes or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f"partial-{len(self._shards) + 1:05d}.safetensors")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give shards their final names, write the index. Returns files."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.rename(os.path.join(self.out_dir, f"partial-{i + 1:05d}.safetensors"),
                      os.path.join(self.out_dir, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: names[i] for i, shard in enumerate(self._shards)
                                    for t in sorted(shard)}}
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w",
                      encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        return names

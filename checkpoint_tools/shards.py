"""Write a stream of (hf_name, tensor) as HF safetensors shards, one shard resident at a time.

Shards are filled in stream order up to `max_shard_bytes` (a tensor bigger than the limit gets a
shard of its own, as in transformers), written as soon as they are full, and renamed at the end
to transformers' `model-0000i-of-0000N.safetensors` with a `model.safetensors.index.json`
(a single shard is plain `model.safetensors`, no index).

A shard is written here, not with `safetensors.torch.save_file`: that one copies every tensor
into a Python bytes object and builds the file from those (one more copy of the shard in
memory, 1.0 s of a 0.42 GB export); here the header goes first and then each tensor's own
bytes, one write per tensor, from the tensors as given (views of the model's parameters need
no copy). Same format (8-byte header length, JSON header padded to 8 bytes, data in header
order); tests read the files back with safetensors' loader.
"""
from __future__ import annotations

import json
import os

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """One safetensors file from name -> CPU tensor (non-contiguous ones are made contiguous
    one at a time)."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb", buffering=0) as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors.values():
            if t.numel():
                data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                while data:
                    data = data[f.write(data):]


class ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self.total_bytes = 0
        self.peak_pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a tensor for the current shard. It is written as given, not copied: a caller
        that reuses its buffer must pass a copy."""
        if name in self._pending or any(name in s for s in self._shards):
            raise AssertionError(f"tensor {name} written twice")
        if tensor.dtype not in _DTYPE_NAMES:
            raise AssertionError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f"partial-{len(self._shards) + 1:05d}.safetensors")
        write_safetensors(path, self._pending, metadata={"format": "pt"})
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

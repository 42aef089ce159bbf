"""Release a model's device memory to the host and restore it (the `*.offload` switches).

What one model holds on its device, and what happens to it (verl's `offload_megatron_model_to_cpu`
/ `offload_megatron_optimizer`, Megatron's `_ParamAndGradBuffer.offload_to_cpu`, done here on
storages so that every view of a buffer follows):

* parameters and buffers: the module's own tensors, Megatron DDP's contiguous `param_data` (the
  distributed optimizer's layout) and every bucket view of it -> copied to host memory (pinned
  on CUDA), then the device storage is resized to 0 bytes;
* optimizer state: the torch optimiser's (or Megatron's inner ones') Adam moments, fp32 master
  weights and any other tensor of its state on the device -> copied the same way;
* grads: DDP's contiguous `grad_data`, `param.main_grad` and `.grad` of parameters and master
  weights -> resized to 0 without a copy and zero-filled on reload. They carry nothing between
  steps: every mini-batch starts with `Optimizer.zero_grad` (as Megatron drops them too);
* tensors a module keeps outside its parameters and buffers (Megatron's rotary `inv_freq`) are
  moved like parameters, and the lru caches of the forwards (Megatron's rotary cos/sin tables)
  are emptied: the next forward recomputes them.

Working on storages rather than tensors is what frees the memory: a `.data` swap would leave the
bucket views, the masters that view the parameters (Megatron's fp32 shards) and autograd's
references holding the old storage. `reload` resizes each storage back to its size and copies
its bytes in, so every tensor and view sees exactly its old values (bit for bit) at its old
shape; only the storage's address changes.

Only storages on the model's device move (AdamW's host `step` counters stay). On a CPU-only run
the "device" is the CPU itself: the storages are still released and restored (a host copy),
which is how the tests see the mechanics without a GPU.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from megaprm.parallel.device import model_device
from megaprm.parallel.optimizer import torch_optimizers

KEEP, DROP = "keep", "drop"  # copied to the host and back | released and zero-filled on reload


def _inner_module(model):
    # Megatron DDP keeps its list of grad buffers in `self.buffers`, shadowing nn.Module.buffers
    return getattr(model, "module", model)


def _model_tensors(model) -> Iterator[tuple[torch.Tensor, str]]:
    inner = _inner_module(model)
    for p in inner.parameters():
        yield p, KEEP
        for g in (getattr(p, "main_grad", None), p.grad):
            if g is not None:
                yield g, DROP
    for b in inner.buffers():
        yield b, KEEP
    for m in inner.modules():  # plain tensor attributes (Megatron's rotary `inv_freq`)
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                yield v, KEEP
    ddp_buffers = ([] if model is inner else
                   [*model.buffers, *getattr(model, "expert_parallel_buffers", [])])
    for buf in ddp_buffers:  # flat param_data / grad_data, viewed by every bucket and param
        for t, kind in ((buf.param_data, KEEP), (buf.grad_data, DROP),
                        (getattr(buf, "shared_buffer", None), KEEP)):
            if t is not None:
                yield t, kind


def _optimizer_tensors(optimizer) -> Iterator[tuple[torch.Tensor, str]]:
    """Every tensor of a megaprm `Optimizer` (or a torch / Megatron one): the inner torch
    optimisers' parameters (Megatron: the fp32 masters), their grads and their state."""
    impl = getattr(optimizer, "impl", optimizer)
    for opt in torch_optimizers(impl):
        for group in opt.param_groups:
            for p in group["params"]:
                yield p, KEEP
                if p.grad is not None:
                    yield p.grad, DROP
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    yield v, KEEP


def _clear_forward_caches(model) -> None:
    """Empty the lru caches of the modules' forwards: Megatron's `RotaryEmbedding.forward`
    keeps its cos/sin tables (device tensors no walk reaches) per sequence length. A forward
    recomputes them, to the same values."""
    for cls in {type(m) for m in _inner_module(model).modules()}:
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()


def _host_copy(view: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """Device bytes -> host bytes (into `host` when its size fits, else a new buffer; pinned
    where the device is CUDA, so the copy back is asynchronous). Synchronous: the device storage
    is released right after."""
    if host is None or host.numel() != view.numel():
        host = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=view.device.type == "cuda")
    host.copy_(view)
    return host


def _device_copy(view: torch.Tensor, host: torch.Tensor) -> None:
    """Host bytes -> the re-grown device storage (stream-ordered before any kernel reading it)."""
    view.copy_(host, non_blocking=view.device.type == "cuda")


def _bytes(storage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (its current size)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offload:
    """One model's device state: `offload()` releases it to the host, `reload()` brings it back.
    `model`: an nn.Module or Megatron DDP; `optimizer`: its megaprm `Optimizer` (or None).
    Both are idempotent: the loop may call them in any state. Host buffers are kept and reused
    from one offload to the next (pinned allocations are slow)."""

    def __init__(self, name: str, model, optimizer=None):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.offloaded = False
        self._moved: list[tuple] = []  # (storage, nbytes, kind)
        self._host: dict = {}           # storage key -> host uint8 buffer (KEEP storages)

    def storages(self) -> list[tuple]:
        """(storage, kind) of every distinct storage on the model's device, KEEP before DROP
        when a storage is reached both ways (its values are kept)."""
        device = model_device(_inner_module(self.model))
        tensors = list(_model_tensors(self.model))
        if self.optimizer is not None:
            tensors += list(_optimizer_tensors(self.optimizer))
        found: dict = {}
        for t, kind in tensors:
            st = t.untyped_storage()
            if st.device != device:
                continue
            key = st._cdata
            if key not in found or kind == KEEP:
                found[key] = (st, kind)
        return list(found.values())

    @torch.no_grad()
    def offload(self) -> int:
        """Release the device storages (KEEP ones copied to the host first); returns the bytes
        released."""
        if self.offloaded:
            return 0
        _clear_forward_caches(self.model)
        moved, freed = [], 0
        for st, kind in self.storages():
            n = st.nbytes()
            if n == 0:
                continue
            if not st.resizable():
                raise RuntimeError(f"{self.name} offload: a storage of {n} bytes is not "
                                   "resizable (memory-mapped?); it cannot be released")
            if kind == KEEP:
                self._host[st._cdata] = _host_copy(_bytes(st), self._host.get(st._cdata))
            st.resize_(0)
            moved.append((st, n, kind))
            freed += n
        self._moved, self.offloaded = moved, True
        return freed

    @torch.no_grad()
    def reload(self) -> int:
        """Grow every released storage back and restore its bytes (grads: zeros); returns the
        bytes restored."""
        if not self.offloaded:
            return 0
        total = 0
        for st, n, kind in self._moved:
            st.resize_(n)
            view = _bytes(st)
            if kind == KEEP:
                _device_copy(view, self._host[st._cdata])
            else:
                view.zero_()
            total += n
        self._moved, self.offloaded = [], False
        return total

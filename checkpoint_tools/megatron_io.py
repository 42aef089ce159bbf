"""Megatron distributed checkpoints (torch_dist) of one stage: a synchronous save written by
threads of this process (optionally filled file to file from the HF shards), and a load that
checks the checkpoint fits the model. Megatron-core is imported where it is used (seconds)."""
from __future__ import annotations

import contextlib
import errno
import functools
import os

import torch
import torch.distributed as dist

from checkpoint_tools import layout, stages
from checkpoint_tools.layout import ConversionError
from checkpoint_tools.ranks import agree
from checkpoint_tools.weight_io import FileCopies, bytes_of


def model_dir(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, layout.MODEL_SUBDIR)


@contextlib.contextmanager
def in_process_write_queue():
    """Megatron's torch_dist writer hands its results back through a queue that it creates
    with a *spawned* multiprocessing Manager: a fresh interpreter that re-imports `__main__`,
    seconds per process that saves once (most of import-hf's 15x over a raw write). A
    synchronous save collects the results in this process, so a plain queue does the job."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    prev = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = prev


WRITER_THREADS = 4  # most files per rank; the loader reads whatever number the metadata lists


def writer_threads(local_ranks: int) -> int:
    """Writer threads (= files) per rank: this machine's cores shared by its ranks, 1 to
    `WRITER_THREADS`. The writes are memory copies, so threads beyond the cores contend: on
    two cores a tp2 import (read + save, 424 MB) took 0.22-0.24 s with one thread per rank
    against 0.25-0.27 s with four, a one-rank import 0.21 s with two against 0.29 s with one
    (docs/benchmark-history.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(WRITER_THREADS, (cores or 1) // max(1, local_ranks)))


@contextlib.contextmanager
def threaded_writers(fsync: bool, copies: FileCopies | None = None):
    """Megatron's synchronous torch_dist save still forks one writer process per file (a fork
    of a process holding the whole stage) and fsyncs every file: measured on the 424 MB model,
    the save took 0.9-1.2 s against 0.3-0.65 s for the same bytes written by threads of this
    process without fsync. This runs the same per-file writer (`write_preloaded_data`, same
    bytes, same format) in threads of this process; `fsync` keeps Megatron's fsync per file.
    The files are made durable (or not) like a plain safetensors save: the conversion renames
    its tmp dir into place only after every rank has returned. torch.save's per-record CRC32
    is not computed (torch.load never checks it; ~0.08 s per 424 MB), and contiguous views are
    saved without Megatron's clone (`_exact_storage`). `copies`: the bytes it registers are
    copied from the HF files into the written files (see `FileCopies`)."""
    import queue
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    writer = filesystem_async.FileSystemWriterAsync
    prev = writer.__dict__["write_preloaded_data_multiproc"]

    def write_in_threads(transform_list, use_msc, rank, write_buckets, results_queue):
        local, done = queue.Queue(), queue.Queue()
        threads = []
        for i, bucket in enumerate(write_buckets):
            done.put(i)
            kw = {"use_msc": use_msc} if use_msc else {}
            threads.append(threading.Thread(
                target=_without_crc32(writer.write_preloaded_data),
                args=(transform_list, i, bucket, local, done, fsync), kwargs=kw, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out: dict | Exception = {}
        while not local.empty():
            i, res = local.get()
            if isinstance(res, Exception):
                out = res
                break
            out[i] = res
        if not isinstance(out, Exception) and len(out) != len(write_buckets):
            out = RuntimeError(f"torch_dist writer: {len(out)} of {len(write_buckets)} files "
                               "reported back")
        results_queue.put(out)

    writer.write_preloaded_data_multiproc = staticmethod(write_in_threads)
    planner = torch_strategy.MCoreSavePlanner
    prev_transform = planner.__dict__["transform_object"]
    planner.transform_object = lambda self, item, obj: _exact_storage(
        prev_transform(self, item, obj))
    write_item = filesystem_async._write_item
    if copies is not None:
        @functools.wraps(write_item)  # Megatron reads its signature (serialization_format)
        def copying_write_item(*args, **kw):
            # _write_item(*transforms, stream, data, write_item, storage_key, **kw)
            k = len(args) - 4
            copies.check_source(args[k + 1])
            stream = copies.stream(args[k])
            result = write_item(*args[:k], stream, *args[k + 1:], **kw)
            copies.fill(args[k], stream.holes)
            return result

        filesystem_async._write_item = copying_write_item
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with in_process_write_queue():
            yield
    finally:
        writer.write_preloaded_data_multiproc = prev
        planner.transform_object = prev_transform
        filesystem_async._write_item = write_item
        torch.serialization.set_crc32_options(crc)


def _without_crc32(fn):
    """`fn` run with torch.save's CRC32 off: torch's serialization config is per thread, so a
    writer thread must set it itself."""
    def run(*args, **kw):
        torch.serialization.set_crc32_options(False)
        return fn(*args, **kw)
    return run


def _exact_storage(obj):
    """A contiguous CPU tensor that views part of a bigger storage (the gate and up halves of
    fc1 that Megatron's swiglu factory saves apart) as a tensor over exactly its own bytes,
    sharing them. Megatron's writer clones such views, since torch.save writes a view's whole
    storage: ~0.2 s and the bytes of fc1 again per 424 MB here. Same bytes on disk either way."""
    if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_contiguous()
            and obj.numel() and obj.untyped_storage().nbytes() != obj.numel() * obj.itemsize):
        return torch.frombuffer(bytes_of(obj), dtype=torch.uint8).view(obj.dtype).view(
            obj.shape)
    return obj


def import_writer_modules() -> None:
    """Import what a torch_dist save imports lazily (its writer, DCP's filesystem layer)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401


def import_loader_modules() -> None:
    """Import what a torch_dist load (or a streaming export) imports lazily."""
    from megatron.core.dist_checkpointing import dict_utils, mapping  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401
    from torch.distributed.checkpoint import filesystem, metadata  # noqa: F401

    # deferred: this function exists to load these modules before the timed part
    from checkpoint_tools import streaming  # noqa: F401


def save_strategy(threads: int):
    """torch_dist save strategy with `threads` writer files per rank (Megatron's default: 2)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
    )

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)


def save_checkpoint(model, ckpt_model_dir: str, *, fsync: bool = False,
                    copies: FileCopies | None = None) -> None:
    """Synchronous torch_dist save of this stage (global keys: loads at any tp/pp), written by
    threads of this process (see `threaded_writers`); `copies` fills registered parameter
    bytes from the HF files.

    Megatron's access-integrity check is off: it gathers every rank's shard metadata to rank
    0 to prove the shards tile each tensor, a guard for hand-built state dicts, while these
    shards are megatron-core's own `sharded_state_dict` of a model built at this layout (the
    tests load them back at other layouts; `verify`, on by default, loads this checkpoint).
    It cost ~0.05 s of a tp2 import's ~0.4 s save on two cores (docs/benchmark-history.md)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(ckpt_model_dir, exist_ok=True)
    dist.barrier()
    with threaded_writers(fsync, copies):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        try:
            dist_checkpointing.save(stages.sharded_state_dict(model), ckpt_model_dir,
                                    sharded_strategy=save_strategy(writer_threads(local)),
                                    validate_access_integrity=False)
        except BaseException as e:  # torch's CheckpointException is a BaseException
            # its writers' ENOSPC arrives as text on the coordinator (rank 0), the others get
            # one with no failures: one line each (the lowest rank's is reported), not 40; a
            # write cut short on a full disk may not say ENOSPC at all (`out_of_space`)
            if layout.no_space_in(e) or layout.out_of_space(ckpt_model_dir):
                raise ConversionError(layout.os_error_line(OSError(
                    errno.ENOSPC, os.strerror(errno.ENOSPC), ckpt_model_dir))) from None
            if type(e).__name__ == "CheckpointException" and not getattr(e, "failures", 1):
                raise ConversionError("saving the checkpoint failed on another rank (named "
                                      "by rank 0)") from None
            raise


def load_checkpoint(model, ckpt_model_dir: str) -> None:
    """Load a distributed checkpoint into this stage (any tp/pp: shards are global slices)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    def load():
        try:
            state = dist_checkpointing.load(stages.sharded_state_dict(model), ckpt_model_dir,
                                            strict=StrictHandling.RAISE_ALL)
        except CheckpointingException as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise ConversionError(
                f"checkpoint {ckpt_model_dir!r} does not fit the model its hf/config.json "
                f"describes: {first}") from None
        model.load_state_dict(state, strict=True)

    agree("loading the checkpoint", load)

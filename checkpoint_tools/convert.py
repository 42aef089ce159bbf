"""HF safetensors <-> Megatron distributed checkpoint, and the logit check between them.

Every command has two halves:

* the *rank* half (`_import_rank`, `_export_rank`, `_verify_rank`) runs on each of the tp*pp
  ranks: build this rank's stage, move weights, forward the check batch;
* the *leader* half (`import_hf`, `export_hf`, `verify`) validates what it can before any rank
  starts, runs the ranks (under torchrun: this process is one of them; otherwise it spawns
  tp*pp local ranks), compares the Megatron outputs with transformers' and renames the
  finished directory into place.

Weights stream: import copies HF rows into the torch_dist files without holding them
(`FileCopies`; with verification it reads them into this rank's shard, since the forward needs
them); export gathers one parameter at a time (`weight_sync.iter_hf_weights`) and rank 0 holds
at most one safetensors shard before writing it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint_tools import layout, manifest, stages
from checkpoint_tools.layout import DTYPES, ConversionError
from checkpoint_tools.shards import (
    OpenFiles,
    ShortFile,
    WRITE_PIECE,
    chunk_buffer,
    copy_range,
    pwrite_all,
    read_into,
    write_all,
)
from megaprm.models import mapping
from megaprm.models.hf_spec import ModelSpec, UnsupportedModelError, spec_from_hf
from megaprm.parallel import launch
from megaprm.parallel.groups import Groups
from megaprm.parallel.init import ParallelConfigError

# Errors a user causes (wrong paths, configs, weights, layouts); anything else is a bug.
USER_ERRORS = (ConversionError, UnsupportedModelError, ParallelConfigError, FileNotFoundError)
VERIFY_BATCH, VERIFY_SEQ = 2, 16
SKIPPED = {"skipped": True, "reason": "--no-verify: transformers-vs-Megatron logits not compared"}


# ------------------------------------------------------------------------------ shared pieces

def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def verify_batch(spec: ModelSpec, seed: int = 1234) -> torch.Tensor:
    """The fixed [b, s] token batch every check runs on."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (VERIFY_BATCH, VERIFY_SEQ), generator=g)


def load_spec(hf_dir: str) -> ModelSpec:
    try:
        return spec_from_hf(hf_dir)
    except (UnsupportedModelError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    for name, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ConversionError(f"--{name}={v!r}: must be a positive integer")
    try:
        spec.check_parallel(tp, pp)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None


def _agree(phase: str, fn: Callable[[], object]):
    """Run a step that may fail on some ranks only; all ranks then raise the same error
    (a rank that failed alone would leave the others waiting in the next collective)."""
    err = None
    try:
        result = fn()
    except USER_ERRORS as e:
        err, result = f"{e}", None
    except ValueError as e:  # mapping's shape / missing-tensor errors name the tensor
        err, result = f"{phase}: {e}", None
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    if err:
        raise ConversionError(err)
    return result


@contextlib.contextmanager
def _shared_tmp(tmp_dir: str | None, out_dir: str):
    """The target's tmp dir: given by the spawning leader (who cleans it up), else made by
    rank 0, broadcast, and removed by rank 0 if this rank half fails."""
    if tmp_dir is not None:
        yield tmp_dir
        return
    box = [layout.make_tmp(out_dir) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    except BaseException:
        if dist.get_rank() == 0:
            _discard(box[0])
        raise


def _init(tp: int, pp: int) -> Groups:
    """This rank's groups. Conversion is host work on a GPU node too: the stages live in host
    memory (file bytes are read into and written from the parameters' storage), gloo connects
    the ranks, and the check forward runs on the CPU (`cpu.host_only`)."""
    from megaprm.parallel import cpu
    from megaprm.parallel.init import init_distributed

    cpu.host_only()
    return _agree("parallel layout", lambda: init_distributed(tp=tp, pp=pp))


@dataclass
class _Failed:
    message: str


def _catching(fn, *args):
    """Spawned-rank entry: user errors come back as one line, not as a traceback."""
    try:
        return fn(*args)
    except ConversionError as e:
        return _Failed(str(e))


# How local ranks start. `python -m checkpoint_tools` sets "fork"
# (`__main__.main(fork_ranks=True)`): its leader has imported torch and megatron-core and done
# no torch work yet (no OpenMP pool, no GPU context, no threads), so forks start with its
# imports at no cost. Any other caller (a library user, `megaprm convert`, a test calling
# `main`) may have done torch work, and an OpenMP pool is not fork-safe: "forkserver",
# `launch.spawn`'s forks of a server that has only imported them (fresh interpreters, ~3-8 s
# of imports per rank here, where a GPU is present or the environment changed since the
# server started).
RANK_START = "forkserver"


def _run_ranks(fn, world: int, *args) -> list:
    """Run fn on this torchrun world, or start `world` local ranks (`RANK_START`); the leader
    gets all results (under torchrun only its own, as a one-item list). A world of one runs
    in this process: a started rank would still cost a process and its teardown."""
    if launch.under_torchrun():
        return [fn(*args)]
    if world == 1:
        return [_in_process(fn, *args)]
    results = launch.spawn(_catching, world, fn, *args, start_method=RANK_START)
    failed = next((r for r in results if isinstance(r, _Failed)), None)
    if failed:
        raise ConversionError(failed.message)
    return results


def _in_process(fn, *args):
    """fn as the single rank of a world of one in this process; the process group and
    Megatron's parallel state are torn down afterwards (the caller may convert again)."""
    from megatron.core import parallel_state

    try:
        return fn(*args)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_leader() -> bool:
    return not launch.under_torchrun() or int(os.environ["RANK"]) == 0


def _finish(fn: Callable[[], dict]) -> dict:
    """The leader's last step (compare, write, rename). Under torchrun every rank waits for it
    and raises its error too, so no rank runs ahead (e.g. reads a target not yet renamed)."""
    if not launch.under_torchrun():
        return fn()
    report, err = {}, None
    if _is_leader():
        try:
            report = fn()
        except ConversionError as e:
            err = str(e)
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConversionError(box[0])
    return report


# --------------------------------------------------------------------------- checks on weights

def shard_files(hf_dir: str) -> list:
    """The safetensors files of an HF directory (its index's shards, or model.safetensors)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def _hf_shapes(hf_dir: str) -> dict:
    """name -> shape from the safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    files = shard_files(hf_dir)
    shapes = {}
    for fname in files:
        with safe_open(os.path.join(hf_dir, fname), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes


def _expected_hf_shapes(model, spec: ModelSpec, g: Groups) -> dict:
    """HF name -> shape this stage needs, derived through the mapping on meta tensors."""
    out = {}
    for rule, p in mapping.stage_rules(model, spec, g.pp_size, g.pp_rank):
        full = list(p.shape)
        if rule.tp_dim is not None:
            full[rule.tp_dim] *= g.tp_size
        for name, t in mapping.to_hf(rule, torch.empty(full, device="meta"), spec, g.tp_size):
            out[name] = tuple(t.shape)
    return out


def check_hf_weights(hf_dir: str, model, spec: ModelSpec, g: Groups) -> None:
    """Missing / unexpected tensors (whole model, listed) and shape mismatches, before any copy."""
    mine = _expected_hf_shapes(model, spec, g)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    expected = {k: v for part in parts for k, v in part.items()}

    def check():
        have = _hf_shapes(hf_dir)
        # A tied model may also store its lm_head copy; old checkpoints store rope buffers.
        ignorable = {k for k in have if k.endswith("rotary_emb.inv_freq")
                     or (k == "lm_head.weight" and spec.head == "lm" and spec.tie_embeddings)}
        missing = sorted(set(expected) - set(have))
        unexpected = sorted(set(have) - set(expected) - ignorable)
        if missing or unexpected:
            what = []
            if missing:
                what.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
            if unexpected:
                what.append(f"unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
            raise ConversionError(
                f"weights in {hf_dir!r} do not match its config.json ({spec.architecture}, "
                f"{spec.num_layers} layers): {'; '.join(what)}")
        for name in sorted(mine):
            if have[name] != mine[name]:
                raise ConversionError(
                    f"shape mismatch for {name}: config.json implies {list(mine[name])}, "
                    f"the safetensors file has {list(have[name])}")

    _agree("HF weights", check)


def _listing(names: list, limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (f", ... (+{len(names) - limit})" if len(names) > limit
                                       else "")


class FileReads:
    """name -> tensor from HF safetensors files by plain reads (`pread` into a fresh tensor),
    the `get_hf` that `mapping.load_param` calls, and `read_rows` of a tensor into given
    memory (a parameter's rows; see `read_stage`). safetensors' `safe_open` maps the file: every
    page it touches stays in this process's RSS until the handle closes, so an import held the
    whole input file on top of the stage. Here only the tensor being converted is resident (the
    file's pages sit in the page cache, shared and reclaimable). Same bytes, same dtype."""

    _DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
               "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

    def __init__(self, hf_dir: str):
        files = shard_files(hf_dir)
        self._where: dict[str, tuple] = {}
        for fname in files:
            path = os.path.join(hf_dir, fname)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    lo, hi = info["data_offsets"]
                    self._where[name] = (path, 8 + n + lo, hi - lo, info["dtype"],
                                         tuple(info["shape"]))
        self.files = OpenFiles()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        path, offset, nbytes, dtype, shape = self._where[name]
        if dtype not in self._DTYPES:
            raise ConversionError(f"{name} in {path!r}: safetensors dtype {dtype} not supported")
        out = torch.empty(shape, dtype=self._DTYPES[dtype])
        if nbytes != out.numel() * out.element_size():
            raise ConversionError(f"{name} in {path!r}: {nbytes} bytes for shape {list(shape)} "
                                  f"{dtype}; the file is corrupt: re-download or re-save it")
        if nbytes:
            self._read(name, path, offset, _bytes_of(out))
        return out

    def info(self, name: str) -> tuple:
        """(torch dtype or None if unsupported, shape) from the file's header."""
        _, _, _, dtype, shape = self._where[name]
        return self._DTYPES.get(dtype), shape

    def location(self, name: str, first: int = 0) -> tuple:
        """(file path, byte offset of row `first`, bytes from there to the tensor's end)."""
        path, offset, nbytes, _, shape = self._where[name]
        skip = first * (nbytes // shape[0]) if shape else 0
        return path, offset + skip, nbytes - skip

    def read_rows(self, name: str, first: int, dst: memoryview) -> None:
        """Rows first, first+1, ... of `name` (dim 0; as many as fill `dst`) into `dst`."""
        path, offset, left = self.location(name, first)
        if len(dst) > left:
            raise ConversionError(f"{name} in {path!r}: rows {first}.. past its "
                                  f"{self.info(name)[1][0]} rows")
        self._read(name, path, offset, dst)

    def columns_location(self, name: str, first: int, width: int) -> tuple:
        """(file path, byte offset of row 0's column `first`, bytes per row) of a column slice
        of 2-D `name` `width` bytes wide; a `FileCopies` column piece."""
        path, offset, nbytes, dtype, shape = self._where[name]
        row = nbytes // max(shape[0], 1)
        c0 = first * self._DTYPES[dtype].itemsize
        if c0 + width > row:
            raise ConversionError(f"{name} in {path!r}: columns {first}.. of shape "
                                  f"{list(shape)} do not fit {width} bytes a row")
        return path, offset + c0, row

    def read_columns(self, name: str, first: int, dst: torch.Tensor) -> None:
        """Columns first, first+1, ... of 2-D `name` (as many as `dst` [rows, w] has) into
        `dst` (contiguous, same dtype): a row-parallel weight's tp shard, read in runs of rows
        (`read_column_rows`): no fresh buffer of the tensor's size to fault in, no object per
        row."""
        rows, w = dst.shape[0], dst.shape[1] * dst.element_size()
        shape = self.info(name)[1]
        path, offset, row = self.columns_location(name, first, w)
        if rows != shape[0]:
            raise ConversionError(f"{name} in {path!r}: columns {first}.. of shape "
                                  f"{list(shape)} do not fit {tuple(dst.shape)}")
        out = _bytes_of(dst)
        step = max(1, len(chunk_buffer()) // max(row, 1))
        for r in range(0, rows, step):
            k = min(step, rows - r)
            try:
                read_column_rows(self.files.fd(path), offset + r * row, row, w,
                                 out[r * w:(r + k) * w])
            except ShortFile:
                raise ConversionError(f"{name} in {path!r}: the file ends early (truncated); "
                                      "re-download or re-save it") from None

    def _read(self, name: str, path: str, offset: int, view: memoryview) -> None:
        """Positional reads (pread): callable from several threads at once."""
        try:
            read_into(self.files.fd(path), view, offset)
        except ShortFile:
            raise ConversionError(f"{name} in {path!r}: the file ends early (truncated); "
                                  "re-download or re-save it") from None

    def close(self) -> None:
        self.files.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, writable, no copy (any dtype, bf16 included)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def read_column_rows(fd: int, offset: int, row: int, width: int, out: memoryview) -> None:
    """len(out) // width rows of `width` bytes, the first at `offset` of fd and each `row` bytes
    after the last (a column slice of a tensor's rows), into `out` one after another: one read
    of their span into this thread's 4 MiB buffer, one strided copy."""
    import numpy as np

    k = len(out) // width
    span = (k - 1) * row + width
    chunk = chunk_buffer()
    run = chunk[:span] if span <= len(chunk) else memoryview(bytearray(span))
    read_into(fd, run, offset)
    np.frombuffer(out, np.uint8).reshape(k, width)[:] = np.lib.stride_tricks.as_strided(
        np.frombuffer(run, np.uint8), (k, width), (row, 1))


READ_THREADS = 4  # page faults of the fresh stage dominate reads: 2 threads ~2x one, here
READ_PIECE = 8 << 20  # bytes per read job, so that one big tensor spreads over the threads


@torch.no_grad()
def plan_stage(model, reads: FileReads, spec: ModelSpec, g: Groups) -> tuple[list, list, list]:
    """This rank's stage as copies from the HF files: ([(rule, param)] of the parameters that
    the row copies fill, [(hf name, first row, destination bytes)] in READ_PIECE pieces, by
    `mapping.row_blocks`: whole tensors, qkv groups, gate/up halves, vocab rows; and
    [(rule, first column, param)] of the row-parallel weights at tp > 1, each a column slice of
    one HF tensor). A parameter that needs a dtype cast or another layout is loaded here,
    through `mapping.to_megatron_shard`; vocab padding rows are zeroed here."""
    direct, jobs, columns = [], [], []
    for rule, param in mapping.stage_rules(model, spec, g.pp_size, g.pp_rank):
        if _columns_of_one(rule, param, reads, g.tp_size):  # row-parallel at tp > 1
            columns.append((rule, g.tp_rank * param.shape[1], param))
            continue
        blocks = mapping.row_blocks(rule, spec, param.shape[0], g.tp_rank, g.tp_size)
        if blocks is None or param.dim() == 0 or not param.is_contiguous() or not all(
                reads.info(n) == (param.dtype, (reads.info(n)[1][0], *param.shape[1:]))
                for n in rule.hf_names):
            mapping.load_param(rule, param, reads, spec, tp_rank=g.tp_rank, tp_size=g.tp_size)
            continue
        data = _bytes_of(param)
        row = len(data) // param.shape[0] if param.shape[0] else 0
        covered = 0
        for name, src, dst, n in blocks:
            step = max(1, READ_PIECE // max(row, 1))
            for i in range(0, n, step):
                k = min(step, n - i)
                jobs.append((name, src + i, data[(dst + i) * row:(dst + i + k) * row]))
            covered += n
        if covered < param.shape[0]:  # vocab padding: the rows after the vocabulary
            param[covered:].zero_()
        direct.append((rule, param))
    return direct, jobs, columns


def _columns_of_one(rule, param, reads: FileReads, tp_size: int) -> bool:
    """Whether `param` is a column slice of one HF tensor of its dtype (mapping's "row" rule,
    a row-parallel weight, at tp > 1): `FileReads.read_columns` fills it in place, or a
    `FileCopies` column piece writes it without it in memory."""
    return (rule.kind == "row" and tp_size > 1 and param.dim() == 2 and param.is_contiguous()
            and reads.info(rule.hf_names[0]) == (param.dtype, (param.shape[0],
                                                               param.shape[1] * tp_size)))


def _check_finite_param(rule, param: torch.Tensor, reads: FileReads) -> None:
    """NaN/inf in a parameter read from the HF files names the HF tensor(s) holding it."""
    # a sum is finite iff every term is (or it overflowed: then the exact test decides)
    if not math.isfinite(float(param.sum())) and not torch.isfinite(param).all():
        bad = [n for n in rule.hf_names if not torch.isfinite(reads(n)).all()]
        raise ValueError(f"HF tensor {', '.join(bad or rule.hf_names)} holds NaN/inf: the "
                         "checkpoint is corrupt; re-download or re-save it")


@torch.no_grad()
def read_stage(model, reads: FileReads, spec: ModelSpec, g: Groups) -> None:
    """Fill this rank's stage from HF files: each parameter's rows are read from the files
    straight into its storage (`plan_stage`), no temporary, by READ_THREADS threads. NaN/inf
    name the tensor."""
    from concurrent.futures import ThreadPoolExecutor

    direct, jobs, columns = plan_stage(model, reads, spec, g)
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for f in [pool.submit(reads.read_rows, *job) for job in jobs]:
            f.result()
    for rule, first, param in columns:
        reads.read_columns(rule.hf_names[0], first, param)
    for rule, param in [*direct, *((rule, param) for rule, _, param in columns)]:
        _check_finite_param(rule, param, reads)


def _address(view) -> int:
    """Address of a buffer's first byte (read-only buffers too), without touching its pages."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class FileCopies:
    """Parameter bytes that a torch_dist save copies file to file from the HF shards instead
    of from memory (an import that does not verify never needs the weights in memory).

    The stage is built with `torch.empty` and never touched, so its pages are not even
    resident. torch.save hands a tensor's storage to its stream in one `write`; `stream`
    wraps the writer's file so that the parts of a write that are registered here leave a
    hole (a seek) and `fill` then copies the HF bytes into the holes with `copy_file_range`
    (page cache to page cache in the kernel; plain reads and writes where it is refused).
    The file holds the same bytes as a save from memory: one read and one write of the
    weights, no fresh memory to fault in. A column piece (a row-parallel weight's tp shard:
    each of its rows `width` bytes of an HF row `row` bytes long) is filled through this
    thread's reused buffers instead: runs of whole HF rows read, their columns gathered,
    written in WRITE_PIECE writes."""

    def __init__(self, pieces: list, tensors: list = (), files: OpenFiles | None = None):
        """pieces: [(address, nbytes, HF file path, byte offset in it)], not overlapping;
        a column piece adds (bytes per HF row, bytes per piece row): its k-th byte is at
        offset + (k // width) * row + k % width; tensors: those the save may write (the
        stage's parameters; see `check_source`); files: where the HF files are opened (the
        caller closes them)."""
        import bisect

        self._bisect = bisect.bisect_right
        self._spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.itemsize)
                             for t in tensors)
        self._pieces = sorted((*p[:4], tuple(p[4:]) or None) for p in pieces)
        self._starts = [p[0] for p in self._pieces]
        self._files = files if files is not None else OpenFiles()

    @classmethod
    def for_jobs(cls, reads: FileReads, jobs: list, model, columns: list = ()) -> FileCopies:
        """The pieces of `plan_stage`'s jobs (hf name, first row, destination bytes) and
        column slices (rule, first column, param)."""
        pieces = []
        for name, first, view in jobs:
            path, offset, _ = reads.location(name, first)
            pieces.append((_address(view), len(view), path, offset))
        for rule, first, param in columns:
            width = param.shape[1] * param.element_size()
            path, offset, row = reads.columns_location(rule.hf_names[0], first, width)
            pieces.append((param.data_ptr(), param.shape[0] * width, path, offset, row, width))
        return cls(pieces, list(model.parameters()), reads.files)

    def check_source(self, data) -> None:
        """A tensor the save writes must lie in a parameter: a copy of one (a clone the writer
        made) would hold the never-written memory, not the weights."""
        if isinstance(data, torch.Tensor) and data.numel():
            lo = data.data_ptr()
            hi = lo + data.numel() * data.itemsize
            i = self._bisect(self._spans, (lo, float("inf"))) - 1
            if i < 0 or not self._spans[i][0] <= lo < hi <= self._spans[i][1]:
                raise RuntimeError(
                    "torch_dist save wrote a tensor that is not a parameter of the stage "
                    f"({tuple(data.shape)} {data.dtype}): the file copies cannot fill it; "
                    "import with verification on (it loads the weights into memory)")

    def split(self, addr: int, n: int) -> list:
        """[(lo, hi, (path, offset) or None)] covering [addr, addr + n) in order: None = from
        memory, else the HF bytes at `offset` of `path` fill [lo, hi) of the write; for a
        column piece (path, piece offset, row, width, first byte of the piece) instead."""
        out, pos = [], addr
        i = max(0, self._bisect(self._starts, addr) - 1)
        while pos < addr + n and i < len(self._pieces):
            start, size, path, offset, cols = self._pieces[i]
            if start + size <= pos:
                i += 1
                continue
            if start >= addr + n:
                break
            if start > pos:
                out.append((pos - addr, start - addr, None))
                pos = start
            end = min(start + size, addr + n)
            src = (path, offset + pos - start) if cols is None else (path, offset, *cols,
                                                                     pos - start)
            out.append((pos - addr, end - addr, src))
            pos = end
            i += 1
        if pos < addr + n:
            out.append((pos - addr, n, None))
        return out

    def stream(self, raw):
        return _HoleStream(raw, self)

    def fill(self, raw, holes: list) -> None:
        if not holes:
            return
        raw.flush()
        dst = raw.fileno()
        for pos, n, src in holes:
            path = src[0]
            try:
                if len(src) == 2:
                    copy_range(self._files.fd(path), dst, n, src[1], pos)
                else:
                    self._fill_columns(dst, pos, n, *src)
            except ShortFile:
                raise ConversionError(f"{path!r} ended early while it was copied (truncated or "
                                      "changed during the import); re-download or re-save it"
                                      ) from None

    def _fill_columns(self, dst: int, pos: int, n: int, path: str, offset: int, row: int,
                      width: int, skip: int) -> None:
        """Bytes [skip, skip + n) of a column piece (see __init__) to `pos` of fd dst: runs of
        its rows gathered into this thread's "gather" buffer (`read_column_rows`), written from
        there in WRITE_PIECE writes."""
        src, staging = self._files.fd(path), chunk_buffer("gather")
        step = max(1, min(len(chunk_buffer()) // row, len(staging) // width))
        r, last = skip // width, -(-(skip + n) // width)  # piece rows holding the bytes
        while r < last:
            k = min(step, last - r)
            out = (staging[:k * width] if k * width <= len(staging)
                   else memoryview(bytearray(k * width)))
            read_column_rows(src, offset + r * row, row, width, out)
            lo, hi = max(skip, r * width), min(skip + n, (r + k) * width)
            pwrite_all(dst, out[lo - r * width:], hi - lo, pos + lo - skip, WRITE_PIECE)
            r += k


class _HoleStream:
    """The writer's file as torch.save sees it: registered bytes become holes (see FileCopies)."""

    def __init__(self, raw, copies: FileCopies):
        self.raw, self.copies, self.holes = raw, copies, []

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        pos = self.raw.tell()
        for lo, hi, src in self.copies.split(_address(view), n):
            if src is None:
                write_all(self.raw.write, view[lo:hi])
            else:
                self.holes.append((pos + lo, hi - lo, src))
                self.raw.seek(pos + hi)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()


def check_finite(reads: FileReads, jobs: list, columns: list = ()) -> None:
    """NaN/inf in the HF bytes that `plan_stage`'s jobs and column slices copy names the
    tensor. Only this rank's part is checked (at tp > 1 each rank copies its rows or columns of
    a tensor); the copies never pass through memory here: each run of consecutive rows (each
    column slice's tensor) is mapped, summed and unmapped, so at most one is resident."""
    import mmap

    runs: list = []  # [name, first row, bytes], consecutive jobs of a tensor merged
    for name, first, view in jobs:
        last = runs[-1] if runs else None
        if last and last[0] == name and reads.location(name, last[1])[1] + last[2] == \
                reads.location(name, first)[1]:
            last[2] += len(view)
        else:
            runs.append([name, first, len(view)])
    checks = [(name, *reads.location(name, first)[:2], nbytes, None)
              for name, first, nbytes in runs]
    checks += [(rule.hf_names[0], *reads.location(rule.hf_names[0])[:3],
                (first, param.shape[1])) for rule, first, param in columns]
    for name, path, offset, nbytes, cols in checks:
        dtype, shape = reads.info(name)
        if not nbytes or dtype is None or not dtype.is_floating_point:
            continue
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes + offset - start, access=mmap.ACCESS_COPY,
                           offset=start)
        t = None
        try:
            t = torch.frombuffer(mm, dtype=dtype, offset=offset - start,
                                 count=nbytes // dtype.itemsize)
            if cols is not None:  # this rank's columns of the whole tensor
                t = t.view(shape[0], -1)[:, cols[0]:cols[0] + cols[1]]
            if not math.isfinite(float(t.sum())) and not torch.isfinite(t).all():
                raise ValueError(f"HF tensor {name} holds NaN/inf: the checkpoint is corrupt; "
                                 "re-download or re-save it")
        finally:
            del t  # no view of the mapping may outlive it
            mm.close()


# ---------------------------------------------------------------------- Megatron checkpoints

def _model_dir(ckpt_dir: str) -> str:
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
    (BENCHMARKS.md)."""
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
        return torch.frombuffer(_bytes_of(obj), dtype=torch.uint8).view(obj.dtype).view(
            obj.shape)
    return obj


def _import_writer_modules() -> None:
    """Import what a torch_dist save imports lazily (its writer, DCP's filesystem layer)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401


def _import_loader_modules() -> None:
    """Import what a torch_dist load (or a streaming export) imports lazily."""
    from megatron.core.dist_checkpointing import dict_utils, mapping  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401
    from torch.distributed.checkpoint import filesystem, metadata  # noqa: F401

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
    It cost ~0.05 s of a tp2 import's ~0.4 s save on two cores (BENCHMARKS.md)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(ckpt_model_dir, exist_ok=True)
    dist.barrier()
    with threaded_writers(fsync, copies):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        dist_checkpointing.save(stages.sharded_state_dict(model), ckpt_model_dir,
                                sharded_strategy=save_strategy(writer_threads(local)),
                                validate_access_integrity=False)


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

    _agree("loading the checkpoint", load)


# --------------------------------------------------------------------------------- rank halves

def _rank_report(g: Groups, outputs, **extra) -> dict:
    rss = [None] * g.world_size
    dist.all_gather_object(rss, peak_rss_mb())
    return {"rank": g.rank, "peak_rss_mb_ranks": rss,
            "outputs": outputs if g.rank == 0 else None, **extra}


def _import_rank(hf_dir: str, out_dir: str, tmp_dir: str | None, tp: int, pp: int,
                 dtype: str, verify: bool) -> dict:
    g = _init(tp, pp)
    with _shared_tmp(tmp_dir, out_dir) as tmp:
        spec = spec_from_hf(hf_dir)
        model = stages.build(spec, g, DTYPES[dtype], init=False)  # every weight is loaded
        check_hf_weights(hf_dir, model, spec, g)
        weights = FileReads(hf_dir)
        _import_writer_modules()  # ~0.15 s of module loading: process start, not conversion
        t0 = time.perf_counter()
        copies = None  # None: the save writes the weights from memory
        try:
            if verify:  # the forward needs the weights in memory
                _agree("HF weights", functools.partial(read_stage, model, weights, spec, g))
            else:
                _, jobs, columns = _agree("HF weights", functools.partial(
                    plan_stage, model, weights, spec, g))
                copies = FileCopies.for_jobs(weights, jobs, model, columns)
                _agree("HF weights", functools.partial(check_finite, weights, jobs, columns))
            t_read = time.perf_counter() - t0
            save_checkpoint(model, _model_dir(tmp), copies=copies)
        finally:
            weights.close()  # the HF files the copies read too
        t_save = time.perf_counter() - t0 - t_read
        outputs, t_verify = None, 0.0
        if verify:  # the weights as loaded and saved, still in memory; re-reading the
            # written checkpoint is the `verify` command's job
            t1 = time.perf_counter()
            outputs = stages.full_outputs(model, spec, g, verify_batch(spec))
            t_verify = time.perf_counter() - t1
        return _rank_report(g, outputs, tmp_dir=tmp, read_s=t_read, save_s=t_save,
                            verify_s=t_verify)


def _export_rank(ckpt_dir: str, out_dir: str, tmp_dir: str | None, tp: int, pp: int,
                 max_shard_bytes: int, verify: bool) -> dict:
    """One rank of export-hf. A torchrun world of one without verification streams file to
    file (`_export_streaming`) where the checkpoint allows it, else loads the stage (outside
    torchrun `export_hf` has tried the stream in its own process before starting ranks)."""
    from checkpoint_tools.shards import ShardWriter
    from megaprm.rollout.weight_sync import iter_hf_weights

    g = _init(tp, pp)
    with _shared_tmp(tmp_dir, out_dir) as tmp:
        meta = layout.CheckpointMeta.read(ckpt_dir)
        spec = spec_from_hf(os.path.join(ckpt_dir, layout.HF_SUBDIR))
        why = {}
        if g.world_size == 1 and not verify and launch.under_torchrun():
            # nothing needs the weights in memory
            streamed = _export_streaming(ckpt_dir, spec, DTYPES[meta.dtype], tmp,
                                         max_shard_bytes)
            if streamed["streamed"]:
                return _rank_report(g, None, tmp_dir=tmp, verify_s=0.0, **streamed)
            why = {"why": streamed["why"]}
        model = stages.build(spec, g, DTYPES[meta.dtype], init=False)
        _import_loader_modules()  # module loading: process start, not conversion
        t0 = time.perf_counter()
        load_checkpoint(model, _model_dir(ckpt_dir))
        t_load = time.perf_counter() - t0
        writer = ShardWriter(tmp, max_shard_bytes) if g.rank == 0 else None
        for name, tensor in iter_hf_weights(model, g, spec):
            if writer is not None:  # other ranks take part in the gathers, drop the tensors
                writer.add(name, tensor)
        files = writer.finish() if writer is not None else None
        t_write = time.perf_counter() - t0 - t_load
        t1 = time.perf_counter()
        outputs = stages.full_outputs(model, spec, g, verify_batch(spec)) if verify else None
        return _rank_report(g, outputs, tmp_dir=tmp, load_s=t_load, write_s=t_write,
                            verify_s=time.perf_counter() - t1,
                            files=files, bytes=writer.total_bytes if writer else None,
                            peak_shard_bytes=writer.peak_pending_bytes if writer else None,
                            **why)


def _export_streaming(ckpt_dir: str, spec: ModelSpec, dtype: torch.dtype, tmp: str,
                      max_shard_bytes: int) -> dict:
    """export-hf file to file (`streaming.plan_export`, `streaming.write_shards`), or
    {"streamed": False, "why": ...} where the checkpoint needs a real load (then nothing was
    written). Whatever tp and pp the checkpoint was saved at (its chunks are in global
    coordinates); needs neither megatron-core nor a process group."""
    from checkpoint_tools import streaming

    t0 = time.perf_counter()
    try:
        plan = streaming.plan_export(_model_dir(ckpt_dir), spec, dtype)
    except streaming.NotStreamable as e:
        return {"streamed": False, "why": str(e)}
    t_plan = time.perf_counter() - t0
    writer, files = streaming.write_shards(plan, tmp, max_shard_bytes)
    return {"load_s": t_plan, "write_s": time.perf_counter() - t0 - t_plan, "files": files,
            "bytes": writer.total_bytes, "peak_shard_bytes": writer.peak_pending_bytes,
            "streamed": True}


def _verify_rank(ckpt_dir: str, tp: int, pp: int) -> dict:
    g = _init(tp, pp)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    spec = spec_from_hf(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    model = stages.build(spec, g, DTYPES[meta.dtype], init=False)
    load_checkpoint(model, _model_dir(ckpt_dir))
    return _rank_report(g, stages.full_outputs(model, spec, g, verify_batch(spec)))


# ------------------------------------------------------------------------------ leader halves

def compare(megatron: torch.Tensor, reference: torch.Tensor, dtype: str,
            atol: float | None = None, min_top1: float | None = None) -> dict:
    """Logit agreement report. Default tolerance: relative to the largest |reference logit|
    (1e-4 in fp32; 3e-2 in bf16/fp16, where both sides compute in that dtype)."""
    diff = (megatron - reference).abs()
    scale = max(1.0, float(reference.abs().max()))
    tol = atol if atol is not None else (1e-4 if dtype == "fp32" else 3e-2) * scale
    need_top1 = min_top1 if min_top1 is not None else (1.0 if dtype == "fp32" else 0.9)
    top1 = float((megatron.argmax(-1) == reference.argmax(-1)).float().mean())
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "top1_agreement": top1, "tolerance": tol, "min_top1": need_top1,
            "shape": list(reference.shape), "dtype": dtype,
            "passed": bool(float(diff.max()) <= tol and top1 >= need_top1)}


def reference_outputs(hf_dir: str, spec: ModelSpec, dtype: str) -> torch.Tensor:
    from checkpoint_tools import hf_reference

    model = hf_reference.load_reference(hf_dir, spec, DTYPES[dtype])
    return hf_reference.reference_outputs(model, spec, verify_batch(spec))


def _world(tp: int, pp: int) -> int:
    return int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else tp * pp


def _rss(results: list) -> dict:
    return {"peak_rss_mb": {"ranks": results[0]["peak_rss_mb_ranks"], "driver": peak_rss_mb()}}


def _discard(tmp_dir: str | None) -> None:
    if tmp_dir and os.path.isdir(tmp_dir):
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _verified(what: str, megatron: torch.Tensor, hf_dir: str, spec: ModelSpec, dtype: str,
              rank_s: float) -> dict:
    """Compare with transformers; `seconds` = the ranks' forward + the reference (timed apart
    from the conversion)."""
    t0 = time.perf_counter()
    report = compare(megatron, reference_outputs(hf_dir, spec, dtype), dtype)
    report["seconds"] = rank_s + time.perf_counter() - t0
    if not report["passed"]:
        raise ConversionError(
            f"{what}: Megatron outputs differ from transformers beyond tolerance (max abs diff "
            f"{report['max_abs_diff']:.3g} > {report['tolerance']:.3g} or top-1 agreement "
            f"{report['top1_agreement']:.3f} < {report['min_top1']}); nothing was written "
            "(--no-verify keeps the result for debugging)")
    return report


def _leader_owned(tmp_dir: str | None, fn: Callable[[], dict]) -> dict:
    """Run the leader's finishing step; the tmp dir goes away unless it was renamed."""
    try:
        return fn()
    finally:
        _discard(tmp_dir)  # after a successful rename the path no longer exists


def import_hf(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1,
              dtype: str | None = None, force: bool = False, verify: bool = True) -> dict:
    """HF directory -> megaprm checkpoint directory (see `layout`). Returns a report dict."""
    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    spec = load_spec(hf_dir)
    check_layout(spec, tp, pp)
    layout.check_target(out_dir, force)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    dtype = dtype or layout.hf_dtype_name(spec.hf_config)
    try:  # opens every file's header: truncated or corrupt files fail here, before any rank
        mapping.HFWeights(hf_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None
    tmp_dir = None if launch.under_torchrun() else layout.make_tmp(out_dir)
    t0 = time.perf_counter()
    try:
        results = _run_ranks(_import_rank, _world(tp, pp), hf_dir, out_dir, tmp_dir, tp, pp,
                             dtype, verify)
    except BaseException:
        _discard(tmp_dir)
        raise
    r0 = results[0]

    def finish() -> dict:
        report = {"command": "import-hf", "hf": hf_dir, "out": out_dir, "tp": tp, "pp": pp,
                  "dtype": dtype, "architecture": spec.architecture,
                  "seconds": time.perf_counter() - t0, "core_s": r0["read_s"] + r0["save_s"],
                  "read_s": r0["read_s"], "save_s": r0["save_s"], **_rss(results)}
        report["verify"] = _verified("import-hf", r0["outputs"], hf_dir, spec, dtype,
                                     r0["verify_s"]) if verify else SKIPPED
        layout.copy_side_files(hf_dir, os.path.join(r0["tmp_dir"], layout.HF_SUBDIR))
        layout.CheckpointMeta(format=layout.FORMAT, version=1, architecture=spec.architecture,
                              dtype=dtype, tp=tp, pp=pp, source=hf_dir).write(r0["tmp_dir"])
        manifest.write(r0["tmp_dir"], format=layout.FORMAT, version=1)  # last: seals the files
        layout.commit(r0["tmp_dir"], out_dir, force)
        return report

    return _finish(lambda: _leader_owned(r0["tmp_dir"], finish))


def _write_hf_config(ckpt_dir: str, tmp_dir: str, dtype: str) -> None:
    """Side files verbatim; config.json's dtype follows the exported weights if they differ."""
    layout.copy_side_files(os.path.join(ckpt_dir, layout.HF_SUBDIR), tmp_dir)
    path = os.path.join(tmp_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if layout.hf_dtype_name(cfg) != dtype:
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = layout.HF_DTYPE_NAME[dtype]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)


def export_hf(ckpt_dir: str, out_dir: str, *, tp: int | None = None,
              pp: int | None = None, max_shard_size: str = "5GB", force: bool = False,
              verify: bool = True, model: str = "actor") -> dict:
    """megaprm checkpoint -> HF directory loadable by transformers / vLLM. Returns a report.

    `ckpt_dir` is anything `layout.resolve_checkpoint` accepts (a checkpoint, a trainer step,
    run or checkpoints dir); `model` picks the trainer's `actor` or `prm`."""
    ckpt_dir = layout.resolve_checkpoint(ckpt_dir, model)
    out_dir = os.path.abspath(out_dir)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    manifest.check(ckpt_dir, ConversionError)
    spec = load_spec(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    tp, pp = tp or meta.tp, pp or meta.pp
    check_layout(spec, tp, pp)
    layout.check_target(out_dir, force)
    max_bytes = layout.parse_size(max_shard_size)
    tmp_dir = None if launch.under_torchrun() else layout.make_tmp(out_dir)
    t0 = time.perf_counter()
    try:
        results, why = None, None
        if not verify and not launch.under_torchrun():
            # file to file in this process, whatever tp and pp the checkpoint was saved at:
            # no ranks, no process group, no megatron-core import (`streaming`)
            streamed = _export_streaming(ckpt_dir, spec, DTYPES[meta.dtype], tmp_dir,
                                         max_bytes)
            if streamed["streamed"]:
                results = [{"rank": 0, "outputs": None, "tmp_dir": tmp_dir, "verify_s": 0.0,
                            "peak_rss_mb_ranks": [peak_rss_mb()], **streamed}]
            else:
                why = streamed["why"]
        if results is None:
            results = _run_ranks(_export_rank, _world(tp, pp), ckpt_dir, out_dir, tmp_dir, tp,
                                 pp, max_bytes, verify)
    except BaseException:
        _discard(tmp_dir)
        raise
    r0 = results[0]

    def finish() -> dict:
        _write_hf_config(ckpt_dir, r0["tmp_dir"], meta.dtype)
        report = {"command": "export-hf", "ckpt": ckpt_dir, "out": out_dir, "tp": tp, "pp": pp,
                  "dtype": meta.dtype, "architecture": meta.architecture,
                  "seconds": time.perf_counter() - t0, "core_s": r0["load_s"] + r0["write_s"],
                  "load_s": r0["load_s"], "write_s": r0["write_s"], "files": r0["files"],
                  "bytes": r0["bytes"],
                  "peak_shard_bytes": r0["peak_shard_bytes"],
                  "streamed": r0.get("streamed", False), **_rss(results)}
        if not report["streamed"] and not verify:
            report["not_streamed_because"] = why or r0.get("why")
        report["verify"] = _verified("export-hf", r0["outputs"], r0["tmp_dir"], spec,
                                     meta.dtype, r0["verify_s"]) if verify else SKIPPED
        layout.commit(r0["tmp_dir"], out_dir, force)
        return report

    return _finish(lambda: _leader_owned(r0["tmp_dir"], finish))


def verify(hf_dir: str, ckpt_dir: str, *, tp: int = 1, pp: int = 1,
           atol: float | None = None, min_top1: float | None = None,
           model: str = "actor") -> dict:
    """Forward the fixed batch through transformers (hf_dir) and Megatron (ckpt_dir at tp/pp,
    resolved like export-hf's); the report's `passed` says whether they agree within tolerance."""
    hf_dir, ckpt_dir = os.path.abspath(hf_dir), layout.resolve_checkpoint(ckpt_dir, model)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    manifest.check(ckpt_dir, ConversionError)
    spec = load_spec(hf_dir)
    try:  # the reference model reads these: a truncated file is named here, not in a traceback
        mapping.HFWeights(hf_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None
    ckpt_spec = load_spec(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    if ckpt_spec != spec:
        raise ConversionError(f"{hf_dir!r} ({spec.architecture}) and checkpoint {ckpt_dir!r} "
                              f"({ckpt_spec.architecture}) describe different models")
    check_layout(spec, tp, pp)
    results = _run_ranks(_verify_rank, _world(tp, pp), ckpt_dir, tp, pp)

    def finish() -> dict:
        report = compare(results[0]["outputs"], reference_outputs(hf_dir, spec, meta.dtype),
                         meta.dtype, atol, min_top1)
        return {"command": "verify", "hf": hf_dir, "ckpt": ckpt_dir, "tp": tp, "pp": pp,
                **report, **_rss(results)}

    return _finish(finish)

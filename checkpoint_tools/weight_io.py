"""HF safetensors weights in and out of a rank's stage without holding the files: plain
positional reads into the parameters' storage (`FileReads`, `read_stage`), or file-to-file
copies into the torch_dist files a save writes (`FileCopies`), with the shape and NaN/inf
checks that name the HF tensor at fault."""
from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from checkpoint_tools.layout import ConversionError
from checkpoint_tools.ranks import agree
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
from megaprm.models.hf_spec import ModelSpec
from megaprm.parallel.groups import Groups


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
    for rule, p in mapping.stage_rules(model, spec, g.pp_size, g.pp_rank, ep=g.ep_size,
                                       ep_rank=g.ep_rank):
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

    agree("HF weights", check)


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
            self._read(name, path, offset, bytes_of(out))
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
        out = bytes_of(dst)
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


def bytes_of(t: torch.Tensor) -> memoryview:
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


READ_THREADS = 4  # page faults of the fresh stage dominate reads: 2 threads ~2x one (2-core VM)


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
    for rule, param in mapping.stage_rules(model, spec, g.pp_size, g.pp_rank, ep=g.ep_size,
                                           ep_rank=g.ep_rank):
        if _columns_of_one(rule, param, reads, g.tp_size):  # row-parallel at tp > 1
            columns.append((rule, g.tp_rank * param.shape[1], param))
            continue
        blocks = mapping.row_blocks(rule, spec, param.shape[0], g.tp_rank, g.tp_size)
        if blocks is None or param.dim() == 0 or not param.is_contiguous() or not all(
                reads.info(n) == (param.dtype, (reads.info(n)[1][0], *param.shape[1:]))
                for n in rule.hf_names):
            mapping.load_param(rule, param, reads, spec, tp_rank=g.tp_rank, tp_size=g.tp_size)
            continue
        data = bytes_of(param)
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

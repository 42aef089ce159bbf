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

import errno
import json
import os
import threading

import torch

from megaprm.parallel.device import to_host

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class FileBytes:
    """A tensor that is (path, offset, size) byte ranges of files, in order: written by copying
    the ranges (a streaming export never holds it). Has what the writers ask of a tensor."""

    def __init__(self, dtype: torch.dtype, shape: tuple, pieces: list):
        self.dtype, self.shape, self.pieces = dtype, torch.Size(shape), pieces

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize


class Assembled:
    """A tensor whose file bytes are blocks of its rows x columns (a row-parallel weight saved
    in column-split chunks): `parts` = [(path, file offset, first row, rows, column byte, bytes
    per row)], each block's bytes contiguous in its file, row after row. Written by reading
    every block into its place in a buffer (`assemble`): a scratch buffer of the tensor's size
    for page-cache writes, the bounce buffers themselves with O_DIRECT
    (`_DirectFile.write_assembled`, whole rows at a time)."""

    def __init__(self, dtype: torch.dtype, shape: tuple, row_bytes: int, parts: list):
        self.dtype, self.shape, self.row_bytes, self.parts = dtype, torch.Size(shape), \
            row_bytes, parts

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def assemble(self, files: OpenFiles, buf: memoryview, first_row: int = 0,
                 last_row: int | None = None) -> memoryview:
        """Rows [first_row, last_row) of the tensor (default: all) in `buf`, which starts at
        `first_row`: each block is read in contiguous runs of its rows (one `pread` of up to
        4 MiB into a per-thread buffer), each run copied into its columns by one strided copy.
        (A scatter read of every row into its place made one Python object per row: 40k for
        a 424 MB model at tp 2, ~0.1 s with the garbage collections they cause.)"""
        import numpy as np

        row = self.row_bytes
        last_row = self.shape[0] if last_row is None else last_row
        out = buf[:(last_row - first_row) * row]
        grid = np.frombuffer(out, np.uint8).reshape(last_row - first_row, row)
        chunk = chunk_buffer()
        for path, offset, r0, n, c0, w in self.parts:
            lo, hi = max(r0, first_row), min(r0 + n, last_row)
            if lo >= hi:
                continue
            fd, step = files.fd(path), max(1, len(chunk) // w)
            for first in range(lo, hi, step):
                k = min(step, hi - first)
                run = chunk[:k * w] if k * w <= len(chunk) else memoryview(bytearray(k * w))
                read_into(fd, run, offset + (first - r0) * w)
                grid[first - first_row:first - first_row + k, c0:c0 + w] = \
                    np.frombuffer(run, np.uint8).reshape(k, w)
        return out


_RUNS = threading.local()


def chunk_buffer(slot: str = "read") -> memoryview:
    """This thread's 4 MiB buffer named `slot` (reads of runs of rows: `Assembled.assemble`,
    the import's column reads; "gather": the columns a column piece writes). Reused: fresh
    memory costs a page fault per 4 KiB on the development VM."""
    buf = getattr(_RUNS, slot, None)
    if buf is None:
        buf = memoryview(bytearray(4 << 20))
        setattr(_RUNS, slot, buf)
    return buf


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None,
                      direct: bool = True, scratch: list | None = None) -> None:
    """One safetensors file from name -> CPU tensor (non-contiguous ones are made contiguous
    one at a time). `direct`: write with O_DIRECT where the file system allows it (see
    `_DirectFile`), else through the page cache. `scratch`: a one-item list holding the
    buffer `Assembled` tensors are built in, reused across calls (grown as needed): fresh
    memory costs page faults on every tensor."""
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
    f = _DirectFile(path) if direct else _BufferedFile(path)
    sources = None  # Assembled tensors' files
    try:
        f.write(memoryview(len(raw).to_bytes(8, "little") + raw))
        for t in tensors.values():
            if isinstance(t, FileBytes):
                for src, offset, size in t.pieces:
                    f.copy_from(src, offset, size)
            elif isinstance(t, Assembled) and isinstance(f, _DirectFile) and f.direct:
                if sources is None:
                    sources = OpenFiles()
                f.write_assembled(t, sources)
            elif isinstance(t, Assembled):
                scratch = scratch if scratch is not None else [None]
                need = t.numel() * t.element_size()
                if scratch[0] is None or len(scratch[0]) < need:
                    scratch[0] = memoryview(bytearray(need))
                if sources is None:
                    sources = OpenFiles()
                f.write(t.assemble(sources, scratch[0]))
            elif t.numel():
                f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    finally:
        if sources is not None:
            sources.close()
        f.close()


class OpenFiles:
    """Read-only descriptors of source files, each opened once; safe from several threads."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class ShortFile(OSError):
    """A source file ended before the bytes it should hold (truncated, or changed meanwhile)."""


def read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset` of fd (positional reads; a read may return short)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise ShortFile(f"a file ends early (at byte {offset + got})")
        got += n


# copy_file_range refusals that mean "not between these files": fall back to reads and writes
_NO_COPY_RANGE = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)


# Page-cache writes from memory go in pieces of at most this many bytes. Linux sizes the page
# cache folios of a buffered write by its length (ext4 takes large folios since 6.x): one 8 MiB
# write asks for 2 MiB folios, whole free 2 MiB blocks, and on a VM those are likely the ones
# free page reporting has handed back to the host, faulted in again there. Measured on a
# 2-core Firecracker VM (kernel 6.18, 96 MB written per file; docs/benchmark-history.md):
# pieces of 2 MiB or more 0.02-0.48 s a file (above 0.15 s in 14 of 36 files), 1 MiB or less
# 0.026-0.048 s in 38 of 39; `copy_file_range` (page by page through a pipe) was not affected.
WRITE_PIECE = 1 << 20


def write_all(write, data: memoryview) -> None:
    """All of `data` through `write` (a file's write: returns how many bytes it took), in
    pieces of at most WRITE_PIECE bytes."""
    pos = 0
    while pos < len(data):
        pos += write(data[pos:pos + WRITE_PIECE])


def pwrite_all(fd: int, buf: memoryview, nbytes: int, pos: int, piece: int | None = None
                ) -> None:
    """nbytes of buf at pos of fd, in writes of at most `piece` bytes (None: one write; for
    O_DIRECT, which bypasses the page cache)."""
    view = buf[:nbytes]
    while view:
        done = os.pwrite(fd, view[:piece] if piece else view, pos)
        view, pos = view[done:], pos + done


def copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    """n bytes from src_off of fd src to dst_off of fd dst: `copy_file_range` (page cache to
    page cache in the kernel), else positional reads and writes through an 8 MiB buffer."""
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
            if not k:
                raise ShortFile(f"a file ends early (at byte {src_off + done})")
            done += k
        return
    except ShortFile:
        raise
    except OSError as e:
        if e.errno not in _NO_COPY_RANGE:
            raise
    buf = memoryview(bytearray(min(n - done, 8 << 20)))
    while done < n:
        k = min(len(buf), n - done)
        read_into(src, buf[:k], src_off + done)
        pwrite_all(dst, buf, k, dst_off + done, WRITE_PIECE)
        done += k


class _BufferedFile:
    def __init__(self, path: str):
        self._f = open(path, "wb", buffering=0)  # noqa: SIM115
        self._sources = OpenFiles()

    def write(self, data: memoryview) -> None:
        write_all(self._f.write, data)

    def copy_from(self, path: str, offset: int, size: int) -> None:
        """size bytes at offset of path, appended (`copy_range`)."""
        pos = self._f.tell()
        copy_range(self._sources.fd(path), self._f.fileno(), size, offset, pos)
        self._f.seek(pos + size)

    def close(self) -> None:
        self._sources.close()
        self._f.close()


class _DirectFile:
    """Sequential writes with O_DIRECT through aligned bounce buffers: the bytes go to the
    device without first growing the page cache. On the development VM, growing the page cache into
    memory that has been free for a while costs ~2.5 s/GB (host-side faults), O_DIRECT
    ~0.55 s/GB (measured with dd; a buffered streaming export of 2.4 GB took a median 6.2 s
    against 1.8 s with O_DIRECT, see `streaming.write_shards`). A full buffer goes to a writer
    thread while the caller fills the next one (an O_DIRECT write is synchronous: without the
    overlap, filling and writing add up).
    The file's last partial block is written padded and the file cut to size. Falls back to
    plain writes where O_DIRECT is refused (tmpfs)."""

    BLOCK = 8 << 20  # one bounce buffer: a multiple of any logical block size
    BUFFERS = 3

    def __init__(self, path: str):
        import mmap
        import queue
        import threading

        self._fd = None
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except (OSError, AttributeError):
            self._plain = _BufferedFile(path)
            return
        self._plain = None
        self._bufs = [mmap.mmap(-1, self.BLOCK) for _ in range(self.BUFFERS)]  # page-aligned
        self._views = [memoryview(b) for b in self._bufs]
        self._free: queue.Queue = queue.Queue()
        self._todo: queue.Queue = queue.Queue()
        for i in range(1, self.BUFFERS):
            self._free.put(i)
        self._cur, self._view = 0, self._views[0]
        self._fill = self._pos = self._size = 0
        self._error: BaseException | None = None
        self._sources = OpenFiles()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

    def write(self, data: memoryview) -> None:
        if self._plain is not None:
            self._plain.write(data)
            return
        data = data.cast("B")
        while data:
            n = min(len(data), self.BLOCK - self._fill)
            self._view[self._fill:self._fill + n] = data[:n]
            self._fill, data, self._size = self._fill + n, data[n:], self._size + n
            if self._fill == self.BLOCK:
                self._submit(self.BLOCK)

    def copy_from(self, path: str, offset: int, size: int) -> None:
        """size bytes at offset of path, appended: read straight into the bounce buffer."""
        if self._plain is not None:
            self._plain.copy_from(path, offset, size)
            return
        src, done = self._sources.fd(path), 0
        while done < size:
            n = min(size - done, self.BLOCK - self._fill)
            read_into(src, self._view[self._fill:self._fill + n], offset + done)
            self._fill, done, self._size = self._fill + n, done + n, self._size + n
            if self._fill == self.BLOCK:
                self._submit(self.BLOCK)

    @property
    def direct(self) -> bool:
        return self._plain is None

    def write_assembled(self, t: Assembled, files: OpenFiles) -> None:
        """Append an `Assembled` tensor, assembled in the bounce buffer as many whole rows at a
        time as fit (no scratch buffer of the tensor's size); a row that straddles the
        buffer's end goes through a one-row buffer."""
        rows, row = t.shape[0], t.row_bytes
        r, one = 0, None
        while r < rows:
            k = min((self.BLOCK - self._fill) // row, rows - r)
            if k == 0:
                one = one if one is not None else memoryview(bytearray(row))
                self.write(t.assemble(files, one, r, r + 1))
                r += 1
                continue
            t.assemble(files, self._view[self._fill:self._fill + k * row], r, r + k)
            self._fill, self._size, r = self._fill + k * row, self._size + k * row, r + k
            if self._fill == self.BLOCK:
                self._submit(self.BLOCK)

    def _submit(self, nbytes: int) -> None:
        """Hand the current buffer to the writer; continue in a free one."""
        self._todo.put((self._cur, nbytes, self._pos))
        self._pos += nbytes
        self._cur = self._free.get()
        self._view, self._fill = self._views[self._cur], 0
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while (job := self._todo.get()) is not None:
            i, nbytes, pos = job
            try:
                if self._error is None:
                    pwrite_all(self._fd, self._views[i], nbytes, pos)
            except BaseException as e:  # handed to the caller at its next submit / close;
                self._error = e.with_traceback(None)  # no frame may keep a buffer view
            self._free.put(i)

    def close(self) -> None:
        if self._plain is not None:
            self._plain.close()
            return
        try:
            if self._fill:
                end = self._fill + (-self._fill % 4096)
                self._view[self._fill:end] = bytes(end - self._fill)
                self._todo.put((self._cur, end, self._pos))
            self._todo.put(None)
            self._writer.join()
            if self._error is not None:
                raise self._error
            os.ftruncate(self._fd, self._size)
        finally:
            self._sources.close()
            os.close(self._fd)
            for v, b in zip(self._views, self._bufs):
                v.release()
                b.close()


class ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int, direct: bool = True):
        self.out_dir, self.max_bytes, self.direct = out_dir, max_shard_bytes, direct
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self.total_bytes = 0
        self.peak_pending_bytes = 0
        self._scratch: list = [None]  # Assembled tensors' buffer, kept across shards

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a tensor for the current shard. It is written as given, not copied: a caller
        that reuses its buffer must pass a copy. A tensor on the model's device is queued as
        its host copy (`to_host`: the writer reads bytes from host memory)."""
        if isinstance(tensor, torch.Tensor):
            tensor = to_host(tensor)
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
        write_safetensors(path, self._pending, metadata={"format": "pt"}, direct=self.direct,
                          scratch=self._scratch)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give shards their final names, write the index. Returns files."""
        if self._pending or not self._shards:
            self._flush()
        self._scratch = [None]
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

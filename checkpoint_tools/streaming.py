"""Export a torch_dist checkpoint to HF safetensors without loading it: file to file.

`dist_checkpointing.load` of a whole stage was most of export-hf's time, and its memory was
the whole model (docs/benchmark-history.md, conversion). Loading a few parameters at a time through it is
not possible: Megatron turns all of a rank's chunks of a layer-stacked key into one torch
ShardedTensor and requires them in one load. This reads the checkpoint's own index instead:

* DCP's `.metadata` (`read_metadata`: read without importing torch.distributed.checkpoint)
  lists, per key, the chunks (global offsets and sizes) and, per chunk, its byte range in a
  `.distcp` file. Each tensor item
  there is one `torch.save` zip; its storage record is stored uncompressed, so the tensor's
  bytes are a plain range of the file (`_item_bytes` checks dtype, shape, offset 0 and
  contiguous strides from the item's own pickle, and the record's size).
* Which parameters a tp = pp = 1 stage has (`stage_params`, from the HF config) and which key,
  offset and rows hold each (`checkpoint_keys`: Megatron's layer stacking and its local
  spec's key map) are derived from the config and these naming rules, so an export imports
  neither megatron-core nor a model: tests check both against a built stage's
  `named_parameters` and `sharded_state_dict` (swiglu factory applied) for every family.
* `mapping.row_blocks` gives, per parameter, the HF tensors' rows it holds; every HF tensor is
  then a list of byte ranges of the `.distcp` files (`shards.FileBytes`), and the shard writer
  copies them into the safetensors files (same order, grouping, header and index as an export
  from memory: tested byte for byte).

The checkpoint's layout does not matter: its chunks are in global coordinates, and the plan
is made against a tp = pp = 1 model whatever tp and pp the checkpoint was saved at. A chunk that
is whole rows of a parameter (column-parallel weights, the vocabulary, layers of a pp stage) is a
byte range as above. A row-parallel weight saved at tp > 1 is split by columns: each of its
chunks is a block of rows x columns, contiguous in its file. Such a tensor is assembled in
memory, one tensor at a time (`shards.Assembled`: each chunk is read with one scatter `preadv`
into its columns of a reused buffer), then written; the whole model is never held.

Anything this does not cover raises `NotStreamable` and the caller loads the stage instead: a
column-split parameter that is not one whole HF tensor, a dtype other than the checkpoint's,
compressed or non-contiguous items.
"""
from __future__ import annotations

import functools
import io
import math
import os
import pickle
import re
import zipfile

import torch

from checkpoint_tools.layout import ConversionError
from checkpoint_tools.shards import Assembled, FileBytes, ShardWriter, ShortFile
from megaprm.models import mapping


class NotStreamable(Exception):
    """The checkpoint's layout needs a real load (the message says why)."""


def plan_export(model_dir: str, spec, dtype: torch.dtype, pieces_of=None) -> list:
    """[(HF name, FileBytes or Assembled)] of the checkpoint in `model_dir` (torch_dist), in
    the order an export from memory writes them, as dtype `dtype` (the checkpoint's).

    The parameters are those of the whole model as one stage (tp = pp = 1, `stage_params`),
    each read where `checkpoint_keys` puts it in the checkpoint. `pieces_of(items)` ->
    {parameter name: chunk ranges} replaces that lookup (tests pass megatron-core's own)."""
    items = _Items(model_dir, read_metadata(model_dir))
    params = stage_params(spec)
    pieces = (pieces_of or functools.partial(_metadata_pieces, params, dtype))(items)
    plan = []  # every tensor's pieces first: a NotStreamable leaves nothing half written
    for pname, shape in params:
        rule = mapping.rule_for(pname, spec, 1, 0)
        if rule is None:
            continue
        ranges = pieces.get(pname)
        if ranges is None:
            raise NotStreamable(f"{rule.megatron_name} is not in the sharded state dict")
        if not shape or not shape[0]:
            raise NotStreamable(f"{rule.megatron_name}: a scalar or empty parameter")
        blocks = mapping.row_blocks(rule, spec, shape[0], 0, 1)
        row = math.prod(shape[1:]) * dtype.itemsize
        if any(r[4] is not None for r in ranges):  # column-split chunks: assembled in memory
            plan.append(_assembled(rule, blocks, ranges, shape, dtype, row))
            continue
        for name in rule.hf_names:  # the order an export from memory writes them in
            parts = []
            for hf_name, src, dst, n in blocks:
                if hf_name == name:
                    parts += [(src * row + lo - dst * row, path, off, size) for lo, path, off,
                              size in _cut(ranges, dst * row, (dst + n) * row)]
            hf_shape = (sum(n for h, _, _, n in blocks if h == name), *shape[1:])
            plan.append((name, FileBytes(dtype, hf_shape,
                                         _ordered(parts, name, hf_shape, dtype))))
    return plan


def stage_params(spec) -> list:
    """[(Megatron parameter name, shape)] of the whole model as one stage (tp = pp = 1), in
    the order of its `named_parameters()` (megatron-core's local layer spec, the one
    megaprm builds): what `stages.build` would make, without building it (tested equal)."""
    h, d, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * d
    layer = [("input_layernorm.weight", (h,)),
             ("self_attention.linear_proj.weight", (h, spec.num_heads * d)),
             ("self_attention.linear_qkv.weight", (qkv, h))]
    if spec.qkv_bias:
        layer.append(("self_attention.linear_qkv.bias", (qkv,)))
    if spec.qk_norm:
        layer += [("self_attention.q_layernorm.weight", (d,)),
                  ("self_attention.k_layernorm.weight", (d,))]
    layer.append(("pre_mlp_layernorm.weight", (h,)))
    if spec.is_moe:  # router, SequentialMLP's experts (global index at tp = pp = ep = 1), shared
        e, sh = spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
        layer.append(("mlp.router.weight", (spec.num_experts, h)))
        for j in range(spec.num_experts):
            layer += [(f"mlp.experts.local_experts.{j}.linear_fc1.weight", (2 * e, h)),
                      (f"mlp.experts.local_experts.{j}.linear_fc2.weight", (h, e))]
        if sh:
            layer += [("mlp.shared_experts.gate_weight", (1, h)),
                      ("mlp.shared_experts.linear_fc1.weight", (2 * sh, h)),
                      ("mlp.shared_experts.linear_fc2.weight", (h, sh))]
    else:
        layer += [("mlp.linear_fc1.weight", (2 * ffn, h)), ("mlp.linear_fc2.weight", (h, ffn))]
    out = [("embedding.word_embeddings.weight", (spec.padded_vocab_size(1), h))]
    out += [(f"decoder.layers.{i}.{s}", shape) for i in range(spec.num_layers)
            for s, shape in layer]
    out.append(("decoder.final_layernorm.weight", (h,)))
    n = spec.num_labels
    if spec.head == "lm":
        if not spec.tie_embeddings:  # tied: the embedding is the output layer
            out.append(("output_layer.weight", (spec.padded_vocab_size(1), h)))
    elif spec.head == "token_cls":
        out += [("score.weight", (n, h)), ("score.bias", (n,))]
    elif spec.head == "prm_mlp":
        out += [("score.0.weight", (h, h)), ("score.0.bias", (h,)), ("score.2.weight", (n, h)),
                ("score.2.bias", (n,))]
    else:
        raise NotStreamable(f"head {spec.head!r}: its parameters are not known here")
    return out


# megatron-core's local layer spec saves these under the Transformer Engine layer's keys
# (its `sharded_state_dict_keys_map`), so that either spec loads the other's checkpoints
_SAVED_AS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# SequentialMLP saves its experts stacked along a second axis, by global expert index
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def checkpoint_keys(name: str, shape: tuple) -> tuple:
    """(key, global offsets, sizes) of the whole parameter `name` of a tp = pp = 1 stage in a
    torch_dist checkpoint: a layer's parameters are stacked along a leading layer axis under
    one key per layer parameter (megatron-core's layer stacking; global layer numbers, so any
    pp), other parameters are saved under their own names (tp shards at global offsets). An
    MoE layer's experts are stacked along an expert axis after the layer axis."""
    m = _LAYER.match(name)
    if m is None:
        return name, (0,) * len(shape), tuple(shape)
    suffix = m.group(2)
    e = _EXPERT.match(suffix)
    if e:
        return (f"decoder.layers.mlp.experts.experts.{e.group(2)}",
                (int(m.group(1)), int(e.group(1))) + (0,) * len(shape), (1, 1, *shape))
    return (f"decoder.layers.{_SAVED_AS.get(suffix, suffix)}", (int(m.group(1)),)
            + (0,) * len(shape), (1, *shape))


def _metadata_pieces(params: list, dtype, items: _Items) -> dict:
    """{parameter name: [(param byte offset, .distcp path, file offset, size, cols)]}: `cols`
    None for a run of whole rows, else (first row, rows, column byte, bytes per row) of a
    column-split chunk in the parameter (`_Items.rows`), sorted."""
    out = {}
    for name, shape in params:
        key, offsets, sizes = checkpoint_keys(name, shape)
        out[name] = sorted(items.rows(key, offsets, sizes, dtype), key=lambda r: r[:4])
    return out


def _assembled(rule, blocks: list, ranges: list, shape: tuple, dtype, row: int) -> tuple:
    """(HF name, Assembled) of a parameter saved in column-split chunks: it must be one whole
    HF tensor (row-parallel weights are: o_proj, down_proj, ...)."""
    rows = shape[0]
    if len(rule.hf_names) != 1 or [tuple(b) for b in blocks] != [(rule.hf_names[0], 0, 0,
                                                                  rows)]:
        raise NotStreamable(f"{rule.megatron_name}: column-split chunks of a parameter that "
                            "is not one whole HF tensor")
    parts = []
    for lo, path, off, size, cols in ranges:
        if cols is None:  # whole rows
            if lo % row or size % row:
                raise NotStreamable(f"{rule.megatron_name}: a chunk that is not whole rows")
            cols = (lo // row, size // row, 0, row)
        parts.append((path, off, *cols))
    name = rule.hf_names[0]
    _tiled(parts, name, rows, row)
    return name, Assembled(dtype, tuple(shape), row, parts)


def _tiled(parts: list, name: str, rows: int, row: int) -> None:
    """The (path, offset, first row, rows, column byte, bytes per row) blocks cover the
    tensor's rows x row bytes exactly once."""
    area = 0
    for i, (_, _, r0, n, c0, w) in enumerate(parts):
        if r0 < 0 or c0 < 0 or r0 + n > rows or c0 + w > row or not n or not w:
            raise NotStreamable(f"{name}: a chunk outside the tensor")
        area += n * w
        for _, _, r1, m, c1, v in parts[:i]:
            if r0 < r1 + m and r1 < r0 + n and c0 < c1 + v and c1 < c0 + w:
                raise NotStreamable(f"{name}: two chunks overlap")
    if area != rows * row:
        raise NotStreamable(f"{name}: {area} of {rows * row} bytes found in the checkpoint")


DIRECT_ABOVE_BYTES = 1 << 30  # exports larger than this write with O_DIRECT


def write_shards(plan: list, out_dir: str, max_shard_bytes: int,
                 direct: bool | None = None) -> tuple:
    """Write `plan_export`'s tensors as HF shards into `out_dir` -> (ShardWriter, files).

    `direct` None: O_DIRECT above DIRECT_ABOVE_BYTES in all, else page-cache writes. A small
    export is copied by `copy_file_range` in the kernel (no pass through this process) and
    stays in the page cache for whoever loads it next (vLLM, transformers); a multi-GB one
    goes to the disk without growing the page cache by its size. Measured here (2-core VM,
    core seconds, docs/benchmark-history.md): at 424 MB buffered 0.19-0.49 s (median of 10 rounds 0.22 s)
    against O_DIRECT 0.23-0.71 s (median of 13 rounds 0.35 s: a bounce buffer, and the disk
    at ~1.6 GB/s with dd); at 2.4 GB buffered 1.3-19 s (median of 7 rounds 6.2 s, as the VM
    grows its page cache) against O_DIRECT 1.4-8.9 s (median of 9 rounds 1.8 s)."""
    if direct is None:
        direct = sum(t.numel() * t.element_size() for _, t in plan) > DIRECT_ABOVE_BYTES
    writer = ShardWriter(out_dir, max_shard_bytes, direct=direct)
    try:
        for name, tensor in plan:
            writer.add(name, tensor)
        return writer, writer.finish()
    except ShortFile as e:
        raise ConversionError(f"reading the checkpoint: {e}; it is truncated or changed; "
                              "re-import or re-save it") from None


def _cut(ranges: list, lo: int, hi: int) -> list:
    """The parts of [(param byte lo, path, file offset, size, None)] inside [lo, hi),
    clipped (4-tuples)."""
    out = []
    for start, path, off, size, _ in ranges:
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            out.append((a, path, off + a - start, b - a))
    return out


def _ordered(parts: list, name: str, shape: tuple, dtype) -> list:
    """(path, offset, size) pieces in HF byte order; they must tile the tensor exactly."""
    parts.sort()
    pos = 0
    for start, _, _, size in parts:
        if start != pos:
            raise NotStreamable(f"{name}: bytes {pos}..{start} come from no checkpoint chunk")
        pos += size
    want = dtype.itemsize * math.prod(shape)
    if pos != want:
        raise NotStreamable(f"{name}: {pos} of {want} bytes found in the checkpoint")
    return [(path, off, size) for _, path, off, size in parts]


def read_metadata(model_dir: str) -> tuple:
    """DCP's `.metadata` of a torch_dist dir as plain data: ({tensor key: (dtype, [(chunk
    offsets, chunk sizes)])}, {(tensor key, chunk offsets): (relative path, offset, length,
    transform descriptors)}); non-tensor items (bytes) are left out.

    `.metadata` is a pickle of torch.distributed.checkpoint's classes; importing that package
    takes ~1 s, a third of a small export's wall time. It is read here with stand-ins for
    those classes (`_MetadataUnpickler`: only the names DCP writes are resolved, nothing else
    is built or run); a pickle that names anything else is read by DCP's own reader instead
    (tested equal)."""
    path = os.path.join(model_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConversionError(f"{model_dir!r} has no .metadata: not a complete torch_dist "
                              "checkpoint (an interrupted save?); re-import or re-save it"
                              ) from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
        return _plain(meta.state_dict_metadata, meta.storage_data, _Stub)
    except (pickle.UnpicklingError, AttributeError, TypeError, ValueError, KeyError,
            IndexError, EOFError):
        return _dcp_metadata(model_dir)


def _dcp_metadata(model_dir: str) -> tuple:
    """`read_metadata` by torch.distributed.checkpoint's own reader."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(model_dir).read_metadata()
    return _plain(meta.state_dict_metadata, meta.storage_data, TensorStorageMetadata)


def _plain(state_dict_metadata: dict, storage_data: dict, tensor_type) -> tuple:
    tensors = {}
    for key, md in state_dict_metadata.items():
        if isinstance(md, tensor_type) and hasattr(md, "chunks"):
            tensors[key] = (md.properties.dtype, [(tuple(c.offsets), tuple(c.sizes))
                                                  for c in md.chunks])
    storage = {}
    for index, info in storage_data.items():
        if getattr(index, "offset", None) is not None:  # None (a class default): bytes
            storage[(index.fqn, tuple(index.offset))] = (
                info.relative_path, info.offset, info.length,
                getattr(info, "transform_descriptors", None))
    return tensors, storage


class _Stub:
    """Stand-in for one of DCP's metadata dataclasses: keeps the fields it was pickled with."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (__dict__, __slots__ values)
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state {type(state).__name__}")
        self.__dict__.update(state)


class _Properties:
    """Stand-in for DCP's TensorProperties, pickled as a tuple whose first item is the dtype."""

    def __setstate__(self, state):
        self.dtype = state[0] if isinstance(state, tuple) else state["dtype"]
        if not isinstance(self.dtype, torch.dtype):
            raise pickle.UnpicklingError("TensorProperties without a dtype")


_DCP = "torch.distributed.checkpoint."
_STUBS = {(_DCP + "metadata", n) for n in ("Metadata", "TensorStorageMetadata",
                                           "ChunkStorageMetadata", "BytesStorageMetadata",
                                           "MetadataIndex", "StorageMeta")}
_STUBS |= {(_DCP + "filesystem", "_StorageInfo")}
_STUBS |= {(_DCP + "planner", n) for n in ("SavePlan", "WriteItem", "TensorWriteData")}
_ENUMS = {(_DCP + "metadata", "_MEM_FORMAT_ENCODING"), (_DCP + "planner", "WriteItemType")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _STUBS:
            return type(name, (_Stub,), {})
        if (module, name) == (_DCP + "metadata", "TensorProperties"):
            return _Properties
        if (module, name) in _ENUMS:
            return lambda value: value  # the enum's value stands for its member
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")


class _Items:
    """The checkpoint's tensor chunks: which file bytes hold which rows of a shard."""

    def __init__(self, model_dir: str, meta: tuple):
        self.dir, (self.tensors, self.storage) = model_dir, meta

    def rows(self, key: str, offsets: tuple, sizes: tuple, dtype) -> list:
        """[(byte offset in the shard, path, file offset, size, cols)] for the shard of `key`
        at `offsets` with `sizes` (global coordinates, layer axis included). A chunk that meets
        it must span the shard's full extent on all dims but its row dim (the first of size
        > 1) and, for a 2-D shard, its column dim (the last). Whole rows: a contiguous run of
        the shard's bytes (`cols` None). Split by columns (a row-parallel weight saved at
        tp > 1): `cols` = (first row, rows, column byte, bytes per row) of the block it holds,
        its bytes contiguous in the file, row after row."""
        found = self.tensors.get(key)
        if found is None:
            raise NotStreamable(f"{key}: no tensor of that name in the checkpoint")
        saved, chunks = found
        if saved != dtype:
            raise NotStreamable(f"{key}: saved as {saved}, exported as {dtype}")
        d = next((i for i, s in enumerate(sizes) if s > 1), len(sizes) - 1)
        row = dtype.itemsize * math.prod(sizes[d + 1:])
        col = d + 1 if len(sizes) == d + 2 else None  # a 2-D shard's column dim
        out = []
        for c_off, c_size in chunks:
            if any(co + cs <= o or co >= o + s
                   for co, cs, o, s in zip(c_off, c_size, offsets, sizes)):
                continue  # does not meet this shard
            if any((co, cs) != (o, s) for i, (co, cs, o, s) in
                   enumerate(zip(c_off, c_size, offsets, sizes)) if i not in (d, col)) or any(
                    c_off[i] < offsets[i] or c_off[i] + c_size[i] > offsets[i] + sizes[i]
                    for i in (d, col) if i is not None):
                raise NotStreamable(f"{key}: chunk {c_off}+{c_size} is not a block of the "
                                    f"shard {offsets}+{sizes}")
            info = self.storage.get((key, c_off))
            if info is None:
                raise ConversionError(f"{self.dir!r}: .metadata lists chunk {c_off} of {key} "
                                      "but no file holding it; the checkpoint is corrupt")
            relative_path, offset, length, transforms = info
            if transforms:
                raise NotStreamable(f"{key}: item written through transforms")
            path = os.path.join(self.dir, relative_path)
            off = self._item_bytes(path, offset, length, key, c_size, dtype)
            r0 = c_off[d] - offsets[d]
            if col is not None and c_size[col] != sizes[col]:
                width = c_size[col] * dtype.itemsize
                c0 = (c_off[col] - offsets[col]) * dtype.itemsize
                out.append((r0 * row + c0, path, off, c_size[d] * width,
                            (r0, c_size[d], c0, width)))
            else:
                out.append((r0 * row, path, off, c_size[d] * row, None))
        return out

    def _item_bytes(self, path: str, offset: int, length: int, key: str, shape: tuple,
                    dtype) -> int:
        """File offset of the tensor bytes of the torch.save item at [offset, offset+length)."""
        try:
            f = open(path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            raise ConversionError(f"{path!r} is missing: the checkpoint is incomplete; "
                                  "re-import or re-save it") from None
        with f:
            if os.fstat(f.fileno()).st_size < offset + length:
                raise ConversionError(f"{path!r} ends before {key}'s item: the checkpoint is "
                                      "truncated; re-import or re-save it")
            try:
                zf = zipfile.ZipFile(_Window(f, offset, length))
                pkl = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
                # read as stored: zipfile would check the CRC, which the save left out
                f.seek(offset + _record_start(f, offset, pkl, path, key))
                found = _rebuilt(f.read(pkl.file_size))
            except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError,
                    KeyError) as e:
                raise ConversionError(f"{path!r}: {key}'s item is not a readable torch.save "
                                      f"record ({e}); the checkpoint is corrupt") from None
            record, st_offset, size, stride, saved_dtype = found
            numel = int(torch.Size(shape).numel())
            contiguous = torch.empty(size, device="meta").stride()
            if (tuple(size) != tuple(shape) or st_offset != 0 or tuple(stride) != contiguous
                    or saved_dtype != dtype):
                raise NotStreamable(f"{key}: item is {tuple(size)}/{tuple(stride)} "
                                    f"{saved_dtype} at storage offset {st_offset}")
            info = next((i for i in zf.infolist() if i.filename.endswith(f"/data/{record}")),
                        None)
            if info is None or info.compress_type != zipfile.ZIP_STORED or (
                    info.file_size != numel * dtype.itemsize):
                raise NotStreamable(f"{key}: storage record missing, compressed or of another "
                                    "size")
            return offset + _record_start(f, offset, info, path, key)


def _record_start(f, offset: int, info, path: str, key: str) -> int:
    """Where a stored zip record's bytes begin, relative to the archive at `offset` of `f`
    (after its local header: 30 bytes, then the name and extra field, whose lengths it says)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise NotStreamable(f"{key}: compressed record {info.filename}")
    f.seek(offset + info.header_offset)
    local = f.read(30)
    if local[:4] != b"PK\x03\x04":
        raise ConversionError(f"{path!r}: {key}'s item is corrupt (bad zip header)")
    return (info.header_offset + 30 + int.from_bytes(local[26:28], "little")
            + int.from_bytes(local[28:30], "little"))


class _Window(io.RawIOBase):
    """Bytes [offset, offset+length) of an open file as a seekable file of their own."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._lo, self._n, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: self._n + pos}[whence]
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._n - self._pos))
        self._f.seek(self._lo + self._pos)
        got = self._f.readinto(memoryview(buf)[:n]) if n else 0
        self._pos += got
        return got


_STORAGE_DTYPES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "DoubleStorage": torch.float64,
                   "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8,
                   "ByteStorage": torch.uint8, "BoolStorage": torch.bool}


def _rebuilt(data_pkl: bytes) -> tuple:
    """(storage record key, storage offset, size, stride, dtype) of the one tensor a torch.save
    item pickles, read from its data.pkl without building anything (no code runs: only
    torch's tensor-rebuild call and storage names are recognised)."""
    calls = []

    def rebuild(storage, storage_offset, size, stride, *rest):
        calls.append((storage, storage_offset, tuple(size), tuple(stride)))
        return calls[-1]

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return rebuild
            if module == "torch" and name in _STORAGE_DTYPES:
                return _STORAGE_DTYPES[name]
            if (module, name) == ("collections", "OrderedDict"):
                import collections
                return collections.OrderedDict
            raise pickle.UnpicklingError(f"unexpected {module}.{name}")

        def persistent_load(self, pid):
            # ('storage', storage type, key, location, numel)
            return (pid[2], pid[1])

    Reader(io.BytesIO(data_pkl)).load()
    if len(calls) != 1:
        raise pickle.UnpicklingError(f"{len(calls)} tensors in one item")
    (key, dtype), st_offset, size, stride = calls[0]
    return key, st_offset, size, stride, dtype

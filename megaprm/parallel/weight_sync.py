"""Megatron tp/pp shards -> a stream of (hf_name, full tensor) on every rank, in buckets.

Two streams with the same contents (same names, order and values, bit for bit):

* `iter_hf_weights` - one parameter at a time: a tp all-gather and a pp broadcast per
  parameter. Simple and obviously right; the reference the bucketed stream is tested against.
* `iter_hf_buckets` - the same parameters grouped into buckets of about `bucket_bytes` (full,
  unsharded size). Per bucket: ONE all-gather in the owning stage's tp group (every tp-split
  shard of the bucket flattened into one buffer) and ONE broadcast over the pp group (the gathered
  buffer plus the replicated parameters, flattened), then every rank rebuilds the full tensors
  and converts them to HF names/layouts with `models.mapping` (the one mapping).

With tp = pp = 1 there is nothing to communicate and the buckets are views of the parameters.
Buckets never span two pp stages or two dtypes (one source rank and one flat dtype per
collective). A parameter larger than `bucket_bytes` is a bucket of its own. Each bucket is a fresh
buffer, so a consumer that copies the tensors and drops them holds at most one bucket: the flat
buffer plus, for tp > 1, the rebuilt full tensors (~2x bucket_bytes transient).

Every dp replica runs its own gathers/broadcasts in its own tp/pp groups, so every rank, i.e.
every colocated rollout engine, receives the whole model. Works for the actor and for a PRM whose
last stage carries a `score.*` head (the mapping exports it as is).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaprm.models import mapping
from megaprm.parallel.groups import Groups


def default_bucket_bytes() -> int:
    """256 MiB on GPU (NCCL, caching allocator); 16 MiB on CPU, where larger buckets were slower
    in scripts/bench_weight_sync.py (fresh multi-100-MB buffers per bucket, gloo on huge buffers)."""
    return (256 if torch.cuda.is_available() else 16) << 20


# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_tp(shard: torch.Tensor, dim, groups: Groups) -> torch.Tensor:
    """Full tensor from tp shards (concatenated on `dim`); replicated params pass through."""
    if dim is None or groups.tp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=dim)


def mapping_spec(model):
    m = model.module if hasattr(model, "module") else model
    return m.megaprm_spec


def _own_params(model, spec, groups: Groups) -> list:
    """(rule, parameter) of this stage that the HF stream carries (tied copies excluded)."""
    return [(rule, p) for rule, p in mapping.stage_rules(model, spec, groups.pp_size,
                                                        groups.pp_rank) if mapping.exported(rule)]


def _stage_meta(own: list, groups: Groups) -> list:
    """[(rule, local shard shape, dtype) per parameter] of every stage, on every rank."""
    mine = [(r, tuple(p.shape), p.dtype) for r, p in own]
    if groups.pp_size == 1:
        return [mine]
    metas = [None] * groups.pp_size
    dist.all_gather_object(metas, mine, group=groups.pp)
    return metas


@torch.no_grad()
def iter_hf_weights(model, groups: Groups, spec=None) -> Iterator[tuple]:
    """Yield (hf_name, tensor) for the whole model, in stage order, identically on all ranks."""
    spec = spec or mapping_spec(model)
    own = _own_params(model, spec, groups)
    device = own[0][1].device if own else torch.device("cpu")
    for stage, meta in enumerate(_stage_meta(own, groups)):
        for i, (rule, shape, dtype) in enumerate(meta):
            if stage == groups.pp_rank:
                full = gather_tp(own[i][1].detach(), rule.tp_dim, groups)
            else:
                full_shape = list(shape)
                if rule.tp_dim is not None:
                    full_shape[rule.tp_dim] *= groups.tp_size
                full = torch.empty(full_shape, dtype=dtype, device=device)
            if groups.pp_size > 1:
                dist.broadcast(full, src=dist.get_global_rank(groups.pp, stage), group=groups.pp)
            yield from mapping.to_hf(rule, full, spec, groups.tp_size)


# ------------------------------------------------------------------------------- bucketed

@dataclass(frozen=True)
class _Bucket:
    """Parameters of one stage, one dtype. `split`/`repl` index into that stage's param list."""

    stage: int
    dtype: torch.dtype
    split: tuple[int, ...]  # tp-split parameters: gathered, laid out [tp, sum of local numels]
    repl: tuple[int, ...]  # replicated over tp: appended after the gathered part
    nbytes: int  # full (unsharded) size


def plan_buckets(metas: list, tp_size: int, bucket_bytes: int) -> list[_Bucket]:
    """Group every stage's parameters, in order, into buckets of <= bucket_bytes full bytes."""
    buckets = []
    for stage, meta in enumerate(metas):
        runs: list[list[int]] = []  # runs of parameter indices, one per bucket
        size, dtype = 0, None
        for i, (rule, shape, dt) in enumerate(meta):
            nbytes = _numel(shape) * (tp_size if rule.tp_dim is not None else 1) * dt.itemsize
            if not runs or dt != dtype or size + nbytes > bucket_bytes:
                runs.append([])
                size = 0
            runs[-1].append(i)
            size, dtype = size + nbytes, dt
        for idx in runs:
            full = [_numel(meta[i][1]) * (tp_size if meta[i][0].tp_dim is not None else 1)
                    * meta[i][2].itemsize for i in idx]
            buckets.append(_Bucket(
                stage, meta[idx[0]][2],
                split=tuple(i for i in idx if meta[i][0].tp_dim is not None),
                repl=tuple(i for i in idx if meta[i][0].tp_dim is None), nbytes=sum(full)))
    return buckets


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@torch.no_grad()
def _fill_bucket(bucket: _Bucket, meta: list, own: list, groups: Groups,
                 device) -> torch.Tensor:
    """The bucket's flat buffer [tp * split numel + repl numel], identical on every rank."""
    tp = groups.tp_size
    split_n = sum(_numel(meta[i][1]) for i in bucket.split)
    repl_n = sum(_numel(meta[i][1]) for i in bucket.repl)
    flat = torch.empty(tp * split_n + repl_n, dtype=bucket.dtype, device=device)
    if bucket.stage == groups.pp_rank:
        # tp == 1: the shards are the full tensors, written in place; else gathered rank-major
        local = flat[:split_n] if tp == 1 else torch.empty(split_n, dtype=flat.dtype,
                                                           device=device)
        off = 0
        for i in bucket.split:
            n = _numel(meta[i][1])
            local[off:off + n].copy_(own[i][1].detach().reshape(-1))
            off += n
        if tp > 1 and split_n:
            _all_gather_flat(flat[: tp * split_n], local, group=groups.tp)
            del local
        off = tp * split_n
        for i in bucket.repl:
            n = _numel(meta[i][1])
            flat[off:off + n].copy_(own[i][1].detach().reshape(-1))
            off += n
    if groups.pp_size > 1:
        dist.broadcast(flat, src=dist.get_global_rank(groups.pp, bucket.stage), group=groups.pp)
    return flat


def _unpack_bucket(flat: torch.Tensor, bucket: _Bucket, meta: list, spec,
                   tp: int) -> list[tuple]:
    """Full Megatron tensors from the flat buffer -> HF (name, tensor) pairs, in param order."""
    split_n = sum(_numel(meta[i][1]) for i in bucket.split)
    gathered = flat[: tp * split_n].view(tp, split_n)
    full = {}
    off = 0
    for i in bucket.split:
        rule, shape, _ = meta[i]
        n = _numel(shape)
        parts = [gathered[r, off:off + n].view(shape) for r in range(tp)]
        full[i] = parts[0] if tp == 1 else torch.cat(parts, dim=rule.tp_dim)
        off += n
    off = tp * split_n
    for i in bucket.repl:
        n = _numel(meta[i][1])
        full[i] = flat[off:off + n].view(meta[i][1])
        off += n
    out = []
    for i in sorted(full):
        out.extend(mapping.to_hf(meta[i][0], full[i], spec, tp))
    return out


def iter_hf_buckets(model, groups: Groups, bucket_bytes: int | None = None,
                    spec=None) -> Iterator[list[tuple]]:
    """Yield lists of (hf_name, full tensor), about `bucket_bytes` each, identically on all ranks.

    Concatenated, the buckets are exactly `iter_hf_weights`' stream. Every rank of the model's
    tp x pp group must iterate to the end (each bucket is a collective).
    """
    bucket_bytes = default_bucket_bytes() if bucket_bytes is None else bucket_bytes
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be a positive integer (bytes)")
    spec = spec or mapping_spec(model)
    own = _own_params(model, spec, groups)
    device = own[0][1].device if own else torch.device("cpu")
    metas = _stage_meta(own, groups)
    for bucket in plan_buckets(metas, groups.tp_size, bucket_bytes):
        meta = metas[bucket.stage]
        if groups.tp_size == 1 and groups.pp_size == 1:
            # nothing to communicate: the parameters are the full tensors (zero-copy views,
            # as in `iter_hf_weights`); the consumer copies them
            yield [x for i in sorted(bucket.split + bucket.repl)
                   for x in mapping.to_hf(meta[i][0], own[i][1].detach(), spec, 1)]
            continue
        flat = _fill_bucket(bucket, meta, own, groups, device)
        yield _unpack_bucket(flat, bucket, meta, spec, groups.tp_size)
        del flat


@dataclass(frozen=True)
class SyncStats:
    """One weight sync: HF bytes delivered to the engine, wall time, buckets, largest bucket."""

    bytes: int
    seconds: float
    num_buckets: int
    peak_bucket_bytes: int

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-12) / 1e9


def sync_weights(model, groups: Groups, engine, bucket_bytes: int | None = None, *,
                 strict: bool = True, spec=None) -> SyncStats:
    """Stream the model into `engine.load_weights` bucket by bucket (one call, so a strict engine
    can report what it never received). Call on every rank; each rank's engine gets the whole
    model. The engine must be awake (its weights resident) while this runs."""
    counts = {"bytes": 0, "buckets": 0, "peak": 0}

    def stream():
        for bucket in iter_hf_buckets(model, groups, bucket_bytes, spec):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            counts["bytes"] += size
            counts["buckets"] += 1
            counts["peak"] = max(counts["peak"], size)
            yield from bucket

    start = time.perf_counter()
    engine.load_weights(stream(), strict=strict)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncStats(bytes=counts["bytes"], seconds=time.perf_counter() - start,
                     num_buckets=counts["buckets"], peak_bucket_bytes=counts["peak"])

"""Megatron tp/pp shards -> a stream of (hf_name, full tensor) on every rank, in buckets.

Two streams with the same contents (same names, order and values, bit for bit):

* `iter_hf_weights` - one parameter at a time: a tp all-gather and a pp broadcast per
  parameter. Simple and obviously right; the reference the bucketed stream is tested against.
* `iter_hf_buckets` - the same parameters grouped into buckets of about `bucket_bytes` (full,
  unsharded size). Per bucket: ONE all-gather in the owning stage's tp group (every tp-split
  shard of the bucket flattened into one buffer) and ONE broadcast over the pp group (the gathered
  buffer plus the replicated parameters, flattened), then every rank rebuilds the full tensors
  and converts them to HF names/layouts with `models.mapping` (the one mapping).

On CPU (gloo), when every rank of the model-parallel group runs on one host, no collective
carries the bytes (`transport="shm"`, chosen by `"auto"`): the group maps one shared-memory
buffer (a file in /dev/shm, unlinked once mapped), the owning stage's tp ranks copy their shards
straight into the HF layout in it, and two barriers per bucket order the writes and the reads;
every rank's HF tensors are views of that buffer. This is the CPU counterpart of the CUDA-IPC
handoff colocated GPU frameworks use between trainer and engine; gloo's TCP all-gather moved
0.20x memcpy on one host (docs/benchmark-history.md, weight sync). On GPU the NCCL collectives are used.

With tp = pp = 1 there is nothing to communicate and the buckets are views of the parameters.
Buckets never span two pp stages or two dtypes (one source rank and one flat dtype per
collective). A parameter larger than `bucket_bytes` is a bucket of its own. The buffers (packed
shards, gathered flat buffer, reordered HF tensors: ~2.5x the largest bucket for tp > 1) are
allocated once per sync and reused by every bucket, so a bucket's tensors are valid until the
next one is requested.

Every dp replica runs its own gathers/broadcasts in its own tp/pp groups, so every rank, i.e.
every colocated rollout engine, receives the whole model. Works for the actor and for a PRM whose
last stage carries a `score.*` head (the mapping exports it as is).

It sits in rollout/, above models/ and parallel/: it needs both the groups and the mapping. The
HF export (trainer/export.py, checkpoint_tools) gathers through the same stream.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaprm.models import mapping
from megaprm.parallel.groups import Groups
from megaprm.parallel.pipeline import unwrap


def default_bucket_bytes() -> int:
    """256 MiB. scripts/bench_weight_sync.py (CPU, tp2, one host; the committed quiet-box run):
    the shared-memory transport gains with bucket size (two barriers per bucket: 0.49x memcpy
    at 16 MiB, 0.64x at 256 MiB), the gloo all-gather is flat in it (the buffers are kept
    between syncs, gloo's gather is issued in 4 MiB slices)."""
    return 256 << 20


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
    return unwrap(model).megaprm_spec


def _own_params(model, spec, groups: Groups) -> list:
    """(rule, parameter) of this stage that the HF stream carries (tied copies excluded); the
    experts of an MoE model named as this ep rank's."""
    return [(rule, p) for rule, p in mapping.stage_rules(
        model, spec, groups.pp_size, groups.pp_rank, ep=groups.ep_size, ep_rank=groups.ep_rank)
        if mapping.exported(rule)]


def _gather_ep(full: torch.Tensor, rule, spec, stage: int, groups: Groups) -> list:
    """[(rule, full tensor)] of one expert parameter on every ep rank (the same local index j,
    expert r * num_experts / ep + j on rank r); any other parameter as it is."""
    if groups.ep_size == 1 or not mapping.is_expert(rule.megatron_name):
        return [(rule, full)]
    parts = [torch.empty_like(full) for _ in range(groups.ep_size)]
    dist.all_gather(parts, full.contiguous(), group=groups.ep)
    return [(mapping.rule_for(rule.megatron_name, spec, groups.pp_size, stage, ep=groups.ep_size,
                              ep_rank=r), t) for r, t in enumerate(parts)]


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
    """Yield (hf_name, tensor) for the whole model, in stage order, identically on all ranks.
    An MoE model's expert parameters are gathered over the ep group too (after tp, before the
    pp broadcast): each local expert index yields that expert of every ep rank."""
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
            for rule_e, full_e in _gather_ep(full, rule, spec, stage, groups):
                if groups.pp_size > 1:
                    dist.broadcast(full_e, src=dist.get_global_rank(groups.pp, stage),
                                   group=groups.pp)
                yield from mapping.to_hf(rule_e, full_e, spec, groups.tp_size)


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


# CPU buffers kept between syncs: glibc returns large blocks to the OS on free, so fresh ones
# would be page-faulted in again on every sync (~0.3 s/GB here); CUDA's caching allocator
# already keeps freed blocks, so GPU buffers are not cached here.
_CPU_BUFFERS: dict = {}


def release_buffers() -> None:
    """Free the CPU staging and shared buffers kept by `iter_hf_buckets` (reallocated on demand;
    call it on every rank of the model-parallel group)."""
    _CPU_BUFFERS.clear()
    _SHM.clear()


class _Buffers:
    """Flat buffers reused by every bucket of one sync (sized for the largest bucket): `local`
    packs this rank's shards, `flat` receives the tp all-gather (plus the replicated tail, and is
    what the pp broadcast sends), `out` holds the reordered HF tensors."""

    def __init__(self, dtype_sizes: dict, device):
        self.bufs = {}
        for dtype, sizes in dtype_sizes.items():
            cached = _CPU_BUFFERS.get(dtype) if device.type == "cpu" else None
            if cached is None or any(c.numel() < n for c, n in zip(cached, sizes)):
                cached = tuple(torch.empty(n, dtype=dtype, device=device) for n in sizes)
                if device.type == "cpu":
                    _CPU_BUFFERS[dtype] = cached
            self.bufs[dtype] = cached

    def get(self, dtype):
        return self.bufs[dtype]


def _kind_copies(rule, spec, tp: int, slab: torch.Tensor, shard_shape, out: torch.Tensor):
    """(hf (name, tensor) pairs, [(dst view, src view)]) for one tp-split parameter.

    `slab[tp, n]` is the parameter's shard from every tp rank (rank-major rows of the gathered
    buffer); the HF tensors are written contiguously into `out` (the same numel as the full
    tensor) by copying strided views, one copy per HF tensor: the tp concatenation and the
    mapping's qkv / gate-up split happen in that one copy (the inverse of
    `mapping.to_megatron_shard`; Megatron requires the kv heads to divide over tp)."""
    g = slab.view(tp, *shard_shape)
    kind = rule.kind
    if kind == "row":                      # [out, in/tp] shards -> [out, in]
        o, i = shard_shape
        dst = out.view(o, tp, i)
        return [(rule.hf_names[0], out.view(o, tp * i))], [(dst, g.permute(1, 0, 2))]
    if kind == "vocab":                    # [V/tp, h] -> padded [V, h], rows [:vocab] exported
        rows = shard_shape[0]
        full = out.view(tp * rows, *shard_shape[1:])
        return ([(rule.hf_names[0], full[: spec.vocab_size])],
                [(out.view(tp, *shard_shape), g)])
    if kind == "gate_up":                  # [2 * I/tp, h] = (gate_r, up_r) -> gate [I, h], up
        half, rest = shard_shape[0] // 2, tuple(shard_shape[1:])
        gv = g.view(tp, 2, half, *rest)
        n = tp * half * _numel(rest)
        gate, up = out[:n], out[n: 2 * n]
        return ([(rule.hf_names[0], gate.view(tp * half, *rest)),
                 (rule.hf_names[1], up.view(tp * half, *rest))],
                [(gate.view(tp, half, *rest), gv[:, 0]), (up.view(tp, half, *rest), gv[:, 1])])
    if kind == "qkv":                      # [ng/tp * (per+2) d, ...] -> q, k, v
        ng, d = spec.num_kv_heads, spec.head_dim
        assert ng % tp == 0, (ng, tp)
        per, rest = spec.num_heads // ng, tuple(shard_shape[1:])
        gl = ng // tp
        gv = g.view(tp, gl, (per + 2) * d, *rest)
        r = _numel(rest)
        sizes = (ng * per * d * r, ng * d * r, ng * d * r)
        q, k, v = out[: sizes[0]], out[sizes[0]: sizes[0] + sizes[1]], out[sizes[0] + sizes[1]:
                                                                            sum(sizes)]
        pairs = [(q.view(tp, gl, per * d, *rest), gv[:, :, : per * d]),
                 (k.view(tp, gl, d, *rest), gv[:, :, per * d: (per + 1) * d]),
                 (v.view(tp, gl, d, *rest), gv[:, :, (per + 1) * d:])]
        hf = [(rule.hf_names[0], q.view(ng * per * d, *rest)),
              (rule.hf_names[1], k.view(ng * d, *rest)), (rule.hf_names[2], v.view(ng * d, *rest))]
        return hf, pairs
    raise AssertionError(f"{kind} is not split over tp")


@dataclass
class _Plan:
    """Everything one bucket needs, built before the loop: views into the reused buffers."""

    bucket: _Bucket
    local: torch.Tensor | None      # this rank's packed shards (owning stage, tp > 1)
    sources: list                   # this stage's shards (flattened) packed into `local` / `flat`
    flat: torch.Tensor              # gathered split part + replicated tail
    gathered: torch.Tensor | None   # flat[: tp * split_n]
    dsts: list                      # receive-side reorder: copy srcs -> dsts (one foreach call)
    srcs: list
    hf: list                        # (hf name, tensor) pairs of the bucket, in param order


def _plan(bucket: _Bucket, meta: list, own: list, groups: Groups, spec, bufs: _Buffers) -> _Plan:
    tp = groups.tp_size
    local_buf, flat_buf, out_buf = bufs.get(bucket.dtype)
    split_n = sum(_numel(meta[i][1]) for i in bucket.split)
    repl_n = sum(_numel(meta[i][1]) for i in bucket.repl)
    flat = flat_buf[: tp * split_n + repl_n]
    mine = bucket.stage == groups.pp_rank
    sources = [own[i][1].detach().reshape(-1) for i in bucket.split + bucket.repl] if mine else []
    local = (local_buf[:split_n] if tp > 1 else flat[:split_n]) if mine else None
    gathered = flat[: tp * split_n].view(tp, split_n)
    dsts, srcs, hf = [], [], {}
    off = out_off = 0
    for i in bucket.split:
        rule, shape, _ = meta[i]
        n = _numel(shape)
        slab = gathered[:, off:off + n]
        off += n
        if tp == 1 and rule.kind != "qkv":   # the mapping's outputs are views of the slab
            hf[i] = mapping.to_hf(rule, slab.view(shape), spec, 1)
            continue
        hf[i], copies = _kind_copies(rule, spec, tp, slab, shape,
                                     out_buf[out_off: out_off + tp * n])
        out_off += tp * n
        dsts.extend(d for d, _ in copies)
        srcs.extend(src for _, src in copies)
    off = tp * split_n
    for i in bucket.repl:
        n = _numel(meta[i][1])
        hf[i] = mapping.to_hf(meta[i][0], flat[off:off + n].view(meta[i][1]), spec, tp)
        off += n
    return _Plan(bucket, local, sources, flat, gathered, dsts, srcs,
                 [x for i in sorted(hf) for x in hf[i]])


def _buffer_sizes(buckets: list, metas: list, tp: int) -> dict:
    """Per dtype: the largest (local, flat, out) numel over all buckets."""
    sizes: dict = {}
    for b in buckets:
        meta = metas[b.stage]
        split_n = sum(_numel(meta[i][1]) for i in b.split)
        repl_n = sum(_numel(meta[i][1]) for i in b.repl)
        cur = sizes.get(b.dtype, (0, 0, 0))
        want = (split_n if tp > 1 else 0, tp * split_n + repl_n, tp * split_n)
        sizes[b.dtype] = tuple(max(a, c) for a, c in zip(cur, want))
    return sizes


# gloo (TCP, also between local ranks) moves cache-sized messages ~4x faster per byte than
# large ones (all-gather of 4 MiB per rank: 0.73 GB/s, of 16-256 MiB: 0.16-0.19 GB/s, 2 ranks on
# the CI box), so on gloo a bucket's gather is issued in 4 MiB slices of the same flat buffer.
GLOO_SLICE_BYTES = 4 << 20


def _gather(gathered: torch.Tensor, local: torch.Tensor, group) -> None:
    """All-gather `local[n]` of every tp rank into the rows of `gathered[tp, n]`: one collective
    (NCCL), or one per 4 MiB slice on gloo, each writing straight into the rows' slices."""
    n = local.numel()
    step = max(1, GLOO_SLICE_BYTES // local.element_size())
    if n <= step or dist.get_backend(group) != "gloo":
        _all_gather_flat(gathered.view(-1), local, group=group)
        return
    for lo in range(0, n, step):
        dist.all_gather(list(gathered[:, lo:lo + step].unbind(0)), local[lo:lo + step],
                        group=group)


@torch.no_grad()
def _run_plan(plan: _Plan, groups: Groups) -> list[tuple]:
    """Pack (one cat), all-gather (one collective), pp broadcast (one), reorder (one foreach
    copy) -> the bucket's HF (name, tensor) pairs, views into the reused buffers."""
    tp, b = groups.tp_size, plan.bucket
    split_n = plan.gathered.shape[1]
    if plan.local is not None:
        n_split = len(b.split)
        if n_split:
            torch.cat(plan.sources[:n_split], out=plan.local)
        if tp > 1 and split_n:
            _gather(plan.gathered, plan.local, groups.tp)
        if b.repl:
            torch.cat(plan.sources[n_split:], out=plan.flat[tp * split_n:])
    if groups.pp_size > 1:
        dist.broadcast(plan.flat, src=dist.get_global_rank(groups.pp, b.stage), group=groups.pp)
    if plan.dsts:
        torch._foreach_copy_(plan.dsts, plan.srcs)
    return list(plan.hf)


# ------------------------------------------------------------------ same-host shared memory

SHM_DIR = "/dev/shm"
TRANSPORTS = ("auto", "collective", "shm")
_SAME_HOST: dict = {}   # mp group's global ranks -> all on one host
_SHM: dict = {}         # (mp group's global ranks, dtype) -> shared flat buffer


def _host_id() -> tuple:
    """(hostname, boot id): equal for processes that share one kernel and its /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def _mp_ranks(groups: Groups) -> tuple:
    return tuple(dist.get_process_group_ranks(groups.mp))


def _transport(requested: str, groups: Groups, device) -> str:
    """"shm" or "collective" for this sync; the same answer on every rank of the mp group."""
    if requested == "collective" or groups.mp is None:
        return "collective"
    usable = device.type == "cpu" and dist.get_backend(groups.mp) == "gloo"
    if usable:
        ranks = _mp_ranks(groups)
        if ranks not in _SAME_HOST:
            ids = [None] * len(ranks)
            dist.all_gather_object(ids, _host_id(), group=groups.mp)
            _SAME_HOST[ranks] = len(set(ids)) == 1
        usable = _SAME_HOST[ranks]
    if requested == "shm" and not usable:
        raise ValueError("transport='shm' needs CPU parameters, a gloo model-parallel group and "
                         "all of its ranks on one host; use transport='auto' or 'collective'")
    return "shm" if usable else "collective"


def _shared_buffer(groups: Groups, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
    """A flat `dtype` buffer of >= numel elements mapped by every rank of the mp group (kept
    between syncs); None on every rank if any rank could not map it (then the collectives run)."""
    ranks = _mp_ranks(groups)
    buf = _SHM.get((ranks, dtype))
    if buf is not None and buf.numel() >= numel:
        return buf
    _SHM.pop((ranks, dtype), None)
    first = dist.get_rank(groups.mp) == 0
    name = [""]
    if first:
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix="megaprm-weight-sync-", dir=SHM_DIR)
            try:
                os.posix_fallocate(fd, 0, numel * dtype.itemsize)  # ENOSPC now, not SIGBUS later
            finally:
                os.close(fd)
            name[0] = path
        except OSError:
            if path:
                os.unlink(path)
    dist.broadcast_object_list(name, src=ranks[0], group=groups.mp)
    buf = None
    if name[0]:
        try:
            buf = torch.from_file(name[0], shared=True, size=numel, dtype=dtype)
        except (RuntimeError, OSError):
            buf = None
    ok = [None] * len(ranks)
    dist.all_gather_object(ok, buf is not None, group=groups.mp)
    if first and name[0]:
        os.unlink(name[0])  # every rank has mapped it (or failed): the mappings keep it alive
    if not all(ok):
        return None
    _SHM[(ranks, dtype)] = buf
    return buf


# the tp axis of each (destination, source) pair `_kind_copies` returns, by kind
_PAIR_TP_AXIS = {"row": 1}


def _shm_plan(bucket: _Bucket, meta: list, own: list, groups: Groups, spec,
              buf: torch.Tensor) -> _Plan:
    """The bucket's HF tensors as views of the shared buffer (split parameters in their HF
    layout, then the replicated ones), and this rank's writes: its own shard of every split
    parameter copied straight into its place in that layout (the owning stage's ranks), the
    replicated parameters (tp rank 0 of the owning stage only)."""
    tp, r = groups.tp_size, groups.tp_rank
    mine = bucket.stage == groups.pp_rank
    dsts, srcs, hf = [], [], {}
    off = 0
    for i in bucket.split:
        rule, shape, _ = meta[i]
        n = _numel(shape)
        out = buf[off: off + tp * n]
        off += tp * n
        # every rank's shard slot reads this rank's shard (stride 0), of which row r is copied
        slab = own[i][1].detach().reshape(1, n).expand(tp, n) if mine else out.view(tp, n)
        hf[i], copies = _kind_copies(rule, spec, tp, slab, shape, out)
        if mine:
            axis = _PAIR_TP_AXIS.get(rule.kind, 0)
            dsts.extend(d.select(axis, r) for d, _ in copies)
            srcs.extend(s.select(axis, r) for _, s in copies)
    for i in bucket.repl:
        n = _numel(meta[i][1])
        view = buf[off: off + n]
        off += n
        hf[i] = mapping.to_hf(meta[i][0], view.view(meta[i][1]), spec, tp)
        if mine and r == 0:
            dsts.append(view)
            srcs.append(own[i][1].detach().reshape(-1))
    return _Plan(bucket, None, [], buf[:off], None, dsts, srcs,
                 [x for i in sorted(hf) for x in hf[i]])


@torch.no_grad()
def _run_shm_plan(plan: _Plan, groups: Groups) -> list[tuple]:
    """Barrier (every rank has copied the previous bucket out of the buffer), this rank's writes
    (one foreach copy), barrier (the bucket is complete) -> the bucket's HF (name, tensor) pairs."""
    dist.barrier(group=groups.mp)
    if plan.dsts:
        torch._foreach_copy_(plan.dsts, plan.srcs)
    dist.barrier(group=groups.mp)
    return list(plan.hf)


def iter_hf_buckets(model, groups: Groups, bucket_bytes: int | None = None,
                    spec=None, transport: str = "auto") -> Iterator[list[tuple]]:
    """Yield lists of (hf_name, full tensor), about `bucket_bytes` each, identically on all ranks.

    Concatenated, the buckets are exactly `iter_hf_weights`' stream, bit for bit. Every rank of
    the model's tp x pp group must iterate to the end (each bucket is a collective).

    The tensors of a bucket are views into buffers that the NEXT bucket overwrites (with
    tp = pp = 1 they are views of the parameters): copy them before asking for the next
    bucket (what `load_weights` of an engine does), or `.clone()` to keep them. Per bucket:
    one `torch.cat` packs this rank's shards, one all-gather into the preallocated flat buffer
    (`all_gather_single` / `all_gather_into_tensor`), one pp broadcast, and one
    `torch._foreach_copy_` reorders the gathered shards into HF tensors through strided views
    (the tp concatenation and the qkv / gate-up split in the same copy).

    `transport`: "collective" (the above), "shm" (CPU, one host: the shards are copied into a
    shared-memory buffer in HF layout, no collective moves bytes; see the module docstring) or
    "auto" (shm where it applies, else collective). The streams are identical, bit for bit.

    With expert parallelism (ep > 1) the buckets are `iter_hf_weights`' tensors one by one:
    the bucketed gathers and the shared buffer know tp and pp only.
    """
    bucket_bytes = default_bucket_bytes() if bucket_bytes is None else bucket_bytes
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be a positive integer (bytes)")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: must be one of {', '.join(TRANSPORTS)}")
    spec = spec or mapping_spec(model)
    if groups.ep_size > 1:
        for pair in iter_hf_weights(model, groups, spec):
            yield [pair]
        return
    own = _own_params(model, spec, groups)
    device = own[0][1].device if own else torch.device("cpu")
    metas = _stage_meta(own, groups)
    buckets = plan_buckets(metas, groups.tp_size, bucket_bytes)
    if groups.tp_size == 1 and groups.pp_size == 1:
        # nothing to communicate: the parameters are the full tensors (zero-copy views,
        # as in `iter_hf_weights`); the consumer copies them
        for bucket in buckets:
            meta = metas[bucket.stage]
            yield [x for i in sorted(bucket.split + bucket.repl)
                   for x in mapping.to_hf(meta[i][0], own[i][1].detach(), spec, 1)]
        return
    sizes = _buffer_sizes(buckets, metas, groups.tp_size)
    if _transport(transport, groups, device) == "shm":
        shared = {dt: _shared_buffer(groups, dt, flat) for dt, (_, flat, _) in sizes.items()}
        if all(b is not None for b in shared.values()):  # agreed over the mp group
            plans = [_shm_plan(b, metas[b.stage], own, groups, spec, shared[b.dtype])
                     for b in buckets]
            for plan in plans:
                yield _run_shm_plan(plan, groups)
            return
        if transport == "shm":
            raise RuntimeError(f"transport='shm': could not map a shared buffer in {SHM_DIR}")
    bufs = _Buffers(sizes, device)
    plans = [_plan(b, metas[b.stage], own, groups, spec, bufs) for b in buckets]
    for plan in plans:
        yield _run_plan(plan, groups)


def sync_into(load_fn, model, groups: Groups, bucket_bytes: int | None = None,
              spec=None, transport: str = "auto") -> dict:
    """Stream the model's HF weights into `load_fn(iterable of (name, tensor))` (e.g.
    `engine.update_weights` or `engine.load_weights`) through `iter_hf_buckets`; call on every
    rank. Returns `{"seconds", "bytes", "gbps", "buckets"}` (bytes of HF tensors delivered,
    GB/s = 1e9 bytes per second), for the trainer's `time/weight_sync` metrics."""
    counts = {"bytes": 0, "buckets": 0}

    def stream():
        for bucket in iter_hf_buckets(model, groups, bucket_bytes, spec, transport):
            counts["buckets"] += 1
            for name, t in bucket:
                counts["bytes"] += t.numel() * t.element_size()
                yield name, t

    start = time.perf_counter()
    load_fn(stream())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": counts["bytes"], "buckets": counts["buckets"],
            "gbps": counts["bytes"] / max(seconds, 1e-12) / 1e9}


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
                 strict: bool = True, spec=None, transport: str = "auto") -> SyncStats:
    """Stream the model into `engine.load_weights` bucket by bucket (one call, so a strict engine
    can report what it never received). Call on every rank; each rank's engine gets the whole
    model. The engine must be awake (its weights resident) while this runs."""
    counts = {"bytes": 0, "buckets": 0, "peak": 0}

    def stream():
        for bucket in iter_hf_buckets(model, groups, bucket_bytes, spec, transport):
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

"""Separate placement (`rollout.placement: separate`, docs/rollout.md "Placement"): the last
`rollout.ranks` ranks of one launch run the engine alone; the first world - ranks are the
trainer (Megatron tp/pp/dp over them, as a colocated run over the whole world).

One torchrun world, split before Megatron starts (`split_world`):

* trainer ranks: the default process group is theirs alone (WORLD_SIZE becomes their count),
  so every collective of the trainer (Megatron's groups, checkpoints, the fault agreement) is
  exactly a colocated run's on that many ranks;
* every rank: one gloo group over the whole launch (`xfer`), used point to point only: trainer
  rank 0 sends the rollout ranks their orders in one ordered channel (weights, prompt blocks to
  draw, evaluation, stop), each engine's leader sends the batches of the dp shards its engine
  serves to the trainer ranks of those shards;
* trainer rank 0 and the rollout ranks: the `weights` group (ranks 0, 1 .. rollout.ranks),
  broadcasts of the weight buckets only;
* rollout ranks: the default process group is theirs alone (rank r - trainers of
  rollout.ranks), the world vLLM's `external_launcher` builds its groups in.

Engines (`rollout.tp` = tp): each run of tp consecutive rollout ranks is one engine, its first
rank the engine's leader. With vLLM each rank is one worker of its engine (SPMD: vLLM's torchrun
examples, `examples/offline_inference/torchrun_example.py`: every rank gives the same prompts
and seed), laid out by vLLM as ExternalDP x TP over the rollout ranks' default group
(`distributed/parallel_state.py` `initialize_model_parallel`: the tp groups are runs of tp
consecutive ranks). So trainer rank 0 sends every order to every rank of the engine (the same
bytes: prompts, sampling seeds), every rank draws, and only the leader sends the batches back.

Weights (trainer/rollout_source.py: `RemoteSource.sync` -> `serve`): every trainer rank runs the HF-layout bucketed gather
of rollout/weight_sync.py (tp and pp pieces joined on the trainer side); trainer rank 0 packs
each bucket's tensors, as raw bytes, into one flat buffer and broadcasts it over the `weights`
group (trainer rank 0 and every rollout rank: NCCL on GPU, gloo on the CPU; every rank of an
engine takes the whole HF stream, and vLLM's `load_weights` keeps its own tp shard), after a small
"weights" order on the channel (the version, and the bucket plan - names, shapes, dtypes,
offsets - when it changed). The broadcasts are issued asynchronously: trainer rank 0 returns at
once and keeps the buffers until the rollout ranks have taken them (a rollout rank drawing ahead
posts its side when it reaches the order); it waits for a version only when
max(1, max_staleness) versions are already in flight, and at stop. A rollout rank receives the
buckets into one reused buffer and loads them with `engine.update_weights`, bucket by bucket.
Each load is one weight version; every batch travels with the version it was drawn with.

Staleness (`rollout.max_staleness` = k): trainer rank 0 orders the k prompt blocks after the one
it needs now as well, so a rollout rank draws them while the trainer trains. The channel is in
order, so a block ordered at trainer version v is drawn with exactly version v: a block is
ordered when the block k before it is consumed, and every step consumes at least one block, so
it is consumed at most k versions later. The schedule does not depend on timing: a run is
reproducible, and k = 0 draws every block with the weights a colocated run would hold.

Sampling seeds are the colocated run's (trainer/rollout_source.sampling_params: trainer seed,
block, dp rank), so the same weights draw the same samples in either placement.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megaprm.errors import ConfigError
from megaprm.parallel.device import default_backend, rank_device

CTRL, DATA, EVAL = 11, 12, 13  # message tags: orders (trainer 0 -> rollout), batches, evaluation


@dataclass
class Placement:
    """This rank's side of a separate placement: `rank` in the launch, `trainers` = the trainer
    ranks' count (ranks 0 .. trainers-1), `rollout_ranks` the rest, in engines of `tp`
    consecutive ranks; `xfer` the gloo group over the whole launch (ranks = launch ranks)."""

    rank: int
    world: int
    trainers: int
    rollout_ranks: list
    xfer: object = None
    store: object = None
    pending: list = field(default_factory=list)  # sends in flight (buffers kept alive)
    weights: object = None  # trainer rank 0 and the rollout ranks (None on other trainer ranks)
    device: object = None  # where the weights group's buffers live
    tp: int = 1  # rollout ranks per engine (rollout.tp)

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    @property
    def engines(self) -> list:
        """The launch ranks of each engine: [[t, .., t+tp-1], [t+tp, ..], ..] (t = trainers)."""
        r = self.rollout_ranks
        return [r[i:i + self.tp] for i in range(0, len(r), self.tp)]

    @property
    def leaders(self) -> list:
        """Each engine's first rank: the one that replies to the trainer."""
        return [e[0] for e in self.engines]

    @property
    def is_leader(self) -> bool:
        return self.rank in self.leaders

    @contextlib.contextmanager
    def engine_env(self):
        """On a rollout rank, while its engine is built: RANK and WORLD_SIZE are this rank's
        place among the rollout ranks (their default group), which vLLM's external_launcher
        reads (`v1/executor/uniproc_executor.py` `ExecutorWithExternalLauncher._distributed_args`
        takes the worker's rank from RANK; LOCAL_RANK, its GPU, stays the launch's). Restored
        after: the launcher's error files and lines name launch ranks."""
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        os.environ.update(RANK=str(self.rank - self.trainers),
                          WORLD_SIZE=str(len(self.rollout_ranks)))
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_CURRENT: Optional[Placement] = None


def current() -> Optional[Placement]:
    """The placement `split_world` made in this process (None: colocated)."""
    return _CURRENT


def split_world(cfg, timeout_minutes: int = 30) -> Optional[Placement]:
    """Call on every rank of the launch before `init_distributed` (which then sees the trainer's
    world on trainer ranks). Colocated: does nothing, returns None."""
    global _CURRENT
    if cfg.rollout.placement != "separate":
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    k = cfg.rollout.ranks
    if world - k < 1:
        raise ConfigError(f"rollout.ranks={k} leaves no trainer rank in a launch of {world}; "
                          "launch more processes (--nproc) or lower rollout.ranks")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("rollout.placement=separate needs a multi-process launch "
                          "(megaprm train --nproc N, N > rollout.ranks)")
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    xfer = dist.ProcessGroupGloo(dist.PrefixStore("megaprm/xfer", store), rank, world, timeout)
    trainers = world - k
    weights, device = None, None
    if rank == 0 or rank >= trainers:
        weights, device = _weights_group(store, 0 if rank == 0 else rank - trainers + 1, k + 1,
                                         timeout)
    if rank < trainers:
        os.environ["WORLD_SIZE"] = str(trainers)
        dist.init_process_group(default_backend(), store=dist.PrefixStore("megaprm/trainer", store),
                                rank=rank, world_size=trainers, timeout=timeout)
    else:  # the engines' world (vLLM's groups are made in it; see `Placement.engine_env`)
        dist.init_process_group(default_backend(), store=dist.PrefixStore("megaprm/rollout", store),
                                rank=rank - trainers, world_size=k, timeout=timeout)
    _CURRENT = Placement(rank, world, trainers, list(range(trainers, world)), xfer, store,
                         weights=weights, device=device, tp=cfg.rollout.tp)
    return _CURRENT


def _weights_group(store, rank: int, size: int, timeout) -> tuple:
    """The weights group (trainer rank 0 = 0, rollout ranks 1 .. size-1) and its device: this
    rank's GPU where CUDA is present (the trainer's tensors and the engine's weights are there),
    over NCCL, or over gloo with CUDA tensors where the ranks share one GPU
    (`device.default_backend`); else gloo on the CPU. Built by its members only, from their
    launch store."""
    device = rank_device()
    wstore = dist.PrefixStore("megaprm/weights", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cuda" and default_backend() == "nccl":  # never run: needs 2 GPUs
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(wstore, rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(wstore, rank, size, timeout)
    # one collective now, while every member is here: NCCL creates its communicator at the first
    # one, which must not be a sync's broadcast while the rollout ranks are drawing
    _broadcast(group, torch.zeros(1, device=device)).wait()
    return group, device


# ----------------------------------------------------------------------------- weight buckets
#
# A bucket travels as one flat uint8 buffer: its tensors' bytes one after the other, each at an
# offset aligned to ALIGN bytes (so a view of any dtype can start there). The plan of a version
# is, per bucket, ((name, shape, dtype, offset), ...) and the buffer's size in bytes.

ALIGN = 64


def bucket_layout(bucket: list) -> tuple:
    """((name, shape, dtype, offset) per tensor, total bytes) of one bucket of (name, tensor)."""
    out, off = [], 0
    for name, t in bucket:
        off = -(-off // ALIGN) * ALIGN
        out.append((name, tuple(t.shape), t.dtype, off))
        off += t.numel() * t.element_size()
    return tuple(out), off


def _view(buf: torch.Tensor, shape: tuple, dtype: torch.dtype, off: int) -> torch.Tensor:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return buf[off:off + n].view(dtype).view(shape)


@torch.no_grad()
def pack_bucket(bucket: list, layout: tuple, buf: torch.Tensor) -> None:
    """Copy the bucket's tensors (any dtypes, strides) into `buf` (uint8, >= the layout's size)."""
    dsts = [_view(buf, shape, dtype, off) for _, shape, dtype, off in layout]
    if dsts:
        torch._foreach_copy_(dsts, [t.detach() for _, t in bucket])


def unpack_bucket(buf: torch.Tensor, layout: tuple) -> list:
    """The bucket's (name, tensor) pairs as views of `buf` (valid until `buf` is rewritten)."""
    return [(name, _view(buf, shape, dtype, off)) for name, shape, dtype, off in layout]


def _broadcast(group, t: torch.Tensor):
    """An asynchronous broadcast from the weights group's rank 0 (the Work)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([t], opts)


class WeightSender:
    """Trainer rank 0's end of the weights group. `send(version, buckets)`: packs every bucket
    into host buffers (pinned on CUDA; reused by later versions), orders the rollout ranks to
    take version `version` (the plan rides along when it changed) and returns; a thread of its
    own streams the versions, oldest first, bucket by bucket: each bucket copied into one of
    two device buffers and broadcast, a buffer reused once its broadcast completed. So the
    versions in flight wait in host memory and the device holds two buckets of them, whatever
    the model's size or max_staleness (on the CPU the host buffers are broadcast as they are).
    At most `in_flight` versions are outstanding: the oldest is waited for before a new one is
    packed. `drain()` waits for all."""

    def __init__(self, p: Placement, in_flight: int = 1):
        self.p, self.in_flight = p, max(1, in_flight)
        self.outstanding: list = []  # [(done event, host buffers)] oldest first
        self.free: list = []  # host buffer sets of completed versions
        self.plan = None
        self.staging: list = []  # the two device buffers (CUDA)
        self.jobs: queue.Queue = queue.Queue()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._stream, name="megaprm-weights", daemon=True)
        self.thread.start()

    def _stream(self) -> None:
        """The thread: each version's buckets in order (`None` ends it)."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            bufs, done = job
            try:
                if self.error is None:
                    self._broadcast_version(bufs)
            except BaseException as e:  # re-raised by the next send or drain
                self.error = e
            finally:
                done.set()

    def _broadcast_version(self, bufs: list) -> None:
        if self.p.device.type != "cuda":  # gloo on the CPU: the host buffers themselves
            for w in [_broadcast(self.p.weights, b) for b in bufs]:
                w.wait()
            return
        largest = max((b.numel() for b in bufs), default=0)
        if not self.staging or self.staging[0].numel() < largest:
            self.staging = [torch.empty(largest, dtype=torch.uint8, device=self.p.device)
                            for _ in range(2)]
        works = [None, None]
        for i, buf in enumerate(bufs):
            slot = i % 2
            if works[slot] is not None:  # the buffer's previous bucket has gone out
                works[slot].wait()
            view = self.staging[slot][:buf.numel()]
            view.copy_(buf, non_blocking=True)
            works[slot] = _broadcast(self.p.weights, view)
        for w in works:
            if w is not None:
                w.wait()
        torch.cuda.synchronize(self.p.device)  # the host buffers may be reused from here

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _retire(self, keep: int) -> None:
        """Release the versions whose broadcasts completed; wait for the oldest ones until at most
        `keep` are outstanding."""
        while self.outstanding and (len(self.outstanding) > keep
                                    or self.outstanding[0][0].is_set()):
            done, bufs = self.outstanding.pop(0)
            done.wait()
            self.free.append(bufs)
        self._check()

    def send(self, version: int, buckets) -> dict:
        """Returns {"bytes": HF tensor bytes, "wait_seconds": time spent waiting for an older
        version's broadcasts}."""
        t0 = time.perf_counter()
        self._retire(keep=self.in_flight - 1)
        waited = time.perf_counter() - t0
        old = self.free.pop() if self.free else []
        pin = self.p.device.type == "cuda"
        plan, bufs, nbytes = [], [], 0
        for i, bucket in enumerate(buckets):
            layout, size = bucket_layout(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            buf = old[i] if i < len(old) and old[i].numel() == size else None
            if buf is None:
                buf = torch.zeros(size, dtype=torch.uint8, device="cpu", pin_memory=pin)
            pack_bucket(bucket, layout, buf)
            plan.append((layout, size))
            bufs.append(buf)
        plan = tuple(plan)
        order = ("weights", version, plan if plan != self.plan else None)
        self.plan = plan
        for s in self.p.rollout_ranks:
            send(self.p, order, s, CTRL, wait=False)
        done = threading.Event()
        self.outstanding.append((done, bufs))
        self.jobs.put((bufs, done))
        return {"bytes": nbytes, "wait_seconds": waited}

    def drain(self) -> None:
        self._retire(keep=0)


class WeightReceiver:
    """A rollout rank's end: `receive(plan)` yields the version's (name, tensor) pairs bucket by
    bucket, each bucket received into one buffer reused by every bucket and version (a bucket's
    tensors are valid until the next pair after it is asked for: the engine copies them)."""

    def __init__(self, p: Placement):
        self.p, self.plan = p, None
        self.buf = torch.empty(0, dtype=torch.uint8, device=p.device)

    def receive(self, plan=None):
        self.plan = plan if plan is not None else self.plan
        if self.plan is None:
            raise RuntimeError("a weights order without a bucket plan came first")
        largest = max((size for _, size in self.plan), default=0)
        if self.buf.numel() < largest:
            self.buf = torch.empty(largest, dtype=torch.uint8, device=self.p.device)
        for layout, size in self.plan:
            view = self.buf[:size]
            with from_trainer():
                _broadcast(self.p.weights, view).wait()
            yield from unpack_bucket(view, layout)


LOST_WAIT_S = 60.0


@contextlib.contextmanager
def from_trainer():
    """A rollout rank's wait on trainer rank 0. Raising means that rank is gone (killed, or
    failed): the launcher stops every rank and names the one that failed first, so wait to be
    stopped rather than race its one line with a traceback of this rank's own (a kill -9 of
    trainer rank 0 mid-transfer did); re-raised if nothing stops this rank in LOST_WAIT_S."""
    try:
        yield
    except RuntimeError:
        time.sleep(LOST_WAIT_S)
        raise


# ----------------------------------------------------------------------------- messages

def _encode(obj) -> tuple:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


def send(p: Placement, obj, dst: int, tag: int, wait: bool = True) -> None:
    """One Python object to launch rank `dst` (size, then bytes). wait=False: returns at once;
    the buffers stay referenced in `p.pending` until the send completes."""
    n, data = _encode(obj)
    works = [p.xfer.send([n], dst, tag), p.xfer.send([data], dst, tag)]
    if wait:
        for w in works:
            w.wait()
    else:
        p.pending = [x for x in p.pending if not x[0].is_completed()]
        p.pending += [(w, t) for w, t in zip(works, (n, data))]


def recv(p: Placement, src: int, tag: int):
    n = torch.zeros(1, dtype=torch.int64)
    p.xfer.recv([n], src, tag).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    p.xfer.recv([data], src, tag).wait()
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

"""Separate placement (`rollout.placement: separate`, docs/rollout.md "Placement"): the last
`rollout.ranks` ranks of one launch run the engine alone; the first world - ranks are the
trainer (Megatron tp/pp/dp over them, as a colocated run over the whole world).

One torchrun world, split before Megatron starts (`split_world`):

* trainer ranks: the default process group is theirs alone (WORLD_SIZE becomes their count),
  so every collective of the trainer (Megatron's groups, checkpoints, the fault agreement) is
  exactly a colocated run's on that many ranks;
* every rank: one gloo group over the whole launch (`xfer`), used point to point only: trainer
  rank 0 sends the rollout ranks their orders in one ordered channel (weights, prompt blocks to
  draw, evaluation, stop), each rollout rank sends the batches of the dp shards it serves to the
  trainer ranks of those shards.

Weights: every trainer rank runs the HF-layout bucketed gather of parallel/weight_sync.py (tp
and pp pieces joined on the trainer side); trainer rank 0 sends the full tensors to each rollout
rank, which loads them with `engine.update_weights`. Each load is one weight version; every
batch travels with the version it was drawn with.

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

import datetime
import io
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

CTRL, DATA, EVAL = 11, 12, 13  # message tags: orders (trainer 0 -> rollout), batches, evaluation


@dataclass
class Placement:
    """This rank's side of a separate placement: `rank` in the launch, `trainers` = the trainer
    ranks' count (ranks 0 .. trainers-1), `rollout_ranks` the rest; `xfer` the gloo group over
    the whole launch (ranks = launch ranks)."""

    rank: int
    world: int
    trainers: int
    rollout_ranks: list
    xfer: object = None
    store: object = None
    pending: list = field(default_factory=list)  # sends in flight (buffers kept alive)

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers


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
    from megaprm.config import ConfigError

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
    if rank < trainers:
        os.environ["WORLD_SIZE"] = str(trainers)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("megaprm/trainer", store),
                                rank=rank, world_size=trainers, timeout=timeout)
    _CURRENT = Placement(rank, world, trainers, list(range(trainers, world)), xfer, store)
    return _CURRENT


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


# ----------------------------------------------------------------------------- trainer side

class RemoteSource:
    """The trainer's rollout source under a separate placement (the interface of
    trainer/rollout_source.ColocatedSource): `generate(block, ...)` returns this rank's batch of
    prompt block `block` with `row_versions` [B] set; `sync()` streams the actor's weights to the
    rollout ranks (collective over the trainer ranks); `evaluate()` runs the held-out evaluation
    on rollout rank 0 with the newest weights; `stop()` ends the rollout ranks' loop."""

    def __init__(self, tr, placement: Placement):
        self.tr, self.p = tr, placement
        self.k = tr.cfg.rollout.max_staleness
        self.version = -1
        self.ordered = -1  # the last block ordered from the rollout ranks
        g = tr.groups
        servers = placement.rollout_ranks
        self.server = servers[g.dp_rank % len(servers)]
        # which trainer ranks hold each dp shard (every tp/pp peer gets the same batch)
        ranks_of: list = [None] * g.world_size
        if g.world_size > 1:
            dist.all_gather_object(ranks_of, g.dp_rank, group=g.agree)
        else:
            ranks_of = [g.dp_rank]
        self.dp_ranks = {d: [r for r, x in enumerate(ranks_of) if x == d]
                         for d in range(g.dp_size)}

    def _order(self, block: int) -> None:
        """Trainer rank 0: order block `block` (every dp shard) from its rollout rank."""
        from megaprm.trainer.data import encode_prompts
        from megaprm.trainer.rollout_source import local_prompts, sampling_params

        tr, servers = self.tr, self.p.rollout_ranks
        per_server: dict = {s: [] for s in servers}
        for d, dsts in self.dp_ranks.items():
            local, _ = local_prompts(tr.data, block, d, tr.groups.dp_size)
            per_server[servers[d % len(servers)]].append(
                (encode_prompts(tr.tok, local.texts), sampling_params(tr.cfg, block, d, tr.eos),
                 dsts))
        for s, shards in per_server.items():
            if shards:
                send(self.p, ("generate", block, shards), s, CTRL)

    def generate(self, block: int, ids=None, params=None):
        """This rank's batch of `block` (ids/params: the colocated interface's; the rollout
        rank draws the same ones, ordered by trainer rank 0)."""
        if self.tr.groups.rank == 0:
            for b in range(max(self.ordered + 1, block), block + self.k + 1):
                self._order(b)
            self.ordered = max(self.ordered, block + self.k)
        kind, got, version, batch = recv(self.p, self.server, DATA)
        assert kind == "batch" and got == block, (kind, got, block)
        batch.row_versions = torch.full((batch.batch_size,), version, dtype=torch.long)
        return batch

    def sync(self) -> None:
        """The actor's HF weights (bucketed gather, every trainer rank) -> each rollout rank
        (sent by trainer rank 0); the new version."""
        import time

        from megaprm.parallel import weight_sync

        tr = self.tr
        start = time.perf_counter()
        tensors, nbytes = [], 0
        for bucket in weight_sync.iter_hf_buckets(tr.actor.model, tr.groups):
            for name, t in bucket:
                nbytes += t.numel() * t.element_size()
                if tr.groups.rank == 0:
                    tensors.append((name, t.detach().to("cpu", copy=True)))
        self.version += 1
        if tr.groups.rank == 0:
            for s in self.p.rollout_ranks:
                send(self.p, ("weights", self.version, tensors), s, CTRL)
        seconds = time.perf_counter() - start
        tr.last_sync = {"weight_sync/seconds": seconds, "weight_sync/gbytes": nbytes / 1e9,
                        "weight_sync/gbps": nbytes / max(seconds, 1e-12) / 1e9}

    def evaluate(self) -> dict:
        g = self.tr.groups
        out = None
        if g.rank == 0:
            send(self.p, ("eval",), self.p.rollout_ranks[0], CTRL)
            out = recv(self.p, self.p.rollout_ranks[0], EVAL)
        if g.world_size > 1:
            box = [out]
            dist.broadcast_object_list(box, src=0, group=g.agree)
            out = box[0]
        return out

    def stop(self) -> None:
        if self.tr.groups.rank == 0:
            for s in self.p.rollout_ranks:
                send(self.p, ("stop",), s, CTRL)


# ----------------------------------------------------------------------------- rollout side

def serve(cfg, placement: Placement, tokenizer) -> int:
    """A rollout rank's whole life: build the engine, then obey trainer rank 0's orders in
    order until "stop". Returns the number of batches drawn."""
    from megaprm.parallel.device import rank_device
    from megaprm.parallel.groups import Groups
    from megaprm.rollout.factory import build_engine
    from megaprm.trainer import model_source
    from megaprm.trainer.evaluate import evaluate_with

    src = model_source.resolve(cfg.model.path, "model.path")
    engine = build_engine(cfg.rollout, src.hf_dir, tokenizer, world_size=1, tp_size=1,
                          seed=cfg.trainer.seed, device=rank_device(), load_weights=False)
    alone = Groups(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, cp_size=1,
                   tp_rank=0, pp_rank=0, dp_rank=0, cp_rank=0)
    version, drawn = -1, 0
    kill_at = int(os.environ.get("MEGAPRM_KILL_ROLLOUT_AT", "-1"))  # tests only: SIGKILL here
    while True:
        msg = recv(placement, 0, CTRL)
        if msg[0] == "weights":
            version = msg[1]
            engine.update_weights(iter(msg[2]))
        elif msg[0] == "generate":
            block, shards = msg[1], msg[2]
            for ids, params, dsts in shards:
                if drawn == kill_at:
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                batch = engine.generate(ids, params)
                drawn += 1
                for dst in dsts:
                    send(placement, ("batch", block, version, batch), dst, DATA, wait=False)
        elif msg[0] == "eval":
            send(placement, evaluate_with(cfg, engine, tokenizer, alone), 0, EVAL)
        elif msg[0] == "stop":
            return drawn

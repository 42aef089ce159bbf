"""Phase: rollout. Where the step's samples come from, behind one interface (`source.generate`,
`sync`, `evaluate`, `stop`, `version`): the colocated engine on the trainer's own ranks (its
memory lifecycle in trainer/lifecycle.py), or the rollout ranks of a separate placement
(`RemoteSource` here, `serve` on the rollout ranks; the transport in rollout/remote.py). Every
batch carries `row_versions` [B], the weight version it was drawn with. The sampling seed of a
prompt block is fixed by (trainer seed, block, dp rank), so every placement draws the same
samples."""
from __future__ import annotations

import functools
import time
from typing import Callable, List, TypeVar

import torch
import torch.distributed as dist

from checkpoint_tools import model_source
from megaprm import faults
from megaprm.config import Config
from megaprm.errors import ConfigError
from megaprm.rollout.config import RolloutConfig
from megaprm.parallel.device import rank_device
from megaprm.parallel.groups import Groups
from megaprm.parallel.offload import Offload
from megaprm.rollout import factory, remote, weight_sync
from megaprm.rollout.engine import RolloutBatch, SamplingParams
from megaprm.trainer.rl.data import Prompts, encode_prompts
from megaprm.trainer.rl.evaluate import evaluate_with
from megaprm.trainer.rl.lifecycle import Lifecycle

T = TypeVar("T")

def sampling_params(cfg, block: int, dp_rank: int, eos: int) -> SamplingParams:
    """The sampling of prompt block `block` for dp rank `dp_rank`'s share (same seed on every
    tp/pp peer, and wherever the engine runs)."""
    return SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                          top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_tokens,
                          stop_token_ids=(eos,),
                          seed=(cfg.trainer.seed * 1_000_003 + block * 7919
                                + dp_rank * 104_729) % (2**31))


class ColocatedSource:
    """The engine on this rank, between the trainer's state leaving the device and coming back
    (`Lifecycle.generate`: the engine sleeps after it); `sync` streams the actor's weights
    into it. `version`: the number of syncs so far (the weights every batch was drawn with).
    `cfg`, `tok`, `groups`: what the held-out evaluation reads."""

    def __init__(self, engine, lifecycle: Lifecycle, cfg: Config, tok, groups: Groups):
        self.engine, self.lifecycle, self.version = engine, lifecycle, -1
        self.cfg, self.tok, self.groups = cfg, tok, groups

    def generate(self, block: int, ids: list, params: SamplingParams) -> RolloutBatch:
        batch = self.lifecycle.generate(lambda: self.engine.generate(ids, params))
        batch.row_versions = torch.full((batch.batch_size,), self.version, dtype=torch.long)
        return batch

    def with_engine(self, fn: Callable[[object], T]) -> T:
        """fn(engine) while the engine generates: the trainer's state offloaded, the engine
        awake with the actor's weights (synced first where it slept since), asleep after."""
        return self.lifecycle.generate(lambda: fn(self.engine))

    def evaluate(self) -> dict:
        return self.with_engine(lambda engine: evaluate_with(self.cfg, engine, self.tok,
                                                             self.groups))

    def stop(self) -> None:
        pass

    def sync(self) -> dict:
        """The actor's weights -> the engine; the new version. Returns the stream's metrics."""
        out = self.lifecycle.sync()
        self.version += 1
        return out


def build_engine(rollout_cfg: RolloutConfig, seed: int, hf_dir: str, tok, groups: Groups):
    """The colocated rollout engine on this rank's device, asleep (None under a separate
    placement). vLLM: external_launcher when world > 1, the trainer's tp, one seed per tp
    group; it starts from the policy's HF config (`hf_dir`) and holds the actor's weights after
    the first sync (it reads no weights: the actor's are checked and loaded once, by the
    actor). Built before the trainer's models: vLLM's start-up check wants utilisation x total
    memory free, which the actor, reference and PRM would no longer leave."""
    if rollout_cfg.placement == "separate":
        return None
    g = groups
    engine = factory.build_engine(rollout_cfg, hf_dir, tok, world_size=g.world_size,
                   tp_size=g.tp_size, seed=seed, device=rank_device(),
                   load_weights=False)
    engine.sleep()  # the first sync wakes its weights with the actor's
    return engine


def make_source(cfg: Config, groups: Groups, engine, actor_model, data, tok, eos: int,
                offloaded: List[Offload]) -> tuple:
    """(lifecycle or None, the rollout source) of `cfg.rollout.placement`: the colocated
    `engine` (built by `build_engine`) fed the actor's weights, `offloaded` (`offloads`) leaving
    the device while it generates; or the rollout ranks, which draw from `data` (block ->
    Prompts) with `tok` and stop at `eos`."""
    if cfg.rollout.placement == "separate":
        placement = remote.current()
        if placement is None:
            raise ConfigError("rollout.placement=separate: the launch must split its ranks "
                              "first (megaprm train does; rollout.remote.split_world)")
        return None, RemoteSource(placement, cfg, groups, data, tok, eos, actor_model)
    lifecycle = Lifecycle(engine, functools.partial(stream_weights, engine, actor_model, groups),
                          offloaded)
    return lifecycle, ColocatedSource(engine, lifecycle, cfg, tok, groups)


def offloads(cfg: Config, actor, ref, prm) -> List[Offload]:
    """The models whose `*.offload` switch is on, with their optimizers: they leave the device
    while the colocated engine generates. `actor`, `ref` (or None): Policy; `prm`: the trainer's
    PRM slot (None, `.kind` discriminative: its model; implicit: its trained policy, and its
    reference at T = 1, which follows ref.offload where it is not the actor's reference)."""
    out = []
    implicit = prm is not None and prm.kind == "implicit"
    if cfg.actor.offload:
        out.append(Offload("actor", actor.model, actor.opt))
    if cfg.ref.offload:
        refs = [ref, prm.ref if implicit else None]
        out += [Offload("ref", r.model) for i, r in enumerate(refs)
                if r is not None and r not in refs[:i]]
    if cfg.prm.offload and prm is not None and prm.kind == "discriminative":
        out.append(Offload("prm", prm.model))
    if cfg.prm.offload and implicit:
        out.append(Offload("prm", prm.policy.model, prm.policy.opt))
    return out


def stream_weights(engine, actor_model, groups: Groups) -> dict:
    """The lifecycle's weight stream: the actor's HF-layout buckets into the colocated engine.
    Returns its metrics (`weight_sync/seconds`, `gbytes`, `gbps`)."""
    load = functools.partial(engine.update_weights, wake_kv_cache=False)
    s = weight_sync.sync_into(load, actor_model, groups)
    return {"weight_sync/seconds": s["seconds"],
            "weight_sync/gbytes": s["bytes"] / 1e9, "weight_sync/gbps": s["gbps"]}


def local_prompts(data, block: int, dp_rank: int, dp_size: int, requeued: tuple = ()):
    """dp rank `dp_rank`'s share of prompt block `block` (`data`: block -> Prompts), after the
    `requeued` global prompt ids (block * P + index; rollout.refill_surplus=requeue). Returns
    (`Prompts`, global group ids)."""
    prompts = data(block)
    P = len(prompts.texts)
    per = P // dp_size
    lo = dp_rank * per
    local = prompts.shard(lo, lo + per)
    ids_of_groups = torch.tensor([*requeued, *range(block * P + lo, block * P + lo + per)])
    if requeued:
        local = Prompts.cat([data(gid // P).shard(gid % P, gid % P + 1)
                             for gid in requeued] + [local])
    return local, ids_of_groups


def rollout(source, data, tok, cfg, groups, eos: int, block: int, requeued: tuple = ()):
    """Phase: this rank's share of prompt block `block` (= the step without refill) -> n
    samples each from `source` (ColocatedSource or RemoteSource); `requeued` prompts first.
    `data`: block -> Prompts. Returns (batch, this rank's `Prompts`, global group ids [B])."""
    g = groups
    local, ids_of_groups = local_prompts(data, block, g.dp_rank, g.dp_size, requeued)
    params = sampling_params(cfg, block, g.dp_rank, eos)
    batch = source.generate(block, encode_prompts(tok, local.texts), params)
    return batch, local, ids_of_groups[batch.group_index].long()


# ----------------------------------------------------------------------------- separate placement

class RemoteSource:
    """The trainer's rollout source under a separate placement (ColocatedSource's interface):
    `generate(block, ...)` returns this rank's batch of prompt block `block` with
    `row_versions` [B] set; `sync()` streams the actor's weights to the
    rollout ranks (collective over the trainer ranks); `evaluate()` runs the held-out evaluation
    on engine 0 (its leader replies) with the newest weights; `stop()` ends the rollout ranks' loop."""

    def __init__(self, placement: remote.Placement, cfg: Config, groups: Groups, data, tok,
                 eos: int, actor_model):
        """`data`: block -> Prompts (trainer rank 0 orders every dp shard's prompts, encoded
        with `tok`, stopping at `eos`); `actor_model`: whose weights `sync` streams."""
        self.p, self.cfg, self.groups = placement, cfg, groups
        self.data, self.tok, self.eos, self.actor_model = data, tok, eos, actor_model
        self.k = cfg.rollout.max_staleness
        self.version = -1
        self.ordered = -1  # the last block ordered from the rollout ranks
        g = groups
        # dp shard d is drawn by engine d mod engines; its leader sends the batch
        leaders = placement.leaders
        self.server = leaders[g.dp_rank % len(leaders)]
        # which trainer ranks hold each dp shard (every tp/pp peer gets the same batch)
        ranks_of: list = [None] * g.world_size
        if g.world_size > 1:
            dist.all_gather_object(ranks_of, g.dp_rank, group=g.agree)
        else:
            ranks_of = [g.dp_rank]
        self.dp_ranks = {d: [r for r, x in enumerate(ranks_of) if x == d]
                         for d in range(g.dp_size)}
        # trainer rank 0 only; a rollout rank drawing ahead takes version v after the blocks
        # ordered before it, i.e. after the block the trainer consumed max_staleness syncs later
        self.sender = remote.WeightSender(placement, self.k) if g.rank == 0 else None

    def _order(self, block: int) -> None:
        """Trainer rank 0: order block `block` (every dp shard) from its engine: the same order
        to every rank of the engine (its tp workers draw together)."""
        engines = self.p.engines
        per_engine: list = [[] for _ in engines]
        for d, dsts in self.dp_ranks.items():
            local, _ = local_prompts(self.data, block, d, self.groups.dp_size)
            per_engine[d % len(engines)].append(
                (encode_prompts(self.tok, local.texts),
                 sampling_params(self.cfg, block, d, self.eos), dsts))
        for ranks, shards in zip(engines, per_engine):
            for s in ranks if shards else ():
                # not waited for: a gloo send completes when the receiver takes it
                remote.send(self.p, ("generate", block, shards), s, remote.CTRL, wait=False)

    def generate(self, block: int, ids=None, params=None):
        """This rank's batch of `block` (ids/params: the colocated interface's; the rollout
        rank draws the same ones, ordered by trainer rank 0)."""
        if self.groups.rank == 0:
            for b in range(max(self.ordered + 1, block), block + self.k + 1):
                self._order(b)
            self.ordered = max(self.ordered, block + self.k)
        kind, got, version, batch = remote.recv(self.p, self.server, remote.DATA)
        assert kind == "batch" and got == block, (kind, got, block)
        batch.row_versions = torch.full((batch.batch_size,), version, dtype=torch.long)
        return batch

    def sync(self) -> dict:
        """The actor's HF weights (bucketed gather, every trainer rank) -> the rollout ranks
        (broadcast by trainer rank 0, not waited for); the new version. Returns the metrics:
        `weight_sync/seconds` is
        the trainer's time in this call: the gather, trainer rank 0's packing and issuing, and
        `weight_sync/wait_seconds` of it waiting for an older version to be taken."""
        start = time.perf_counter()
        self.version += 1
        buckets = weight_sync.iter_hf_buckets(self.actor_model, self.groups)
        if self.sender is not None:
            out = self.sender.send(self.version, buckets)
        else:  # the gather is collective: every trainer rank iterates
            out = {"bytes": sum(t.numel() * t.element_size() for b in buckets for _, t in b),
                   "wait_seconds": 0.0}
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/gbytes": out["bytes"] / 1e9,
                "weight_sync/gbps": out["bytes"] / max(seconds, 1e-12) / 1e9,
                "weight_sync/wait_seconds": out["wait_seconds"]}

    def evaluate(self) -> dict:
        g = self.groups
        out = None
        if g.rank == 0:  # engine 0 evaluates (every rank of it); its leader replies
            for s in self.p.engines[0]:
                remote.send(self.p, ("eval",), s, remote.CTRL)
            out = remote.recv(self.p, self.p.leaders[0], remote.EVAL)
        if g.world_size > 1:
            box = [out]
            dist.broadcast_object_list(box, src=0, group=g.agree)
            out = box[0]
        return out

    def stop(self) -> None:
        if self.groups.rank == 0:
            for s in self.p.rollout_ranks:
                remote.send(self.p, ("stop",), s, remote.CTRL)
            self.sender.drain()
            for w, _ in self.p.pending:
                w.wait()
            self.p.pending = []


def serve(cfg, placement: remote.Placement, tokenizer) -> int:
    """A rollout rank's whole life under a separate placement: build its engine's worker (every
    rollout rank at once: vLLM's engines are built collectively over the rollout ranks' default
    group), then obey trainer rank 0's orders in order until "stop": every rank of an engine
    gets the same orders and runs them alike, and only the leader replies. Returns the number
    of batches drawn (by this rank)."""
    src = model_source.resolve(cfg.model.path, "model.path")
    with placement.engine_env():  # vLLM: one worker of a tp engine, on LOCAL_RANK's GPU
        engine = factory.build_engine(cfg.rollout, src.hf_dir, tokenizer,
                                      world_size=len(placement.rollout_ranks),
                                      tp_size=placement.tp, seed=cfg.trainer.seed,
                                      device=rank_device(), load_weights=False,
                                      external_launcher=True)
    alone = Groups(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, cp_size=1,
                   tp_rank=0, pp_rank=0, dp_rank=0, cp_rank=0)
    version, drawn = -1, 0
    weights = remote.WeightReceiver(placement)
    while True:
        with remote.from_trainer():
            msg = remote.recv(placement, 0, remote.CTRL)
        if msg[0] == "weights":
            version, stream = msg[1], weights.receive(msg[2])
            engine.update_weights(stream)
            for _ in stream:  # every bucket's broadcast, whatever the engine left unread
                pass
        elif msg[0] == "generate":
            block, shards = msg[1], msg[2]
            for ids, params, dsts in shards:
                faults.kill_rollout_at(drawn)  # tests only
                batch = engine.generate(ids, params)
                drawn += 1
                for dst in dsts if placement.is_leader else ():
                    remote.send(placement, ("batch", block, version, batch), dst, remote.DATA,
                                wait=False)
        elif msg[0] == "eval":
            out = evaluate_with(cfg, engine, tokenizer, alone)
            if placement.is_leader:
                remote.send(placement, out, 0, remote.EVAL)
        elif msg[0] == "stop":
            return drawn

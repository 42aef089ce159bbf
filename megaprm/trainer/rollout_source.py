"""Phase: rollout. Where the step's samples come from, behind one interface (`source.generate`,
`sync`, `evaluate`, `stop`, `version`): the colocated engine on the trainer's own ranks (its
memory lifecycle in trainer/lifecycle.py), or the rollout ranks of a separate placement
(rollout/remote.py). Every batch carries `row_versions` [B], the weight version it was drawn
with. The sampling seed of a prompt block is fixed by (trainer
seed, block, dp rank), so every placement draws the same samples."""
from __future__ import annotations

import functools
from typing import List

import torch

from megaprm.parallel import weight_sync
from megaprm.parallel.offload import Offload
from megaprm.rollout.engine import RolloutBatch, SamplingParams
from megaprm.trainer.data import Prompts, encode_prompts
from megaprm.trainer.lifecycle import Lifecycle


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
    into it. `version`: the number of syncs so far (the weights every batch was drawn with)."""

    def __init__(self, tr, lifecycle, engine):
        self.tr, self.lifecycle, self.engine, self.version = tr, lifecycle, engine, -1

    def generate(self, block: int, ids: list, params: SamplingParams) -> RolloutBatch:
        batch = self.lifecycle.generate(lambda: self.engine.generate(ids, params))
        batch.row_versions = torch.full((batch.batch_size,), self.version, dtype=torch.long)
        return batch

    def evaluate(self) -> dict:
        from megaprm.trainer.evaluate import evaluate_with

        tr = self.tr
        return self.lifecycle.generate(lambda: evaluate_with(tr.cfg, self.engine, tr.tok,
                                                             tr.groups))

    def stop(self) -> None:
        pass

    def sync(self) -> None:
        self.lifecycle.sync()
        self.version += 1


def build_engine(tr):
    """The colocated rollout engine on this rank's device, asleep (None under a separate
    placement). vLLM: external_launcher when world > 1, the trainer's tp, one seed per tp
    group; it starts from the policy's HF config and holds the actor's weights after the first
    sync (it reads no weights: the actor's are checked and loaded once, by the actor). Built
    before the trainer's models: vLLM's start-up check wants utilisation x total memory free,
    which the actor, reference and PRM would no longer leave."""
    if tr.cfg.rollout.placement == "separate":
        return None
    from megaprm.parallel.device import rank_device
    from megaprm.rollout.factory import build_engine as build

    g = tr.groups
    engine = build(tr.cfg.rollout, tr.src.hf_dir, tr.tok, world_size=g.world_size,
                   tp_size=g.tp_size, seed=tr.cfg.trainer.seed, device=rank_device(),
                   load_weights=False)
    engine.sleep()  # the first sync wakes its weights with the actor's
    return engine


def make_source(tr) -> tuple:
    """(lifecycle or None, the rollout source) of this trainer's placement."""
    if tr.cfg.rollout.placement == "separate":
        from megaprm.config import ConfigError
        from megaprm.rollout import remote

        placement = remote.current()
        if placement is None:
            raise ConfigError("rollout.placement=separate: the launch must split its ranks "
                              "first (megaprm train does; rollout.remote.split_world)")
        return None, remote.RemoteSource(tr, placement)
    lifecycle = Lifecycle(tr.engine, tr._stream_weights, offloads(tr))
    return lifecycle, ColocatedSource(tr, lifecycle, tr.engine)


def offloads(tr) -> List[Offload]:
    """The models whose `*.offload` switch is on, with their optimizers (PRIME's second
    reference at T = 1 follows ref.offload): they leave the device while the colocated engine
    generates."""
    cfg, out = tr.cfg, []
    if cfg.actor.offload:
        out.append(Offload("actor", tr.actor.model, tr.actor.opt))
    if cfg.ref.offload:
        refs = [tr.ref, getattr(tr, "implicit_ref", None)]
        out += [Offload("ref", r.model) for i, r in enumerate(refs)
                if r is not None and r not in refs[:i]]
    if cfg.prm.offload and tr.prm is not None:
        out.append(Offload("prm", tr.prm))
    if cfg.prm.offload and tr.implicit is not None:
        out.append(Offload("prm", tr.implicit.model, tr.implicit.opt))
    return out


def sync_weights(tr) -> None:
    """Phase: new actor weights -> the rollout engine (HF names, one collective per bucket; the
    engine wakes its weights, loads and resets its prefix cache; its KV cache wakes when it
    next generates, after the trainer's state is offloaded)."""
    tr.source.sync()


def stream_weights(tr) -> None:
    """The lifecycle's weight stream: the actor's HF-layout buckets into the colocated engine."""
    load = functools.partial(tr.engine.update_weights, wake_kv_cache=False)
    s = weight_sync.sync_into(load, tr.actor.model, tr.groups)
    tr.last_sync = {"weight_sync/seconds": s["seconds"],
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


def rollout(tr, block: int, requeued: tuple = ()):
    """Phase: this rank's share of prompt block `block` (= the step without refill) -> n
    samples each; `requeued` prompts first. Returns (batch, this rank's `Prompts`, global
    group ids [B])."""
    g = tr.groups
    local, ids_of_groups = local_prompts(tr.data, block, g.dp_rank, g.dp_size, requeued)
    params = sampling_params(tr.cfg, block, g.dp_rank, tr.eos)
    batch = tr.source.generate(block, encode_prompts(tr.tok, local.texts), params)
    return batch, local, ids_of_groups[batch.group_index].long()

"""Phase: rollout. Where the step's samples come from, behind one interface (`source.generate`,
`source.sync`): the colocated engine on the trainer's own ranks (today's placement; its memory
lifecycle in trainer/lifecycle.py). The sampling seed of a prompt block is fixed by (trainer
seed, block, dp rank), so every placement draws the same samples."""
from __future__ import annotations

import functools

import torch

from megaprm.parallel import weight_sync
from megaprm.rollout.engine import RolloutBatch, SamplingParams
from megaprm.trainer.data import Prompts, encode_prompts


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

    def __init__(self, lifecycle, engine):
        self.lifecycle, self.engine, self.version = lifecycle, engine, -1

    def generate(self, ids: list, params: SamplingParams) -> RolloutBatch:
        return self.lifecycle.generate(lambda: self.engine.generate(ids, params))

    def sync(self) -> None:
        self.lifecycle.sync()
        self.version += 1


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


def local_prompts(tr, block: int, requeued: tuple = ()):
    """This dp rank's share of prompt block `block`, after the `requeued` global prompt ids
    (block * P + index; rollout.refill_surplus=requeue). Returns (`Prompts`, group ids)."""
    g = tr.groups
    prompts = tr.data(block)
    P = len(prompts.texts)
    per = P // g.dp_size
    lo = g.dp_rank * per
    local = prompts.shard(lo, lo + per)
    ids_of_groups = torch.tensor([*requeued, *range(block * P + lo, block * P + lo + per)])
    if requeued:
        local = Prompts.cat([tr.data(gid // P).shard(gid % P, gid % P + 1)
                             for gid in requeued] + [local])
    return local, ids_of_groups


def rollout(tr, block: int, requeued: tuple = ()):
    """Phase: this rank's share of prompt block `block` (= the step without refill) -> n
    samples each; `requeued` prompts first. Returns (batch, this rank's `Prompts`, global
    group ids [B])."""
    local, ids_of_groups = local_prompts(tr, block, requeued)
    params = sampling_params(tr.cfg, block, tr.groups.dp_rank, tr.eos)
    batch = tr.source.generate(encode_prompts(tr.tok, local.texts), params)
    return batch, local, ids_of_groups[batch.group_index].long()

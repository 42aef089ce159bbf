"""Phases rollout + outcome reward with dynamic sampling (`rollout.refill`): draw prompt blocks
from the rollout source until the step's share of groups passes the filter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

from megaprm.algorithms import filters
from megaprm.config import Config
from megaprm.parallel import pipeline
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree, dp_reduce, dp_sum
from megaprm.parallel.reductions import group_index, group_moments
from megaprm.rewards.steps import segment_steps
from megaprm.rollout.engine import RolloutBatch
from megaprm.trainer.rl.batch import ScoredBatch, StepSkipped


@dataclass
class Refilled:
    """What `refill_rollout` produced: the step's batch (`passed` set), its metrics, and the
    trainer's data position after it (the next unused prompt block, the prompts to redo)."""

    batch: ScoredBatch
    metrics: dict
    next_block: int
    requeue: list


def refill_rollout(cfg: Config, groups: Groups, sep_ids, t, next_block: int,
                   requeue: Sequence[int],
                   rollout: Callable, outcome_reward: Callable) -> Refilled:
    """Phases rollout + outcome reward with dynamic sampling (`rollout.refill`; PRIME's
    released loop, ray_trainer.py:467-542: generate, verify, filter, until the filtered
    batch holds train_batch_size prompts; DAPO / verl's filter_groups likewise).

    `rollout(block[, requeued])` -> (RolloutBatch, Prompts, group ids) and
    `outcome_reward(batch, prompts, group_ids)` -> ScoredBatch are the two phases; `t` the
    step's PhaseTimer. Each round generates one fresh prompt block (`next_block`) on every rank; each dp
    rank fills its own share P/dp of the step's P groups with the groups of its rounds that
    pass the filter, first come first taken (groups never move between ranks, so the batch
    keeps today's shape [P/dp * n rows] on every rank). Whether another round is needed is
    agreed over dp (the largest shortfall), so every rank runs the same number of rounds.
    After `rollout.max_refill_rounds` extra rounds the shares are topped up with filtered-out
    groups marked `passed = False` (no gradient: the update masks them): the step trains
    on what passed. Surplus passing groups are dropped (verl's DAPO recipe), or with
    `rollout.refill_surplus: requeue` their prompts are generated again at the head of the
    next step's first round (PRIME's add_to_buffer / get_from_buffer, ray_trainer.py:460-480,
    per rank here)."""
    g = groups
    n = cfg.rollout.n
    share = cfg.data.prompts_per_step // g.dp_size
    rounds: list = []  # (ScoredBatch, passed per local group [share])
    taken = 0
    requeued = tuple(requeue)
    while True:
        block = next_block
        next_block += 1
        with t("rollout"):
            batch, prompts, group_ids = (rollout(block, requeued) if requeued
                                         else rollout(block))
        requeued = ()
        fault = None
        with t("outcome_reward"):
            try:
                sb = outcome_reward(batch, prompts, group_ids)
            except FloatingPointError as e:
                fault = str(e)
            fault = agree(fault, g)  # before the filter's collective: all skip, or none
            if fault is not None:
                raise StepSkipped(fault)
            ok = refill_filter(cfg, g, sb).view(-1, n)[:, 0]  # groups are n contiguous rows
        rounds.append((sb, ok))
        taken = min(share, taken + int(ok.sum()))
        short = dp_reduce({"short": share - taken}, g, op="max")["short"]
        if short == 0 or len(rounds) > cfg.rollout.max_refill_rounds:
            break
    picks = _pick_groups([ok for _, ok in rounds], share)
    requeue = []
    if cfg.rollout.refill_surplus == "requeue":
        requeue = [int(r_sb.group_ids[gi * n])
                   for (r_sb, ok), pick in zip(rounds, picks)
                   for gi in range(ok.numel()) if ok[gi] and gi not in pick]
    sb = take_groups(n, sep_ids, rounds, picks)
    metrics = {"rollout/refill_rounds": float(len(rounds) - 1),
               "rollout/groups_generated": float(len(rounds) * cfg.data.prompts_per_step),
               "rollout/groups_kept": dp_sum(float(sb.passed.sum()) / n, g),
               "rollout/refill_capped": float(short > 0),
               "rollout/requeued": dp_sum(float(len(requeue)), g)}
    return Refilled(sb, metrics, next_block, requeue)


def refill_filter(cfg: Config, groups: Groups, sb: ScoredBatch) -> torch.Tensor:
    """[B] bool: the sample's group passes `rollout.refill` (accuracy: mean outcome in
    [advantage.prime.acc_low, acc_high], filters.accuracy as PRIME's ray_trainer.filter;
    std: the outcomes of the group are not all equal, verl's filter_groups std > 0)."""
    grp = pipeline.optional_group(groups.host_dp)
    o = sb.outcome.to(torch.float64)
    if cfg.rollout.refill == "accuracy":
        pc = cfg.advantage.prime
        return filters.accuracy(o, sb.group_ids, low=pc.acc_low, high=pc.acc_high, group=grp)
    index = group_index(sb.group_ids, grp, o.shape[0])
    # two-pass moments: a group of equal outcomes has exactly zero spread
    return index.per_sample(group_moments(o[:, None], index).m2)[:, 0] > 0


def take_groups(n: int, sep_ids, rounds: list, picks: list) -> ScoredBatch:
    """The picked groups of every round (`rounds`: (ScoredBatch, passed per group)) as one
    ScoredBatch (rows regrouped in pick order; steps re-segmented on the joined padding; oracle
    checks kept row by row; the reward phases' metrics of the last round, as its phases left
    them)."""
    rows = [torch.cat([torch.arange(gi * n, gi * n + n) for gi in gs]) if gs else
            torch.zeros(0, dtype=torch.long) for gs in picks]
    parts = [(sb, r) for (sb, _), r in zip(rounds, rows)]
    batch = _join_rollouts([(sb.rollout, r) for sb, r in parts], n)
    passed = torch.cat([ok.repeat_interleave(n)[r] for (_, ok), r in zip(rounds, rows)])

    def cat(f):
        return torch.cat([getattr(sb, f)[r] for sb, r in parts])

    def pick(f):
        return [getattr(sb, f)[i] for sb, r in parts for i in r.tolist()]
    wrong = (cat("correct_with_wrong_step") if parts[0][0].correct_with_wrong_step
             is not None else None)
    checks = pick("checks") if parts[0][0].checks is not None else None
    seg = segment_steps(batch.response_ids, batch.response_mask, sep_ids)
    return ScoredBatch(batch, cat("outcome"), cat("group_ids"), seg,
                       correct_with_wrong_step=wrong, problems=pick("problems"),
                       references=pick("references"), passed=passed, checks=checks,
                       metrics=dict(rounds[-1][0].metrics))

def _pick_groups(passed: List[torch.Tensor], share: int) -> List[List[int]]:
    """Which local groups of each round make the step's `share` groups: passing groups first
    come first taken, then (when the cap left a shortfall) failing ones in the same order.
    passed: per round, [groups] bool. Returns per round the sorted local group indices."""
    order = [(r, gi) for r, ok in enumerate(passed) for gi in range(ok.numel()) if ok[gi]]
    order += [(r, gi) for r, ok in enumerate(passed) for gi in range(ok.numel()) if not ok[gi]]
    picks: List[List[int]] = [[] for _ in passed]
    for r, gi in order[:share]:
        picks[r].append(gi)
    return [sorted(p) for p in picks]


def _join_rollouts(parts: list, n: int) -> RolloutBatch:
    """Rows `r` of each RolloutBatch as one batch: prompts re-left-padded and responses
    re-right-padded to the widest part; group_index renumbered 0.. in row order (n per group)."""
    parts = [(b, r) for b, r in parts if r.numel()]
    pad = parts[0][0].pad_token_id
    P = max(b.prompt_ids.shape[1] for b, _ in parts)
    R = max(b.response_ids.shape[1] for b, _ in parts)

    def left(x, w, v):
        return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

    def right(x, w, v):
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)
    cat = torch.cat
    B = sum(r.numel() for _, r in parts)
    out = RolloutBatch(
        prompt_ids=cat([left(b.prompt_ids[r], P, pad) for b, r in parts]),
        prompt_mask=cat([left(b.prompt_mask[r], P, 0) for b, r in parts]),
        response_ids=cat([right(b.response_ids[r], R, pad) for b, r in parts]),
        response_mask=cat([right(b.response_mask[r], R, 0) for b, r in parts]),
        sampler_logprobs=cat([right(b.sampler_logprobs[r], R, 0.0) for b, r in parts]),
        finish_reason=[b.finish_reason[i] for b, r in parts for i in r.tolist()],
        group_index=torch.arange(B // n).repeat_interleave(n), pad_token_id=pad)
    if all(b.row_versions is not None for b, _ in parts):  # the weight version of each row
        out.row_versions = cat([b.row_versions[r] for b, r in parts])
    return out


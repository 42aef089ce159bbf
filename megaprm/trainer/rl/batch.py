"""The data one RL step passes between its phases, and the exception that skips a step.

rollout (RolloutBatch) -> rewards (ScoredBatch) -> log-probs (logprob_phase.LogProbs) ->
advantages (AdvantageOutputs, algorithms/registry.py) -> update (UpdateResult). Each phase
returns one of these; none reads another phase's output from the trainer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megaprm.rollout.engine import RolloutBatch


class StepSkipped(Exception):
    """A step every rank agreed to skip (non-finite reward, loss or grad norm on some rank)."""


@dataclass
class ScoredBatch:
    """A rollout with its rewards. outcome [B] float; group_ids [B] int64 (global prompt index);
    step_scores [B, S] = P(step correct) from the PRM (None without a discriminative PRM);
    seg: the step segmentation of the responses; q [B, R]: PRIME's implicit token rewards;
    step_correct [B, S] bool: exact per-step truth where the task has it (arithmetic)."""

    rollout: RolloutBatch
    outcome: torch.Tensor
    group_ids: torch.Tensor
    seg: object
    step_scores: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    logp_prm: Optional[torch.Tensor] = None
    logp_ref_prm: Optional[torch.Tensor] = None
    correct_with_wrong_step: Optional[torch.Tensor] = None
    step_mask: Optional[torch.Tensor] = None   # [B, S] bool: the PRM's steps (step_scores')
    prof_steps: Optional[torch.Tensor] = None  # [B] PROF's H_i as released (text steps)
    problems: Optional[list] = None    # B problem statements (a generative judge reads them)
    references: Optional[list] = None  # B reference solutions or None (ditto)
    passed: Optional[torch.Tensor] = None  # [B] bool: passed rollout.refill's filter (None: off)
    # B exact step checks (tasks.arithmetic.StepCheck) of the arithmetic task: the oracle
    # process reward's labels; None for tasks without a step checker
    checks: Optional[list] = None
    # the reward phases' own step metrics (the LLM fallback's shares, the judge's counts)
    metrics: dict = field(default_factory=dict)


@dataclass
class UpdateResult:
    """The actor update's metrics and, when it took its own detached log-probs as pi_old, those
    log-probs [B, L-1] in the order its rows came in (None: pi_old was given, or no mini-batch had
    a valid token anywhere)."""

    metrics: dict
    logprobs_t: Optional[torch.Tensor] = None

"""One entry point for every advantage estimator: `compute_advantages(cfg, inputs, group=dp)`.

The trainer builds an `AdvantageInputs` (typed batch, documented shapes) and an
`AdvantageConfig` (method name + that method's knobs, validated on construction) and never
special-cases an estimator: each registered method maps the same inputs to the same
`AdvantageOutputs(advantages[B, T], returns[B, T] | None, keep[B], metrics)`.

| name        | what                                              | research § |
|-------------|---------------------------------------------------|------------|
| `grpo`      | group z-score of the outcome                      | 3.5, 5.7   |
| `drgrpo`    | group mean-centring of the outcome (no std)       | 5.7        |
| `rloo`      | leave-one-out outcome baseline                    | 1.4        |
| `prime`     | implicit PRM token rewards + RLOO + whitening     | 1.2–1.6    |
| `pure`      | min-form step credit, token baseline, VR, whiten  | 2.3–2.5    |
| `prof_grpo` | PROF consistency filter, then GRPO on the kept    | 3.2–3.5    |
| `papo`      | decoupled outcome / process z-scores              | 4.2–4.3    |
| `blend`     | GRPO on `o + beta * mean step score`              | 3.4        |
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megaprm.algorithms import advantages as adv_lib
from megaprm.algorithms import filters
from megaprm.algorithms.losses import kl_penalty
from megaprm.algorithms.validation import check_mask, check_tensor, check_vector
from megaprm.parallel.reductions import check_group_ids

METHODS = ("grpo", "drgrpo", "rloo", "prime", "pure", "prof_grpo", "papo", "blend")


def _choice(path: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{path}={value!r} is not valid; choose one of {list(choices)}")


def _positive(path: str, value: float, *, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{path}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


# --------------------------------------------------------------------------- per-method configs

@dataclass
class GrpoConfig:
    """GRPO / Dr.GRPO / PROF-GRPO's GRPO stage: eps added to the unbiased std (verl: 1e-6)."""

    eps: float = 1e-6

    def __post_init__(self) -> None:
        _positive("advantage.grpo.eps", self.eps, allow_zero=True)


@dataclass
class ProfConfig:
    """PROF filter (§3.2–3.4): `remove` per group (released: n = 8, remove 4), variant `mode`,
    the released length penalty (10 when H < 2 or H > 30 steps) and the seed for `mode="correct"`."""

    remove: int = 4
    mode: str = "both"
    len_penalty: float = 10.0
    min_steps: int = 2
    max_steps: int = 30
    seed: int = 0
    # the critic's arithmetic: float64 (from the mean step score) | released (float32 per step,
    # prof_ray_trainer.py:1377-1432; decides ties the way the release does)
    precision: str = "float64"

    def __post_init__(self) -> None:
        _choice("advantage.prof.precision", self.precision, ("float64", "released"))
        if not isinstance(self.remove, int) or self.remove < 0:
            raise ValueError(f"advantage.prof.remove={self.remove!r} must be an int >= 0 "
                             f"(samples removed per group; keep m = n - remove)")
        _choice("advantage.prof.mode", self.mode, ("both", "correct", "no_separation"))
        _positive("advantage.prof.len_penalty", self.len_penalty, allow_zero=True)
        if not 0 <= self.min_steps <= self.max_steps:
            raise ValueError(f"advantage.prof.min_steps={self.min_steps}, max_steps={self.max_steps}: "
                             f"need 0 <= min_steps <= max_steps")


@dataclass
class PapoConfig:
    """PAPO (§4.2–4.3): `lam` (released 1.0; one script 0.6), eps, `mode` decoupled|fullnorm|multiplicative."""

    lam: float = 1.0
    eps: float = 1e-6
    mode: str = "decoupled"

    def __post_init__(self) -> None:
        _choice("advantage.papo.mode", self.mode, ("decoupled", "fullnorm", "multiplicative"))
        _positive("advantage.papo.eps", self.eps, allow_zero=True)


@dataclass
class BlendConfig:
    """Blend-PRM-GRPO (§3.4): sequence reward `o + beta * mean step score`, released beta 0.8."""

    beta: float = 0.8


@dataclass
class PrimeConfig:
    """PRIME (§1.2–1.6); defaults are the original repo's run script."""

    granularity: str = "token"
    norm: str = "batch_norm"
    norm_scope: str = "global"
    rloo_form: str = "code"
    gamma_outcome: float = 1.0
    gamma_process: float = 1.0
    outcome_coef: float = 1.0
    process_coef: float = 1.0
    accuracy_filter: bool = True
    acc_low: float = 0.2
    acc_high: float = 0.8

    def __post_init__(self) -> None:
        _choice("advantage.prime.granularity", self.granularity, ("token", "whole", "step"))
        _choice("advantage.prime.norm", self.norm, ("batch_norm", "none"))
        _choice("advantage.prime.norm_scope", self.norm_scope, ("global", "shard"))
        _choice("advantage.prime.rloo_form", self.rloo_form, ("code", "paper"))
        for name in ("gamma_outcome", "gamma_process"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"advantage.prime.{name}={v!r} must be in [0, 1]")
        if not 0.0 <= self.acc_low <= self.acc_high <= 1.0:
            raise ValueError(f"advantage.prime.acc_low={self.acc_low}, acc_high={self.acc_high}: "
                             f"need 0 <= acc_low <= acc_high <= 1")


@dataclass
class PureConfig:
    """PURE, OpenRLHF branch (§2.3–2.5). `kl_coef` is the in-reward k1 coefficient; the released
    run uses 0.001 but it needs logp_old and logp_ref, so the default leaves it off.
    `step_scores_are_probs` maps PRM probabilities p to PURE's PR = 2p - 1."""

    credit: str = "min"
    temperature: float = 0.1
    baseline: str = "token"
    reward_mode: str = "PRMVR"
    vr_coef: float = 1.0
    kl_coef: float = 0.0
    mask_separator: bool = True
    whiten: bool = True
    whiten_var_includes_zeros: bool = True
    whiten_zeros: str = "released"   # "exclude": zero-advantage tokens never whitened (megaprm's earlier rule)
    step_scores_are_probs: bool = False

    def __post_init__(self) -> None:
        _choice("advantage.pure.credit", self.credit, ("min", "uniform", "sum"))
        _choice("advantage.pure.baseline", self.baseline, ("token", "step", "none"))
        _choice("advantage.pure.reward_mode", self.reward_mode, ("PRM", "VR", "PRMVR"))
        _positive("advantage.pure.temperature", self.temperature)
        _positive("advantage.pure.kl_coef", self.kl_coef, allow_zero=True)
        _choice("advantage.pure.whiten_zeros", self.whiten_zeros, adv_lib.WHITEN_ZEROS)


@dataclass
class AdvantageConfig:
    """Which estimator (`method`, one of `METHODS`) and the knobs of each family."""

    method: str = "grpo"
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    prof: ProfConfig = field(default_factory=ProfConfig)
    papo: PapoConfig = field(default_factory=PapoConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    pure: PureConfig = field(default_factory=PureConfig)

    def __post_init__(self) -> None:
        _choice("advantage.method", self.method, METHODS)


# --------------------------------------------------------------------------- typed batch

@dataclass
class AdvantageInputs:
    """This rank's samples. B samples, T response tokens (right-padded), S steps (right-padded).

    outcome[B] float           verifier reward, {0,1} for the process-reward methods
    group_ids[B] int64         prompt id; members of a group may sit on other DP ranks
    response_mask[B, T]        1 on response tokens (EOS included)
    process_step_scores[B, S]  PRM score per step (PROF/PAPO/Blend: probability of a correct
                               step; PURE: 2p-1 unless pure.step_scores_are_probs)
    step_mask[B, S]            1 on valid steps (a prefix of each row)
    step_end_index[B, S] long  token position closing step k (PURE); or give
    token_to_step[B, T] long   step number of each response token (-1 elsewhere)
    num_steps[B]               steps per response (default: step_mask.sum(1))
    logp_prm/logp_ref/logp_old[B, T]  log-probs of the sampled tokens (PRIME; PURE's KL)
    """

    outcome: torch.Tensor
    group_ids: torch.Tensor
    response_mask: torch.Tensor
    process_step_scores: torch.Tensor | None = None
    step_mask: torch.Tensor | None = None
    step_end_index: torch.Tensor | None = None
    token_to_step: torch.Tensor | None = None
    num_steps: torch.Tensor | None = None
    logp_prm: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_vector(self.outcome, "inputs.outcome")
        b = self.outcome.shape[0]
        check_group_ids(self.group_ids, b, "inputs.group_ids")
        check_mask(self.response_mask, "inputs.response_mask", (b, None), "[B, T]")
        if self.process_step_scores is not None:
            check_tensor(self.process_step_scores, "inputs.process_step_scores", (b, None), dims="[B, S]")

    def require(self, name: str, method: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"advantage.method={method!r} needs inputs.{name} (see AdvantageInputs "
                             f"for its shape); the rollout/scoring phase must fill it")
        return value

    def steps(self, method: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(step_scores[B, S], step_mask[B, S] bool)`; a missing step_mask means all steps valid."""
        scores = self.require("process_step_scores", method)
        mask = self.step_mask
        if mask is None:
            return scores, torch.ones_like(scores, dtype=torch.bool)
        check_mask(mask, "inputs.step_mask", tuple(scores.shape), "[B, S]")
        return scores, mask.bool()

    def sequence_process_score(self, method: str) -> torch.Tensor:
        """Mean valid step score per response `[B]` (PROF's `ave_prm`, §3.2/3.4); 0 without steps."""
        scores, mask = self.steps(method)
        m = mask.to(scores.dtype)
        return (torch.where(mask, scores, torch.zeros_like(scores)) * m).sum(1) / m.sum(1).clamp(min=1)

    def step_counts(self, method: str) -> torch.Tensor:
        if self.num_steps is not None:
            return self.num_steps
        return self.steps(method)[1].sum(1)

    def step_ends(self, method: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(step_end_index[B, S], step_mask[B, S])` from either step layout."""
        scores, mask = self.steps(method)
        if self.step_end_index is not None:
            return self.step_end_index, mask
        if self.token_to_step is None:
            raise ValueError(f"advantage.method={method!r} needs inputs.step_end_index[B, S] or "
                             f"inputs.token_to_step[B, T] to place step rewards on tokens")
        ends, present = adv_lib.step_end_index_from_token_to_step(
            self.token_to_step, self.response_mask, scores.shape[1])
        return ends, mask & present


@dataclass
class AdvantageOutputs:
    """advantages[B, T] (0 on padding and on dropped samples), returns[B, T] for token-level
    methods (un-whitened), keep[B] (False = drop the sample from the update), rank-local metrics."""

    advantages: torch.Tensor
    returns: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]


# --------------------------------------------------------------------------- estimators

Estimator = Callable[[AdvantageConfig, AdvantageInputs, Any | None, torch.Generator | None],
                     AdvantageOutputs]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    def deco(fn: Estimator) -> Estimator:
        assert name in METHODS and name not in ESTIMATORS, name
        ESTIMATORS[name] = fn
        return fn
    return deco


def _sequence_output(adv: torch.Tensor, x: AdvantageInputs, keep: torch.Tensor | None = None,
                     ) -> AdvantageOutputs:
    keep = torch.ones_like(adv, dtype=torch.bool) if keep is None else keep
    mask = x.response_mask.to(adv.dtype)
    token_adv = torch.where(keep, adv, torch.zeros_like(adv))[:, None] * mask
    return AdvantageOutputs(token_adv, None, keep, {})


@register("grpo")
def _grpo(cfg, x, group, generator):
    return _sequence_output(adv_lib.grpo(x.outcome, x.group_ids, eps=cfg.grpo.eps, group=group), x)


@register("drgrpo")
def _drgrpo(cfg, x, group, generator):
    return _sequence_output(adv_lib.grpo(x.outcome, x.group_ids, eps=cfg.grpo.eps,
                                         scale_by_std=False, group=group), x)


@register("rloo")
def _rloo(cfg, x, group, generator):
    return _sequence_output(adv_lib.rloo(x.outcome, x.group_ids, group=group), x)


@register("papo")
def _papo(cfg, x, group, generator):
    p = x.sequence_process_score("papo")
    return _sequence_output(adv_lib.papo(x.outcome, p, x.group_ids, lam=cfg.papo.lam,
                                         eps=cfg.papo.eps, mode=cfg.papo.mode, group=group), x)


@register("blend")
def _blend(cfg, x, group, generator):
    # GRPO on o + beta * mean step score (adv_lib.blend's reward) with advantage.grpo.eps, the
    # eps of the released GRPO advantage that blend_grpo calls (verl default 1e-6).
    p = x.sequence_process_score("blend")
    reward = x.outcome.to(torch.float64) + cfg.blend.beta * p.to(torch.float64)
    adv = adv_lib.grpo(reward, x.group_ids, eps=cfg.grpo.eps, group=group)
    return _sequence_output(adv.to(x.outcome.dtype), x)


@register("prof_grpo")
def _prof_grpo(cfg, x, group, generator):
    """Filter with PROF, then GRPO over the kept members of each group only (§3.5)."""
    pc = cfg.prof
    if pc.mode == "correct" and generator is None:
        generator = torch.Generator().manual_seed(pc.seed)
    keep = filters.prof(x.outcome, x.sequence_process_score("prof_grpo"), x.group_ids,
                        remove=pc.remove, mode=pc.mode, num_steps=x.step_counts("prof_grpo"),
                        generator=generator, len_penalty=pc.len_penalty, min_steps=pc.min_steps,
                        max_steps=pc.max_steps, group=group,
                        released_steps=x.steps("prof_grpo") if pc.precision == "released"
                        else None)
    adv = adv_lib.grpo(x.outcome, x.group_ids, eps=cfg.grpo.eps, keep=keep, group=group)
    out = _sequence_output(adv, x, keep)
    out.metrics["prof/keep_frac"] = float(keep.float().mean()) if keep.numel() else 0.0
    return out


@register("prime")
def _prime(cfg, x, group, generator):
    pc = cfg.prime
    logp_prm, logp_ref = x.require("logp_prm", "prime"), x.require("logp_ref", "prime")
    keep = torch.ones_like(x.outcome, dtype=torch.bool)
    if pc.accuracy_filter:
        keep = filters.accuracy(x.outcome, x.group_ids, low=pc.acc_low, high=pc.acc_high, group=group)
    # Filtered prompts are absent from the released batch: a zero mask removes them from the
    # batch_norm max and the whitening statistics (whole groups go, so RLOO counts are intact).
    mask = x.response_mask.to(logp_prm.dtype) * keep[:, None].to(logp_prm.dtype)
    step_end_mask = None
    if pc.granularity == "step":
        ends, smask = x.step_ends("prime")
        step_end_mask = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
        rows, steps = torch.nonzero(smask, as_tuple=True)
        step_end_mask[rows, ends[rows, steps]] = True
    adv, ret = adv_lib.prime(x.outcome, logp_prm, logp_ref, mask, x.group_ids,
                             granularity=pc.granularity, step_end_mask=step_end_mask, norm=pc.norm,
                             norm_scope=pc.norm_scope, rloo_form=pc.rloo_form,
                             gamma_outcome=pc.gamma_outcome, gamma_process=pc.gamma_process,
                             outcome_coef=pc.outcome_coef, process_coef=pc.process_coef, group=group)
    return AdvantageOutputs(adv, ret, keep, {"prime/keep_frac": float(keep.float().mean())})


@register("pure")
def _pure(cfg, x, group, generator):
    pc = cfg.pure
    scores, _ = x.steps("pure")
    if pc.step_scores_are_probs:
        scores = 2.0 * scores - 1.0
    ends, smask = x.step_ends("pure")
    kl = None
    if pc.kl_coef:
        kl = kl_penalty(x.require("logp_old", "pure"), x.require("logp_ref", "pure"), "k1")
    adv, ret = adv_lib.pure(x.outcome, scores, smask, ends, x.response_mask, x.group_ids,
                            credit=pc.credit, temperature=pc.temperature, baseline=pc.baseline,
                            reward_mode=pc.reward_mode, vr_coef=pc.vr_coef, kl=kl, kl_coef=pc.kl_coef,
                            mask_separator=pc.mask_separator, whiten=pc.whiten,
                            whiten_var_includes_zeros=pc.whiten_var_includes_zeros,
                            whiten_zeros=pc.whiten_zeros, group=group)
    return AdvantageOutputs(adv, ret, torch.ones_like(x.outcome, dtype=torch.bool), {})


def compute_advantages(cfg: AdvantageConfig, inputs: AdvantageInputs, *, group: Any | None = None,
                       generator: torch.Generator | None = None) -> AdvantageOutputs:
    """Run the configured estimator on this rank's batch; `group` is the DP process group.

    Adds rank-local metrics `adv/mean`, `adv/abs_max` over valid tokens of kept samples.
    """
    out = ESTIMATORS[cfg.method](cfg, inputs, group, generator)
    valid = inputs.response_mask.bool() & out.keep[:, None]
    vals = out.advantages[valid]
    out.metrics["adv/mean"] = float(vals.mean()) if vals.numel() else 0.0
    out.metrics["adv/abs_max"] = float(vals.abs().max()) if vals.numel() else 0.0
    return out

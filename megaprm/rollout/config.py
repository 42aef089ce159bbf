"""`RolloutConfig`: the `rollout:` section of a recipe (sampling, the engine, where it runs,
dynamic sampling, the off-policy correction). It sits here, beside the engines it configures,
so that rollout/ needs nothing of the root config (megaprm/config.py composes it).
"""
from __future__ import annotations

from dataclasses import dataclass

from megaprm.errors import check_value

REFILL_FILTERS = ("none", "accuracy", "std")


@dataclass
class RolloutConfig:
    """Sampling, the engine, and dynamic sampling. `refill` (DAPO's dynamic sampling, verl's
    `algorithm.filter_groups`; PRIME's released loop): keep generating fresh prompt groups until
    `data.prompts_per_step` groups pass a filter, at most `max_refill_rounds` extra rounds; the
    filtered-out groups leave the batch. `accuracy`: mean outcome in [advantage.prime.acc_low,
    acc_high] (PRIME's filter); `std`: outcomes not all equal (verl's filter_groups, std > 0);
    `none`: one round, the batch as generated."""

    # auto: vLLM where it is installed and CUDA is present, else the transformers engine (hf);
    # resolved where the engine is built (rollout/factory.py), so a plan made on a CPU laptop
    # still plans the GPU run's engine
    engine: str = "auto"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    gpu_memory_utilization: float = 0.5  # vLLM: share of the GPU for weights + KV cache
    sleep_level: int = 1                 # vLLM sleep: 1 offloads weights to host, 2 drops them
    refill: str = "none"                 # none | accuracy | std (class docstring)
    max_refill_rounds: int = 4           # extra generation rounds per step at most (then train
                                         # on what passed; rollout/refill_capped says so)
    # passing groups beyond the step's share: drop (verl's DAPO recipe) | requeue (PRIME's
    # release: their prompts are generated again first in the next step's first round)
    refill_surplus: str = "drop"
    # where the engine runs (docs/rollout.md "Placement"): colocated (on every trainer rank,
    # sharing its device) | separate (the last `ranks` ranks of the launch run the engine alone)
    placement: str = "colocated"
    ranks: int = 0                       # separate: how many rollout ranks (the last of the world)
    # separate: GPUs of one rollout engine (vLLM tensor parallelism; rollout.ranks / tp engines
    # of consecutive rollout ranks, rollout/remote.py); the transformers engine takes tp 1 only
    # (trainer/preflight)
    tp: int = 1
    # separate: batches the rollout ranks may draw ahead of the trainer; a batch is consumed at
    # most this many weight versions after the one it was drawn with (0: on-policy)
    max_staleness: int = 0
    # off-policy correction of the update against the engine's log-probs (docs/rollout.md):
    # none | tis (token-level truncated importance sampling, verl's rollout correction) |
    # decoupled (AReaL's decoupled PPO: tokens whose weight exceeds the cap are dropped)
    correction: str = "tis"
    tis_cap: float = 2.0                 # C: weights above it are truncated (tis) or dropped

    def __post_init__(self):
        check_value(self.placement in ("colocated", "separate"), "rollout.placement", self.placement,
               "colocated or separate")
        check_value(isinstance(self.ranks, int) and self.ranks >= 0, "rollout.ranks", self.ranks,
               "an integer >= 0 (rollout ranks of a separate placement)")
        check_value(self.placement == "colocated" or self.ranks >= 1, "rollout.ranks", self.ranks,
               ">= 1 with rollout.placement=separate (the last ranks of the launch)")
        check_value(isinstance(self.tp, int) and self.tp >= 1, "rollout.tp", self.tp,
               "a positive integer (GPUs of one rollout engine)")
        check_value(self.tp == 1 or self.placement == "separate", "rollout.tp", self.tp,
               "1 with rollout.placement=colocated (the engine takes the trainer's parallel.tp "
               "there); set rollout.placement=separate")
        check_value(self.placement == "colocated" or self.ranks % self.tp == 0, "rollout.tp",
               self.tp, f"a divisor of rollout.ranks={self.ranks} (each engine takes tp of them)")
        check_value(isinstance(self.max_staleness, int) and self.max_staleness >= 0,
               "rollout.max_staleness", self.max_staleness, "an integer >= 0")
        check_value(self.max_staleness == 0 or self.placement == "separate", "rollout.max_staleness",
               self.max_staleness, "0 with rollout.placement=colocated (the engine shares the "
               "trainer's ranks: nothing runs ahead); set rollout.placement=separate")
        check_value(self.placement == "colocated" or self.refill_surplus == "drop",
               "rollout.refill_surplus", self.refill_surplus,
               "drop with rollout.placement=separate (requeued prompts are not streamed)")
        check_value(self.correction in ("none", "tis", "decoupled"), "rollout.correction",
               self.correction, "none, tis (token-level truncated importance sampling) or "
               "decoupled (AReaL's decoupled PPO)")
        check_value(self.tis_cap >= 1.0, "rollout.tis_cap", self.tis_cap, ">= 1")
        check_value(self.engine in ("auto", "hf", "vllm"), "rollout.engine", self.engine,
               "auto (vLLM where it and CUDA are present, else hf), hf (transformers) or vllm")
        check_value(self.refill in REFILL_FILTERS, "rollout.refill", self.refill,
               "none, accuracy (mean outcome in advantage.prime.acc_low..acc_high) or std "
               "(groups whose outcomes are not all equal)")
        check_value(self.refill_surplus in ("drop", "requeue"), "rollout.refill_surplus",
               self.refill_surplus, "drop or requeue (PRIME's release)")
        check_value(isinstance(self.max_refill_rounds, int) and self.max_refill_rounds >= 0,
               "rollout.max_refill_rounds", self.max_refill_rounds,
               "an integer >= 0 (extra generation rounds per step)")
        check_value(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
               self.gpu_memory_utilization, "in (0, 1]")
        check_value(self.sleep_level in (1, 2), "rollout.sleep_level", self.sleep_level, "1 or 2")
        check_value(isinstance(self.n, int) and self.n >= 2, "rollout.n", self.n,
               "an integer >= 2 (group baselines need at least two samples per prompt)")
        check_value(self.temperature > 0, "rollout.temperature", self.temperature, "> 0 for RL")
        check_value(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        check_value(self.max_tokens >= 1, "rollout.max_tokens", self.max_tokens, ">= 1")

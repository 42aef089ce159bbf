"""Sample filters: PROF process-consistency filter (§3) and PRIME's prompt accuracy filter (§1.6).

Each returns a keep-mask `[B]` (bool) over this rank's samples. Group members may live on
different DP ranks: the accuracy filter reduces per-group sums (3 collectives), PROF all-gathers
one row of per-sample scalars (5 collectives), and every rank then takes the same decisions.
Section numbers (§) refer to docs/algorithms.md.
"""
from __future__ import annotations

from typing import Any

import torch

from megaprm.algorithms.validation import check_choice, check_tensor, check_vector
from megaprm.parallel.reductions import (
    all_reduce,
    gather_samples,
    group_index,
    group_sums,
)


def accuracy(outcome: torch.Tensor, group_ids: torch.Tensor, *, low: float = 0.2,
             high: float = 0.8, group: Any | None = None) -> torch.Tensor:
    """PRIME prompt filter: keep every sample of a group whose mean outcome is in [low, high].

    `outcome[B]` in {0,1}, `group_ids[B]` -> `keep[B]` bool. Bounds are inclusive as in the
    released code (the paper writes them strictly; §1.6), so all-correct and all-wrong groups go.
    """
    check_vector(outcome, "outcome")
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"accuracy filter bounds low={low}, high={high}: need 0 <= low <= high <= 1")
    index = group_index(group_ids, group, outcome.shape[0])
    o = outcome.to(torch.float64)
    s = index.per_sample(group_sums(torch.stack([torch.ones_like(o), o], dim=1), index))
    acc = s[:, 1] / s[:, 0]
    return (acc >= low) & (acc <= high)


def consistency_scores(outcome: torch.Tensor, process: torch.Tensor,
                       num_steps: torch.Tensor | None, *, len_penalty: float, min_steps: int,
                       max_steps: int, group: Any | None) -> torch.Tensor:
    """PROF critic `c_i - len_penalty * 1[H_i < min_steps or H_i > max_steps]` -> float64 `[B]` (§3.2).

    `c_i = 2 (p_i - mu_B)(2 o_i - 1)` where `p_i` is the mean step score of response i and mu_B
    the mean of all valid step scores of the GLOBAL batch, i.e. `sum_i H_i p_i / sum_i H_i`
    (one all-reduce); `c_i = 0` when `H_i = 0`. Without `num_steps` every response weighs 1 in
    mu_B and no length penalty applies.
    """
    o, p = outcome.to(torch.float64), process.to(torch.float64)
    h = torch.ones_like(p) if num_steps is None else num_steps.to(torch.float64)
    s = all_reduce(torch.stack([(h * p).sum(), h.sum()]), "sum", group)
    mu = s[0] / s[1].clamp(min=1)
    c = 2.0 * (p - mu) * (2.0 * o - 1.0)
    if num_steps is None:
        return c
    c = torch.where(h > 0, c, torch.zeros_like(c))
    out_of_range = (h < min_steps) | (h > max_steps)
    return c - len_penalty * out_of_range.to(torch.float64)


def consistency_scores_released(outcome: torch.Tensor, step_scores: torch.Tensor,
                                step_mask: torch.Tensor, num_steps: torch.Tensor | None, *,
                                len_penalty: float, min_steps: int, max_steps: int,
                                group: Any | None) -> torch.Tensor:
    """The same critic computed the released way (`advantage.prof.precision: released`;
    prof_ray_trainer.py:1377-1432 and :1450): in float32, per step - mu_B the float32 mean of
    every valid step score of the batch, c_i = sum_h 2 (s_h - mu_B)(2 o_i - 1) / max(H_i, 1),
    0 without steps - then the float32 length penalty. Rounding differs from the float64
    `consistency_scores` in the last bits, which decides ties in the filter's sort.
    step_scores/step_mask [B, S]; returns float64 [B] holding the float32 values."""
    f = torch.float32
    m = step_mask.bool()
    s = torch.where(m, step_scores.to(f), torch.zeros((), dtype=f))
    tot = all_reduce(torch.stack([s.sum().to(torch.float64), m.sum().to(torch.float64)]), "sum",
                     group)
    mu = (tot[0] / tot[1].clamp(min=1)).to(f)
    sign = (2 * outcome.to(f) - 1)[:, None]
    h_mask = m.sum(1)
    c = (((s - mu) * 2) * sign * m).sum(1) / h_mask.clamp(min=1).to(f)
    c = torch.where(h_mask > 0, c, torch.zeros_like(c))
    if num_steps is not None:
        out_of_range = (num_steps < min_steps) | (num_steps > max_steps)
        c = c - torch.tensor(len_penalty, dtype=f) * out_of_range.to(f)
    return c.to(torch.float64)


def _rank_in_segment(segment: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Rank of each row within its segment when sorted by `key` ascending, ties by row order.

    Rows are already in global order (group, rank, local index), so stable sorts keep it.
    """
    by_key = torch.sort(key, stable=True).indices
    order = by_key[torch.sort(segment[by_key], stable=True).indices]
    seg_sorted = segment[order]
    first = torch.searchsorted(seg_sorted, seg_sorted, right=False)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=order.device) - first
    return rank


def prof(outcome: torch.Tensor, process: torch.Tensor, group_ids: torch.Tensor, *, remove: int,
         mode: str = "both", num_steps: torch.Tensor | None = None,
         generator: torch.Generator | None = None, len_penalty: float = 10.0,
         min_steps: int = 2, max_steps: int = 30, group: Any | None = None,
         released_steps: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """PROF consistency filter: remove `remove` samples per group, keep the rest -> `keep[B]` (§3.2–3.4).

    `released_steps` = (step_scores [B, S], step_mask [B, S]): compute the critic in float32 per
    step as released (`consistency_scores_released`); None: in float64 from `process`.

    `outcome[B]` (correct = `outcome == 1`), `process[B]` the mean PRM step score of each
    response, `num_steps[B]` its step count H_i (enables the released length penalty). Per group
    with n+ correct, n- incorrect, delta = n+ - n-, k = `remove`:
    `k+ = min(k, round((delta + k) / 2))` with round-half-to-even (Python `round`, as released);
    if k+ > 0 remove `min(k+, n+)` correct with the lowest critic, then `min(k - that, n-)`
    incorrect with the lowest critic (= highest PRM); else remove `min(k, n-)` incorrect.
    For n = 8, k = 4 this keeps (correct/incorrect) 0/4, 1/3, 2/2 (n+ = 2..6), 3/1, 4/0.

    `mode`: `"both"` (PROF-GRPO) as above; `"correct"` ranks the correct ones the same way but
    removes the incorrect ones uniformly at random (same counts; needs `generator`, seeded
    identically on every DP rank); `"no_separation"` ranks all n by critic together and removes
    the k lowest (the paper's "w/o Separation" ablation, not in the released code).

    Ties keep the original order: among equal critics the earlier sample is removed first. The
    order is (group, DP rank, local index); this equals the original batch order whenever rank r
    holds the r-th contiguous slice of the batch, and is the single-process order with group=None.
    """
    check_choice(mode, "mode", ("both", "correct", "no_separation"))
    if not isinstance(remove, int) or remove < 0:
        raise ValueError(f"remove={remove!r}: must be a non-negative int (samples to drop per group)")
    check_vector(outcome, "outcome")
    b = outcome.shape[0]
    check_vector(process, "process", b)
    if num_steps is not None:
        check_tensor(num_steps, "num_steps", (b,), dims="[B]")
        if bool((num_steps < 0).any()):
            raise ValueError("num_steps has negative entries; pass the number of steps per response")
    if mode == "correct" and generator is None:
        raise ValueError("mode='correct' removes incorrect responses at random: pass "
                         "generator=torch.Generator().manual_seed(seed), the same seed on every DP rank")
    index = group_index(group_ids, group, b)
    if released_steps is None:
        critic = consistency_scores(outcome, process, num_steps, len_penalty=len_penalty,
                                    min_steps=min_steps, max_steps=max_steps, group=group)
    else:
        critic = consistency_scores_released(outcome, *released_steps, num_steps,
                                             len_penalty=len_penalty, min_steps=min_steps,
                                             max_steps=max_steps, group=group)
    correct = (outcome == 1).to(torch.float64)
    rows = gather_samples(torch.stack([correct, critic], dim=1), index)
    dense, is_c, c = rows.dense, rows.values[:, 0] > 0.5, rows.values[:, 1]

    g = index.num_groups
    n_pos = torch.bincount(dense, weights=is_c.to(torch.float64), minlength=g)
    n_all = torch.bincount(dense, minlength=g).to(torch.float64)
    if mode == "no_separation":
        rank = _rank_in_segment(dense, c)
        removed = rank < remove
    else:
        n_neg = n_all - n_pos
        k_plus = torch.clamp(torch.round((n_pos - n_neg + remove) / 2), max=remove)
        rm_pos = torch.where(k_plus > 0, torch.minimum(k_plus, n_pos), torch.zeros_like(k_plus))
        rm_neg = torch.minimum(remove - rm_pos, n_neg)
        key = c
        if mode == "correct":
            noise = torch.rand(c.shape[0], generator=generator, dtype=torch.float64).to(c.device)
            key = torch.where(is_c, c, noise)
        rank = _rank_in_segment(dense * 2 + is_c.long(), key)
        removed = torch.where(is_c, rank < rm_pos[dense], rank < rm_neg[dense])
    return ~removed[rows.mine]

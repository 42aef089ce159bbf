"""Step segmentation of responses from token ids (PURE, arXiv 2504.15275; research notes §2.2).

Rules, for the valid tokens (response_mask True) of one response, in order:

* a *separator* is any token whose decoded text ends with "\\n\\n" (merged ones like ".\\n\\n"
  included); each separator closes one step;
* the last valid token (EOS, or the truncation point) closes the final step;
* so a token is a step end iff it is a separator or the last valid token, and
  number of steps = separators + 1, except when the last valid token is itself a separator:
  then it closes the final step and there are just `separators` steps (no empty step after
  it). This is the reading of §2.2 in which every step has its own closing token;
* L_k = tokens of step k excluding its closing token, so sum_k L_k = |y| - num_steps; two
  separators in a row give an empty step (L_k = 0), which is still a step;
* an empty response (0 valid tokens) has 0 steps.

Shapes: B responses, T response positions, S = max steps in the batch (at least 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_SEP = "\n\n"


def separator_token_ids(tokenizer, sep: str = STEP_SEP) -> set[int]:
    """Every vocab id whose decoded string ends with `sep` (".\\n\\n", "\\n\\n\\n", ... included)."""
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], clean_up_tokenization_spaces=False)
    return {i for i, text in enumerate(texts) if text.endswith(sep)}


@dataclass(frozen=True)
class StepSegmentation:
    step_end_index: torch.Tensor  # [B, S] long: position of step k's closing token (0 where ~step_mask)
    step_mask: torch.Tensor  # [B, S] bool: step k exists
    num_steps: torch.Tensor  # [B] long
    token_to_step: torch.Tensor  # [B, T] long: step of each valid token, -1 on padding
    step_lengths: torch.Tensor  # [B, S] long: L_k, closing token excluded (0 where ~step_mask)
    is_step_end: torch.Tensor  # [B, T] bool


def segment_steps(
    response_ids: torch.Tensor, response_mask: torch.Tensor, sep_ids: set[int] | torch.Tensor
) -> StepSegmentation:
    """Segment responses [B, T] into steps (rules in the module docstring). The mask need not be
    a prefix (holes are skipped), but rollouts give right-padded responses, where it is."""
    assert response_ids.shape == response_mask.shape and response_ids.dim() == 2
    B, T = response_ids.shape
    device = response_ids.device
    valid = response_mask.bool()
    sep = torch.as_tensor(sorted(sep_ids) if isinstance(sep_ids, set) else sep_ids, dtype=response_ids.dtype, device=device)
    pos = torch.arange(T, device=device).expand(B, T)
    last_valid = torch.where(valid, pos, -1).amax(dim=1, keepdim=True) if T > 0 else torch.full((B, 1), -1, device=device)
    is_end = valid & (torch.isin(response_ids, sep) | (pos == last_valid))  # [B, T]

    ends_incl = is_end.long().cumsum(dim=1)  # [B, T] step ends at or before t
    num_steps = ends_incl[:, -1] if T > 0 else torch.zeros(B, dtype=torch.long, device=device)
    token_to_step = torch.where(valid, ends_incl - is_end.long(), -1)  # ends strictly before t
    S = max(int(num_steps.max()) if B > 0 else 0, 1)

    # scatter into an extra column S that collects everything not wanted, then drop it
    slot = torch.where(is_end, ends_incl - 1, S)  # [B, T]
    step_end_index = torch.zeros(B, S + 1, dtype=torch.long, device=device)
    step_end_index.scatter_(1, slot, torch.where(is_end, pos, 0))
    tokens_per_step = torch.zeros(B, S + 1, dtype=torch.long, device=device)
    tokens_per_step.scatter_add_(1, torch.where(valid, token_to_step, S), valid.long())

    step_mask = torch.arange(S, device=device).expand(B, S) < num_steps[:, None]
    step_lengths = torch.where(step_mask, tokens_per_step[:, :S] - 1, 0)
    return StepSegmentation(
        step_end_index=torch.where(step_mask, step_end_index[:, :S], 0),
        step_mask=step_mask,
        num_steps=num_steps,
        token_to_step=token_to_step,
        step_lengths=step_lengths,
        is_step_end=is_end,
    )


@dataclass(frozen=True)
class PRMInputs:
    input_ids: torch.Tensor  # [B, P + T] prompt, then the response with each closing token -> "\n"
    attention_mask: torch.Tensor  # [B, P + T] bool
    score_index: torch.Tensor  # [B, S] position in input_ids of step k's "\n" (P + step_end_index)
    step_mask: torch.Tensor  # [B, S] bool


def build_prm_inputs(
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    seg: StepSegmentation,
    newline_id: int,
    prompt_mask: torch.Tensor | None = None,
) -> PRMInputs:
    """PURE's PRM input (§2.2): the (left-padded) prompt [B, P], then each step's tokens without
    its closing token plus one "\\n" in the closing token's place, so step k is scored at the
    same index as its closing token in the response. As in PURE, a merged separator (".\\n\\n")
    loses its "." here, and so does the last token of a truncated response (it closes the final
    step). Padding positions keep their ids and are masked out."""
    assert prompt_ids.shape[0] == response_ids.shape[0]
    response = torch.where(seg.is_step_end, torch.full_like(response_ids, newline_id), response_ids)
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    P = prompt_ids.shape[1]
    return PRMInputs(
        input_ids=torch.cat([prompt_ids, response], dim=1),
        attention_mask=torch.cat([prompt_mask.bool(), seg.token_to_step >= 0], dim=1),
        score_index=torch.where(seg.step_mask, seg.step_end_index + P, 0),
        step_mask=seg.step_mask,
    )


# ------------------------------------------------------------------------ PROF's text steps

PROF_MAX_STEPS = 100  # released reward_model.model.max_steps: scores past step 100 are dropped


def prof_steps(text: str, sep: str = STEP_SEP) -> list[str]:
    """PROF-GRPO's steps of one decoded response (prof_dp_rm.py:272, research notes §3.1):
    strip the text, split on "\\n\\n", strip every piece and drop the empty ones; a response with
    no non-empty piece is one step (its stripped text, possibly ""), as released."""
    steps = [s.strip() for s in text.strip().split(sep) if s.strip()]
    return steps or [text.strip()]


def prof_num_steps(texts, max_steps: int = PROF_MAX_STEPS) -> torch.Tensor:
    """H_i of PROF's length penalty and mean PRM score: the number of text steps of each decoded
    response (`prof_steps`; decode with skip_special_tokens=True as released), capped at
    `max_steps` (the released score tensor has 100 columns, prof_dp_rm.py:230) -> [B] long.

    Differs from `segment_steps(...).num_steps` (token separators, empty steps kept, a step
    closed at EOS): "a\\n\\nb\\n\\n<eos>" has 2 PROF steps, a leading "\\n\\n" adds none."""
    return torch.tensor([min(len(prof_steps(t)), max_steps) for t in texts], dtype=torch.long)

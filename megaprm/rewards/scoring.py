"""Run a PRM over rollout responses -> per-step scores (discriminative PRM and implicit PRM).

PRM input format (one builder, `build_prm_batch`, serves scoring and PRM training, so a PRM
trained here is scored on exactly the token layout it was trained on):

    input = the prompt's valid tokens, then the response's valid tokens, right-padded;
    step k is scored at the position of its closing token (`rewards.steps`: a "\\n\\n"
    separator, or the last valid token: EOS or the truncation point).

`PRMInputFormat.step_marker_id` chooses what sits at a closing position:

* None ("raw"): the token the policy produced. megaprm's own PRMs are trained this way; the
  closing token of a truncated final step is its last real token, so nothing is lost.
* a token id ("marker"): PURE's reconstruction (research notes §2.2): every closing token is
  replaced by the marker ("\\n" for PURE's TRL-trained PRM, "<extra_0>" for Qwen2.5-Math-PRM;
  their chat template, if any, must already be in the prompt ids). A merged separator (".\\n\\n")
  loses its "." and a truncated final step its last token, as in PURE.

Sequences are compacted (no left padding) so a plain causal mask is exact and positions start
at 0 in both training and scoring. A saved PRM records its format in config.json
(`PRMInputFormat.to_hf` / `from_hf`).

Formats by name (`prm.input_format`, resolved by `resolve_prm_input_format`):

* `megaprm`: what a PRM written by `megaprm train-prm` recorded in its config.json;
* `raw`: the token layout above with the policy's own closing tokens;
* `pure`: PURE's PRM (CJReinforce/PURE experience_maker.py:831-852): the policy prompt tokens
  (no chat template), every step's closing token replaced by the one token "\n";
* `qwen25_math_prm`: Qwen2.5-Math-PRM-7B as PROF-GRPO calls it (prof_dp_rm.py:259-299), a
  text-level format (`ChatStepFormat`): the decoded response is split into PROF's steps
  (`steps.prof_steps`), joined and closed by "<extra_0>", and wrapped in the PRM's chat template
  with PROF's system message; step h is scored at the h-th "<extra_0>" (at most 100);
* `auto`: `megaprm` when config.json has the record, `qwen25_math_prm` for a
  Qwen2ForProcessRewardModel whose tokenizer has "<extra_0>" and a chat template; anything
  else is a ConfigError naming the choices (never a silent raw default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megaprm.models.logprobs import next_token_logprobs
from megaprm.models.prm import (
    StepScores,
    gather_positions,
    head_step_scores,
    implicit_step_scores,
    implicit_token_rewards,
)
from megaprm.parallel import pipeline
from megaprm.parallel.device import to_host
from megaprm.parallel.groups import Groups

# re-exported: the formats' home is prm_input (no Megatron import), scoring builds them
from megaprm.rewards.prm_input import (  # noqa: F401
    HF_CONFIG_KEY,
    PRM_INPUT_FORMATS,
    PROF_PRM_SYSTEM,
    QWEN_PRM_STEP_TOKEN,
    AnyPRMFormat,
    ChatStepFormat,
    PRMInputFormat,
    check_prm_reads_policy,
    resolve_prm_input_format,
)
from megaprm.rewards.steps import (
    StepSegmentation,
    segment_steps,
)


@dataclass(frozen=True)
class PRMBatch:
    """PRM inputs of B sequences, right-padded with `pad_id`.

    input_ids [B, L] long; lengths [B] long (valid tokens); score_index [B, S] long (position of
    step k's closing token in input_ids, 0 where ~step_mask); step_mask [B, S] bool.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    score_index: torch.Tensor
    step_mask: torch.Tensor

    def select(self, rows) -> "PRMBatch":
        return PRMBatch(self.input_ids[rows], self.lengths[rows], self.score_index[rows],
                        self.step_mask[rows])


def build_prm_batch(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                    seg: StepSegmentation, fmt: PRMInputFormat, pad_id: int = 0) -> PRMBatch:
    """Concatenate each prompt (valid tokens only, [P_i]) with its response ([T_i], the valid
    prefix of the row `seg` was computed on) and place step scores at P_i + step_end_index."""
    B = len(prompts)
    assert len(responses) == B == seg.step_mask.shape[0]
    rows, lengths = [], []
    for i in range(B):
        resp = responses[i].long()
        assert int((seg.token_to_step[i] >= 0).sum()) == resp.numel(), "responses must be prefixes"
        if fmt.step_marker_id is not None:
            ends = seg.is_step_end[i, : resp.numel()]
            resp = torch.where(ends, torch.full_like(resp, fmt.step_marker_id), resp)
        row = torch.cat([prompts[i].long(), resp])
        rows.append(row)
        lengths.append(row.numel())
    L = max(max(lengths), 1)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : row.numel()] = row
    prompt_len = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
    index = torch.where(seg.step_mask, seg.step_end_index + prompt_len[:, None], 0)
    return PRMBatch(ids, torch.tensor(lengths, dtype=torch.long), index, seg.step_mask.bool())


def batch_from_rollouts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        response_ids: torch.Tensor, response_mask: torch.Tensor,
                        sep_ids, fmt: PRMInputFormat, pad_id: int = 0):
    """Rollout tensors (prompts [B, P] left-padded, responses [B, T] right-padded) ->
    (PRMBatch, StepSegmentation of the responses)."""
    seg = segment_steps(response_ids, response_mask, sep_ids)
    prompts = [prompt_ids[i][prompt_mask[i].bool()] for i in range(prompt_ids.shape[0])]
    responses = [response_ids[i][response_mask[i].bool()] for i in range(response_ids.shape[0])]
    return build_prm_batch(prompts, responses, seg, fmt, pad_id), seg


def build_chat_prm_batch(prompt_texts: Sequence[str], response_texts: Sequence[str],
                         fmt: ChatStepFormat) -> PRMBatch:
    """`ChatStepFormat` inputs of B samples: each conversation tokenised on its own (compacted,
    right-padded with the tokenizer's pad id), truncated to `fmt.max_length` on the right;
    step h is scored at the h-th `step_token` for h < max_steps (prof_dp_rm.py:240-246)."""
    tok, marker = fmt.tokenizer, fmt.step_token_id
    rows = [torch.tensor(tok(fmt.conversation(p, r), truncation=True, max_length=fmt.max_length,
                             add_special_tokens=True).input_ids, dtype=torch.long)
            for p, r in zip(prompt_texts, response_texts)]
    B = len(rows)
    marks = [torch.nonzero(row == marker).flatten()[: fmt.max_steps] for row in rows]
    L = max([row.numel() for row in rows] + [1])
    S = max([m.numel() for m in marks] + [1])
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((B, L), pad, dtype=torch.long)
    index = torch.zeros(B, S, dtype=torch.long)
    step_mask = torch.zeros(B, S, dtype=torch.bool)
    for i, (row, m) in enumerate(zip(rows, marks)):
        ids[i, : row.numel()] = row
        index[i, : m.numel()] = m
        step_mask[i, : m.numel()] = True
    return PRMBatch(ids, torch.tensor([r.numel() for r in rows], dtype=torch.long), index,
                    step_mask)


def chat_batch_from_rollouts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                             response_ids: torch.Tensor, response_mask: torch.Tensor,
                             fmt: ChatStepFormat) -> PRMBatch:
    """Rollout tensors -> `build_chat_prm_batch` of their texts, decoded as released
    (skip_special_tokens=True: padding and EOS vanish)."""
    dec = fmt.tokenizer.decode
    prompts = [dec(prompt_ids[i][prompt_mask[i].bool()].tolist(), skip_special_tokens=True)
               for i in range(prompt_ids.shape[0])]
    responses = [dec(response_ids[i][response_mask[i].bool()].tolist(), skip_special_tokens=True)
                 for i in range(response_ids.shape[0])]
    return build_chat_prm_batch(prompts, responses, fmt)


def left_padded_like_release(batch: PRMBatch, micro_batch_size: int, pad_id: int) -> PRMBatch:
    """PROF-GRPO's released PRM forward (prof_dp_rm.py:282-295, `prm.forward=released`): each
    micro-batch of `micro_batch_size` rows left-padded to its longest row and run with no
    attention mask, so every real token also attends to the padding before it and positions
    count from the first pad. Here: rows moved right by their padding inside a micro-batch's
    width (the causal mask then sees the pads as tokens, as the release's model does), score
    positions moved with them, every position of the width counted as a token."""
    B, L = batch.input_ids.shape
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    index = batch.score_index.clone()
    lengths = batch.lengths.clone()
    for start in range(0, B, micro_batch_size):
        rows = range(start, min(B, start + micro_batch_size))
        width = int(batch.lengths[start:start + micro_batch_size].max())
        for i in rows:
            n = int(batch.lengths[i])
            ids[i, width - n:width] = batch.input_ids[i, :n]
            index[i] = torch.where(batch.step_mask[i], index[i] + width - n, 0)
            lengths[i] = width
    return PRMBatch(ids, lengths, index, batch.step_mask)


def micro_batches(batch: PRMBatch, size: int, pp: int,
                  labels: Optional[torch.Tensor] = None,
                  loss_mask: Optional[torch.Tensor] = None) -> List[pipeline.TokenBatch]:
    """TokenBatches of `size` rows; with pp > 1 every one has the same [size, L] shape (p2p),
    the short last one padded with empty rows (no steps). payload = (score_index, step_mask)
    [b, S], plus step labels [b, S] when given (PRM training). `loss_mask [B, L]` (next-token
    positions of an auxiliary LM loss) becomes each TokenBatch's loss_mask; zeros otherwise."""
    out = []
    B = batch.input_ids.shape[0]
    if loss_mask is None:
        loss_mask = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for start in range(0, B, size):
        rows = slice(start, start + size)
        parts = [batch.input_ids[rows], loss_mask[rows].float(), batch.score_index[rows],
                 batch.step_mask[rows]]
        if labels is not None:
            parts.append(labels[rows])
        if pp > 1 and parts[0].shape[0] < size:
            extra = size - parts[0].shape[0]
            parts = [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in parts]
        out.append(pipeline.TokenBatch(parts[0], parts[1], payload=tuple(parts[2:])))
    return out


@torch.no_grad()
def run_prm(model, groups: Groups, batch: PRMBatch, *, head: str, micro_batch_size: int,
            keep_logits: bool = False) -> StepScores:
    """Score this rank's rows with a discriminative PRM (`models.prm.PRMModel`, DDP-wrapped or
    not) under any tp/pp; every pp stage gets the result."""
    B = batch.input_ids.shape[0]
    S = batch.step_mask.shape[1]

    def post(mb, logits):  # logits [b, L, 2] on the last stage
        return None, gather_positions(logits, mb.payload[0]).float()

    parts = pipeline.run(model, micro_batches(batch, micro_batch_size, groups.pp_size),
                         groups=groups, post=post, forward_only=True)
    # host side from here: the step mask, the scores and everything after them are host tensors
    step_logits = to_host(torch.cat(parts)[:B]) if parts else None
    step_logits = pipeline.broadcast_from_last_stage(step_logits, groups)
    if step_logits is None:  # B == 0
        step_logits = torch.zeros(0, S, 2)
    return head_step_scores(step_logits, batch.step_mask, head, keep_logits=keep_logits)


def score_rollouts(model, groups: Groups, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   response_ids: torch.Tensor, response_mask: torch.Tensor, *, sep_ids,
                   fmt: AnyPRMFormat, head: str, micro_batch_size: int, pad_id: int = 0,
                   forward: str = "compact"):
    """Per-step PRM scores of this rank's rollouts -> (StepScores [B, S], StepSegmentation).

    Step k of response i closes at response position seg.step_end_index[i, k] (where a
    per-token reward for it goes). A text-level `ChatStepFormat` has no token map: the
    segmentation is None and the steps are PROF's text steps (scores.step_mask; their count is
    `steps.prof_num_steps` of the decoded texts unless max_length truncated the input).
    `forward` (prm.forward): compact (exact), or released (`left_padded_like_release`)."""
    seg = None
    if isinstance(fmt, ChatStepFormat):
        batch = chat_batch_from_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, fmt)
        pad_id = fmt.tokenizer.pad_token_id if fmt.tokenizer.pad_token_id is not None else 0
    else:
        batch, seg = batch_from_rollouts(prompt_ids, prompt_mask, response_ids, response_mask,
                                         sep_ids, fmt, pad_id)
    if forward == "released":
        batch = left_padded_like_release(batch, micro_batch_size, pad_id)
    return run_prm(model, groups, batch, head=head, micro_batch_size=micro_batch_size), seg


# ------------------------------------------------------------------------------ implicit PRM

@dataclass(frozen=True)
class ImplicitRewards:
    """q [B, T] float32 on response positions (0 on padding); steps: per-step sums of q."""

    q: torch.Tensor
    steps: StepScores


@torch.no_grad()
def sequence_logprobs(model, groups: Groups, batch: PRMBatch, *, vocab_size: int,
                      micro_batch_size: int) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, <t]) [B, L] of a causal-LM actor (0 at t = 0)."""
    B, L = batch.input_ids.shape

    def post(mb, logits):  # [b, L, V/tp], vocab-parallel
        lp = next_token_logprobs(logits, mb.input_ids, tp_group=groups.tp,
                                 tp_rank=groups.tp_rank, vocab_size=vocab_size)
        return None, torch.nn.functional.pad(lp, (1, 0))

    parts = pipeline.run(model, micro_batches(batch, micro_batch_size, groups.pp_size),
                         groups=groups, post=post, forward_only=True)
    lp = to_host(torch.cat(parts)[:B]) if parts else None  # host side, like the batch
    lp = pipeline.broadcast_from_last_stage(lp, groups)
    return lp if lp is not None else torch.zeros(0, L)


def implicit_prm_rewards(prm_model, ref_model, groups: Groups, prompt_ids: torch.Tensor,
                         prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, *, sep_ids, vocab_size: int,
                         micro_batch_size: int, pad_id: int = 0) -> ImplicitRewards:
    """PRIME's implicit process rewards of this rank's rollouts under two causal-LM actors
    (the implicit PRM and the reference; any tp/pp, the same layout for both)."""
    batch, seg = batch_from_rollouts(prompt_ids, prompt_mask, response_ids, response_mask,
                                     sep_ids, PRMInputFormat(), pad_id)
    kw = dict(vocab_size=vocab_size, micro_batch_size=micro_batch_size)
    lp_prm = sequence_logprobs(prm_model, groups, batch, **kw)
    lp_ref = sequence_logprobs(ref_model, groups, batch, **kw)
    # response token t of row i sits at P_i + t in the PRM batch
    B, T = response_ids.shape
    prompt_len = prompt_mask.long().sum(1)
    pos = (prompt_len[:, None] + torch.arange(T)[None]).clamp(max=batch.input_ids.shape[1] - 1)
    valid = seg.token_to_step >= 0
    q = implicit_token_rewards(lp_prm.gather(1, pos), lp_ref.gather(1, pos), valid)
    return ImplicitRewards(q=q, steps=implicit_step_scores(q, seg.token_to_step, seg.step_mask))


def all_gather_rows(obj, groups: Groups) -> list:
    """Every dp rank's Python object, dp-rank order (evaluation over a dp-sharded set)."""
    if groups.dp_size == 1:
        return [obj]
    out = [None] * groups.dp_size
    dist.all_gather_object(out, obj, group=groups.dp)
    return out

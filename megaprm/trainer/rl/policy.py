"""A Megatron causal LM on this rank (actor, reference or implicit PRM) with its optimiser, how
a phase's rows become micro-batches, and the response <-> target layouts of its log-probs.
Tensor shapes: B rows, R response tokens, L = prompt+response tokens (right-padded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from checkpoint_tools import model_source
from megaprm.models.actor import build_stage
from megaprm.models.logprobs import next_token_logprobs
from megaprm.parallel import microbatch, pipeline
from megaprm.parallel.optimizer import Optimizer
from megaprm.parallel.device import to_host
from megaprm.parallel.groups import Groups
from megaprm.rollout.engine import RightPadded


def response_to_targets(values: torch.Tensor, rp: RightPadded) -> torch.Tensor:
    """Response-layout values [B, R] -> target-aligned [B, L-1] (index t is input token t+1)."""
    B, L = rp.input_ids.shape
    out = torch.zeros(B, L - 1, dtype=values.dtype)
    R = values.shape[1]
    for i in range(B):
        start = int(rp.response_start[i]) - 1
        n = min(R, L - 1 - start)
        out[i, start:start + n] = values[i, :n]
    return out


def targets_to_response(values: torch.Tensor, rp: RightPadded, width: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(values, (1, 0))  # token-aligned [B, L]
    return rp.to_response(padded, width)


def logprob_post(spec, groups: Groups, temperature: float, with_entropy: bool = False,
                 also_at: Optional[float] = None):
    """`post` for pipeline.run: token log-probs [n, L-1] (and entropy) at `temperature`, one row
    per sequence of the micro-batch (packed rows unpacked). `also_at` (no entropy): the same
    logits' log-probs at a second temperature too, stacked last: [n, L-1, 2]."""
    def logprobs(mb, logits, t, entropy=False):
        return next_token_logprobs(logits, mb.input_ids, tp_group=groups.tp,
                                   tp_rank=groups.tp_rank, vocab_size=spec.vocab_size,
                                   with_entropy=entropy, temperature=t)

    def post(mb, logits):
        out = logprobs(mb, logits, temperature, with_entropy)
        if with_entropy:
            return None, (microbatch.unpack(mb, out[0]), microbatch.unpack(mb, out[1]))
        if also_at is not None:
            out = torch.stack([out, logprobs(mb, logits, also_at)], dim=-1)
        return None, microbatch.unpack(mb, out)
    return post


class Policy:
    """A Megatron causal LM on this rank (actor, reference or implicit PRM) + its optimiser.
    `temperature`: the distribution its log-probs describe (actor and ref: `logprob_temperature`,
    the rollout's unless a recipe says otherwise)."""

    def __init__(self, spec, groups: Groups, src: model_source.ModelSource, *, trainable: bool,
                 optim=None, dtype=torch.float32, temperature: float = 1.0, batching=None,
                 build: Optional[dict] = None):
        self.spec, self.groups, self.src, self.temperature = spec, groups, src, temperature
        self.batching = batching or Batching(16, None, groups.pp_size)
        model = build_stage(spec, groups, dtype=dtype, **(build or {}))
        model_source.load_weights(model, src, spec, groups)
        if trainable:
            self.model = pipeline.wrap_ddp(
                model, groups,
                grad_reduce_in_fp32=optim.grad_reduce_in_fp32 if optim is not None else True)
            self.opt = Optimizer(self.model, optim, groups)
        else:
            self.model, self.opt = model.eval(), None
            for p in model.parameters():
                p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                 also_at: Optional[float] = None):
        """log p_T(input_ids[:, t+1] | <=t) [B, L-1] on every rank, on the host (forward only).
        `lengths` [B]: real tokens per row (needed to pack; 0 past them when packed).
        `also_at`: a second temperature (the sampler's, for the monitor) from the same forward:
        returns (log-probs at T, log-probs at also_at)."""
        B = input_ids.shape[0]
        mbs = self.batching.split(input_ids, torch.zeros(input_ids.shape[0],
                                                         input_ids.shape[1] - 1), None, lengths)
        parts = pipeline.run(self.model, mbs, groups=self.groups, forward_only=True,
                             post=logprob_post(self.spec, self.groups, self.temperature,
                                               also_at=also_at))
        out = to_host(microbatch.to_rows(mbs, parts, B)) if parts else None
        out = pipeline.broadcast_from_last_stage(out, self.groups)
        return out if also_at is None else (out[..., 0], out[..., 1])


@dataclass(frozen=True)
class Batching:
    """How a phase's rows become micro-batches: `micro_batch_size` padded rows, or packed rows
    of at most `max_tokens` tokens (then `lengths` are needed). Payload and outputs stay one row
    per sequence (`microbatch.unpack` / `to_rows`)."""

    micro_batch_size: int
    max_tokens: Optional[int]
    pp_size: int

    def split(self, ids, mask_t, payload, lengths=None) -> List[pipeline.TokenBatch]:
        """ids [B, L]; mask_t [B, L-1] target-aligned (position t predicts t+1)."""
        mask = torch.nn.functional.pad(mask_t, (0, 1))
        if self.max_tokens is not None and lengths is not None:
            return microbatch.make_micro_batches(ids, mask, payload, max_tokens=self.max_tokens,
                                                 lengths=lengths, pp_size=self.pp_size)
        return microbatch.make_micro_batches(ids, mask, payload,
                                             micro_batch_size=self.micro_batch_size,
                                             pp_size=self.pp_size)


def fixed_micro_batches(ids, mask, payload, size, pp) -> List[pipeline.TokenBatch]:
    """Micro-batches of `size` padded rows (mask [B, L-1]); with pp > 1 all the same shape."""
    return Batching(size, None, pp).split(ids, mask, payload)



"""The rollout engine contract: sampling parameters, the batch an engine returns, the protocol.

Every engine (transformers on CPU/GPU, vLLM colocated on GPU) speaks token ids in and token ids
plus sampler log-probs out, and takes weights as a stream of (hf_name, tensor) pairs (the
`rollout.weight_sync` stream; vLLM's `load_weights` contract). Rows are grouped: the n samples
of prompt i are rows i*n .. i*n+n-1 of every [B, ...] tensor (B = len(prompts) * n).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import (
    NamedTuple,
    Optional,
    Protocol,
    runtime_checkable,
)

import torch

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` is greedy; `top_p` keeps the smallest set of tokens whose
    probability mass (after temperature) reaches top_p. Sample row r of a call uses the seed
    `seed + r` (r = its row in the returned batch); `seed=None` draws one seed from torch's RNG.
    Generation stops on the engine's EOS ids and on `stop_token_ids` (the stop token is kept in
    the response), or after `max_tokens` generated tokens."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1 (samples per prompt)")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", "must be in (0, 1] (1 = no nucleus truncation)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            bad("stop_token_ids", "must be a sequence of non-negative token ids")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be None or a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RightPadded(NamedTuple):
    """Prompt + response of each row as one right-padded sequence (what the trainer runs).

    input_ids [B, L]: row b is its real prompt tokens, then its generated tokens, then padding;
    L = max_b(prompt_len_b + response_len_b) <= P' + R. attention_mask [B, L]: 1 on real tokens.
    response_mask [B, L]: 1 on generated tokens (the positions whose log-probs are trained).
    response_start [B]: position of row b's first generated token (= its prompt length).

    The log-prob of token t comes from the logits at position t-1: the loss mask in
    `pipeline.TokenBatch`'s convention (position t predicts t+1) is `loss_mask`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    response_start: torch.Tensor

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, L] float: 1 at t when input_ids[t+1] is a generated token."""
        m = torch.zeros_like(self.response_mask, dtype=torch.float32)
        m[:, :-1] = self.response_mask[:, 1:].float()
        return m

    def to_response(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """Token-aligned values [B, L] (values[b, t] belongs to input_ids[b, t]) -> the response
        layout [B, width] of `RolloutBatch.response_ids` (zeros past each response)."""
        length = values.shape[1]
        pos = self.response_start[:, None] + torch.arange(width, device=values.device)[None]
        out = values.gather(1, pos.clamp(max=length - 1))
        valid = pos < length
        valid &= self.response_mask.gather(1, pos.clamp(max=length - 1)).bool()
        return torch.where(valid, out, torch.zeros_like(out))


@dataclass
class RolloutBatch:
    """What `generate` returns. B = len(prompts) * n; row r is sample r % n of prompt r // n.

    prompt_ids [B, P] long, LEFT-padded with `pad_token_id`; prompt_mask [B, P] long (1 = real).
    response_ids [B, R] long, RIGHT-padded; response_mask [B, R] long, 1 on generated tokens
        including the stop/EOS token that ended the response.
    sampler_logprobs [B, R] float32: log-prob of each sampled token under the distribution it was
        drawn from, i.e. log_softmax(logits / temperature), renormalised over the top-p nucleus
        when top_p < 1 (so with top_p < 1 it is NOT the trainer's temperature-only log-prob).
        For greedy rows (temperature 0) it is the log-prob under the untempered softmax
        (temperature 1), since the point mass would carry no information. 0 on padding.
    finish_reason: B strings, "stop" (a stop/EOS token was generated) or "length" (max_tokens).
    group_index [B] long: the prompt index of each row (r // n).
    row_versions [B] long: the weight version (number of weight syncs) each row was drawn with,
        set by the trainer's rollout source; None from an engine used on its own.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    finish_reason: list[str]
    group_index: torch.Tensor
    pad_token_id: int = 0
    row_versions: Optional[torch.Tensor] = None

    def __post_init__(self):
        b = self.prompt_ids.shape[0]
        assert self.prompt_mask.shape == self.prompt_ids.shape
        assert self.response_ids.shape == self.response_mask.shape == self.sampler_logprobs.shape
        assert self.response_ids.shape[0] == b and self.group_index.shape == (b,)
        assert len(self.finish_reason) == b and set(self.finish_reason) <= set(FINISH_REASONS)

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(1)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.prompt_mask.sum(1)

    def response_token_lists(self) -> list[list[int]]:
        return [ids[m.bool()].tolist() for ids, m in zip(self.response_ids, self.response_mask)]

    def prompt_token_lists(self) -> list[list[int]]:
        return [ids[m.bool()].tolist() for ids, m in zip(self.prompt_ids, self.prompt_mask)]

    def decode_responses(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Response texts (the stop token dropped when it is a special token and skipped)."""
        return tokenizer.batch_decode(self.response_token_lists(),
                                      skip_special_tokens=skip_special_tokens)

    def decode_prompts(self, tokenizer, skip_special_tokens: bool = False) -> list[str]:
        return tokenizer.batch_decode(self.prompt_token_lists(),
                                      skip_special_tokens=skip_special_tokens)

    def to_right_padded(self, pad_token_id: int | None = None) -> RightPadded:
        """Concatenate each row's real prompt and its response, right-padded (see RightPadded)."""
        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        plen, rlen = self.prompt_lengths, self.response_lengths
        length = int((plen + rlen).max()) if self.batch_size else 0
        b, p = self.prompt_ids.shape
        cols = torch.arange(length)[None]  # [1, L]; row i: its pl prompt tokens, rl response ones
        pl, end = plen[:, None], (plen + rlen)[:, None]
        in_prompt, in_resp = cols < pl, (cols >= pl) & (cols < end)
        ids = torch.full((b, length), pad, dtype=self.prompt_ids.dtype)
        if p:  # left padding: a row's real prompt tokens are its last pl
            src = self.prompt_ids.gather(1, (cols + p - pl).clamp(0, p - 1))
            ids = torch.where(in_prompt, src, ids)
        r = self.response_ids.shape[1]
        if r:
            src = self.response_ids.gather(1, (cols - pl).clamp(0, r - 1))
            ids = torch.where(in_resp, src.to(ids.dtype), ids)
        attn = (in_prompt | in_resp).long()
        resp = in_resp.long()
        return RightPadded(ids, attn, resp, plen.clone())


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (ids [len*repeat, P], mask [len*repeat, P]) LEFT-padded, each prompt
    repeated `repeat` times contiguously (the grouping of `RolloutBatch`)."""
    if not prompts:
        raise ValueError("generate() got no prompts: pass a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(repeat)]
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


class EngineAsleepError(RuntimeError):
    """A call that needs the engine's weights (or KV cache) resident came while it sleeps."""


@contextlib.contextmanager
def preserved_rng_and_device():
    """Run a block (building an engine) without letting it change the caller's random state or
    current CUDA device: python `random`, numpy's global generator, torch's CPU generator, every
    CUDA generator and `torch.cuda.current_device()` are saved before and restored after.

    vLLM reseeds all four while it builds (0.33.0 `vllm/v1/worker/gpu_worker.py:517` and `:1094`
    call `set_random_seed(seed)`, `vllm/utils/torch_utils.py:528`) and sets the worker's device
    (`gpu_worker.py:496`); a trainer that seeded its dropout / data order would silently change.
    """
    import random

    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.is_available()
    if cuda:
        dev, cuda_states = torch.cuda.current_device(), torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda_states)
            torch.cuda.set_device(dev)


def finish_reason(tokens: Sequence[int], stop_ids: Iterable[int]) -> str:
    """"stop" when the response ends with a stop/EOS id (also when that id is the max_tokens-th
    token), else "length". Decided from the tokens, not from the engine's own label: vLLM 0.10.2
    checks the length cap first (`vllm/v1/core/sched/utils.py:46-49`) and calls an EOS sampled as
    the last allowed token "length"; 0.33.0 checks EOS/stop ids first (`utils.py:104-119`)."""
    return "stop" if len(tokens) and int(tokens[-1]) in set(stop_ids) else "length"


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a generator: one lifecycle, the same for every engine.

        build -> [update_weights] -> generate -> sleep -> (train) -> update_weights -> generate
                 -> sleep -> ...

    `sleep()` (after each rollout) frees the engine's accelerator memory for training: the
    weights (offloaded or dropped) and the KV cache. `update_weights(stream)` (before the next
    rollout) does, in the order vLLM requires: wake the weights only -> load the stream -> reset
    the prefix cache (cached KV was computed by the old weights) -> wake the KV cache. It also
    works on an awake engine (then it only loads and resets). It returns how many tensors it
    loaded. With `wake_kv_cache=False` it stops before the last step: the trainer offloads its
    state in between and then calls `wake()` (verl's order, trainer/lifecycle.py).

    `load_weights` is the awake-only primitive (what `rollout.weight_sync.sync_weights` calls):
    on a sleeping engine it raises `EngineAsleepError`, since vLLM would write into unmapped
    memory or have the write overwritten by the stale offloaded copy at wake-up. `wake()` wakes
    everything still asleep without loading (the KV cache after `update_weights(wake_kv_cache=
    False)`; everything for evaluation). `generate` while anything sleeps raises
    `EngineAsleepError`.

    Streams: (hf_name, tensor) pairs, consumed once; with strict=True an unknown name raises at
    once and names the model never received raise after the stream ends (a partial update needs
    strict=False). Tensors are copied: the caller may free them after they are consumed.
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch: ...

    def sleep(self) -> None: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                       strict: bool = True, wake_kv_cache: bool = True) -> int: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = True) -> int: ...

    def wake(self) -> None: ...

    @property
    def asleep(self) -> bool: ...

"""A transformers rollout engine: our own batched decode loop over the HF model's forward.

Why not `model.generate`: we need the exact log-prob of every sampled token under the
distribution it was drawn from, and seeding that does not depend on the batch. The loop is:
left-padded prefill with a DynamicCache (position ids count real tokens only), then one token
per step for the rows still running; finished rows are dropped from the batch and the cache.
On the CPU the decode steps of Qwen2/Llama models go through `decode.CompactDecoder` (the same
layer maths as a short list of tensor calls; the prefill stays transformers' forward).

Seeding (what is guaranteed): row r of a call draws its uniforms from its own generator seeded
with `seed + r`, one uniform per generated token, so the random stream of a row never depends on
the other rows. The draws are batched: each row's `max_tokens` uniforms are drawn up front in
one call on its generator (the same values, in the same order, as one draw per token; the
values of tokens after the row stops go unused), and step t reads column t for the active rows. Given the same weights, prompts, params and seed, the outputs are identical run to
run on the same device. Across different batch compositions a row gets the same uniforms, but the
logits may differ in the last bits (padding width / batch shape change the kernels' reduction
order), which can flip a sample whose uniform lands within that rounding of a CDF boundary.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from megaprm.parallel import cpu
from megaprm.rollout import decode, fused_experts
from megaprm.rollout.engine import EngineAsleepError, RolloutBatch, SamplingParams, left_pad

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cache_kwarg(model) -> str:
    """The name `model.forward` takes its KV cache under: `cache` (transformers >= 5.24) or
    `past_key_values` (before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class HFEngineConfig:
    """device: "cpu" | "cuda[:i]"; dtype: float32 | bfloat16 | float16 (weights and forward).
    pad/eos ids default to the model config's; `eos_token_ids` always stop generation.
    compact_decode: decode steps through `decode.CompactDecoder` where the architecture allows
    (Qwen2/Llama; others use transformers' forward for every step). None (default) = on the CPU
    only: it holds fused copies of the q/k/v and gate/up weights (~+70% of a 7B layer's weights),
    which a GPU fallback engine of a 7B model cannot spare, and it has not run on a GPU."""

    device: str = "cpu"
    dtype: str = "float32"
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    compact_decode: bool | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"HFEngineConfig.dtype={self.dtype!r}: expected one of {list(_DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"HFEngineConfig.device={self.device!r}: expected 'cpu' or 'cuda[:i]'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"HFEngineConfig.device={self.device!r} but CUDA is not available; "
                             "use device='cpu'")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))


def _config_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [b, V] (fp32) -> (tokens [b], sampler log-probs [b]).

    Inverse-CDF sampling with one uniform in (0, 1] per row (`uniforms` [b]), so zero-probability
    tokens (outside the nucleus) can never be drawn. See RolloutBatch for the log-prob definition.
    """
    if params.greedy:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits if params.temperature == 1.0 else
                             logits / params.temperature, -1)
    if params.top_p < 1.0:
        sorted_lp, order = logp.sort(-1, descending=True)
        p = sorted_lp.exp()
        # keep a token when the mass strictly before it is < top_p (the first is always kept)
        keep = (p.cumsum(-1) - p) < params.top_p
        sorted_lp = sorted_lp.masked_fill(~keep, float("-inf"))
        sorted_lp = sorted_lp - torch.logsumexp(sorted_lp, -1, keepdim=True)
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
    cdf = logp.exp().cumsum(-1)
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    tok = torch.searchsorted(cdf, target).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class HFEngine:
    """RolloutEngine over a transformers causal LM (see module docstring for the seeding contract).

    Build with `HFEngine(model, cfg)`, `HFEngine.from_pretrained(dir, cfg)` or
    `HFEngine.from_config(hf_config, cfg, seed=...)` (random weights, e.g. before a weight sync).
    """

    def __init__(self, model, cfg: HFEngineConfig = HFEngineConfig()):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = model.to(device=self.device, dtype=_DTYPES[cfg.dtype]).eval()
        mc = self.model.config
        self.eos_token_ids = cfg.eos_token_ids or _config_ids(getattr(mc, "eos_token_id", None))
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(mc, "pad_token_id", None)
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self.vocab_size = int(mc.vocab_size)
        self.max_positions = int(getattr(mc, "max_position_embeddings", 1 << 30))
        # the RolloutEngine lifecycle state (see engine.RolloutEngine): weights / KV cache asleep
        self._asleep = self._kv_asleep = False

        compact = cfg.compact_decode if cfg.compact_decode is not None else self.device.type == "cpu"
        self.decoder = (decode.CompactDecoder(self.model)
                        if compact and decode.unsupported(self.model) is None else None)

    @classmethod
    def from_pretrained(cls, model_dir: str, cfg: HFEngineConfig = HFEngineConfig()) -> HFEngine:
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[cfg.dtype])
        return cls(model, cfg)

    @classmethod
    def from_config(cls, hf_config, cfg: HFEngineConfig = HFEngineConfig(),
                    seed: int = 0) -> HFEngine:
        import transformers as tf

        torch.manual_seed(seed)
        return cls(tf.AutoModelForCausalLM.from_config(hf_config), cfg)

    # ------------------------------------------------------------------------------ weights

    def _tied(self) -> bool:
        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return bool(getattr(text, "tie_word_embeddings", False))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = True) -> int:
        """Copy (hf_name, tensor) pairs into the model; returns how many were copied.

        Unknown names raise at once; with strict=True, parameters never received raise after the
        stream ends. With tied embeddings `lm_head.weight` is the embedding: an incoming
        `lm_head.weight` is skipped (the embedding carries it). An MoE expert's checkpoint name
        fills its slice of transformers' fused expert tensor (`fused_experts`); the fused tensor
        counts as received once every expert's slices came. Raises `EngineAsleepError` on a
        sleeping engine: the RL loop calls `update_weights`, which wakes the weights first.
        """
        if self._asleep:
            raise EngineAsleepError(
                "HFEngine.load_weights() while asleep: call update_weights(), which wakes the "
                "weights before loading (the order vLLM needs)")
        params = dict(self.model.named_parameters())  # a tied lm_head is deduplicated away
        tied_head = self._tied() and "lm_head.weight" not in params
        seen, fused_seen, copied = set(), {}, 0
        for name, tensor in weights:
            param = params.get(name)
            if param is None and (target := fused_experts.fused_target(name, params)):
                fused, param = target
                fused_seen[fused] = fused_seen.get(fused, 0) + 1
                if fused_seen[fused] == fused_experts.pieces(params[fused], fused):
                    seen.add(fused)
                name = f"{name} (in {fused})"
            if param is None:
                if tied_head and name == "lm_head.weight":
                    continue
                raise KeyError(
                    f"load_weights: {name!r} is not a parameter of {type(self.model).__name__} "
                    f"(e.g. {sorted(params)[:3]}); the stream comes from a different "
                    "architecture or config than this engine's model")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"engine's model expects {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            copied += 1
            if name in params:
                seen.add(name)
        if strict:
            missing = sorted(set(params) - seen)
            if missing:
                raise ValueError(
                    f"load_weights(strict=True): {len(missing)} parameter(s) were not in the "
                    f"stream: {missing[:10]}{' ...' if len(missing) > 10 else ''}; pass "
                    "strict=False for a partial update")
        return copied

    # ------------------------------------------------------------------------------ lifecycle

    @property
    def asleep(self) -> bool:
        return self._asleep or self._kv_asleep

    def sleep(self) -> None:
        """After a rollout. On GPU: the weights go to host memory and the cached blocks are
        released (vLLM's level-1 sleep: weights offloaded, KV cache dropped; this engine keeps no
        KV cache between calls). On CPU nothing is freed: only the state changes, so CPU runs go
        through the same calls and errors as GPU runs."""
        self._kv_asleep = True
        if self._asleep:
            return
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def _wake_weights(self) -> None:
        if self.device.type == "cuda" and self._asleep:
            self.model.to(self.device)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                       strict: bool = True, wake_kv_cache: bool = True) -> int:
        """Before a rollout: wake the weights, load the stream, (no prefix cache to reset),
        wake the KV cache (nothing to allocate: this engine builds its cache per call; the state
        changes, so `wake_kv_cache=False` leaves `generate` refused until `wake()`, as vLLM)."""
        self._wake_weights()
        self._asleep = False
        n = self.load_weights(weights, strict=strict)
        if wake_kv_cache:
            self._kv_asleep = False
        return n

    def wake(self) -> None:
        """Wake whatever sleeps without loading: the KV cache after
        `update_weights(wake_kv_cache=False)`, or the weights held at sleep() too (evaluation)."""
        self._wake_weights()
        self._asleep = self._kv_asleep = False

    # ------------------------------------------------------------------------------ sampling

    def _check(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if self.asleep:
            raise EngineAsleepError("HFEngine.generate() while asleep: call update_weights() "
                                    "(RL loop) or wake() before generating")
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_tokens > self.max_positions:
            room = self.max_positions - params.max_tokens
            raise ValueError(
                f"longest prompt ({longest} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's max_position_embeddings={self.max_positions}; set "
                f"data.max_prompt_tokens={max(room, 1)} with data.long_prompt=truncate or drop, "
                "or lower rollout.max_tokens")
        for i, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        # On the CPU, megatron-core's CUDA->CPU function mode (`parallel.cpu`) is not needed
        # by transformers and would route every torch call of the decode loop through Python

        with cpu.paused():
            return self._generate(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        self._check(prompts, params)
        ids, mask = left_pad(prompts, self.pad_token_id, params.n)  # [B, P]
        b, r_max = ids.shape[0], params.max_tokens
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 62, ()))
        uniforms = None  # [B, max_tokens]: row r from its own generator, seeded seed + r
        if not params.greedy:
            gen = torch.Generator()
            uniforms = 1.0 - torch.stack([torch.rand(r_max, generator=gen.manual_seed(seed + r))
                                          for r in range(b)])
        stops = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
                             dtype=torch.long, device=self.device)
        resp = torch.full((b, r_max), self.pad_token_id, dtype=torch.long)
        resp_lp = torch.zeros((b, r_max), dtype=torch.float32)
        finish = ["length"] * b
        lengths = torch.full((b,), r_max, dtype=torch.long)

        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # transformers >= 5.24 renamed `past_key_values` to `cache` (the old name warns)
        kv = {_cache_kwarg(self.model): cache}
        attn = mask.to(self.device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        out = self.model(input_ids=ids.to(self.device), attention_mask=attn, position_ids=pos,
                         use_cache=True, **kv)
        logits = out.logits[:, -1].float()  # [b_active, V]
        next_pos = attn.sum(1, keepdim=True)  # [b_active, 1]
        if self.decoder is not None:
            self.decoder.start(cache, attn, r_max)
            kv = cache = out = None  # the decoder holds the keys and values now
        active = torch.arange(b)  # rows of the batch still generating (indices into B)
        rows = slice(None)  # `active` as an index: every row (column writes) until one stops
        for t in range(r_max):
            u = None if uniforms is None else uniforms[rows, t]
            tok, lp = sample_tokens(logits, params, u)
            resp[rows, t] = tok.cpu()
            resp_lp[rows, t] = lp.float().cpu()
            hit = torch.isin(tok, stops)
            stopped = bool(hit.any())
            if stopped:
                for r in active[hit.cpu()].tolist():
                    finish[r], lengths[r] = "stop", t + 1
            if t == r_max - 1 or (stopped and bool(hit.all())):
                break
            if stopped:  # drop finished rows from the batch and the KV cache
                keep = (~hit).nonzero().squeeze(-1)
                if self.decoder is not None:
                    self.decoder.select(keep)
                else:
                    cache.batch_select_indices(keep)
                attn, next_pos, tok = attn[keep], next_pos[keep], tok[keep]
                active = rows = active[keep.cpu()]
            if self.decoder is not None:
                logits = self.decoder.step(tok, next_pos)
            else:
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
                out = self.model(input_ids=tok[:, None], attention_mask=attn,
                                 position_ids=next_pos, use_cache=True, **kv)
                logits = out.logits[:, -1].float()
            next_pos = next_pos + 1
        width = int(lengths.max())  # R: the longest response
        resp_mask = (torch.arange(width)[None] < lengths[:, None]).long()
        resp = resp[:, :width].masked_fill(resp_mask == 0, self.pad_token_id)
        resp_lp = resp_lp[:, :width].masked_fill(resp_mask == 0, 0.0)
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=resp,
                            response_mask=resp_mask, sampler_logprobs=resp_lp,
                            finish_reason=finish,
                            group_index=torch.arange(b) // params.n,
                            pad_token_id=self.pad_token_id)

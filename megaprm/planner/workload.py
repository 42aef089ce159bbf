"""What a plan reads from a config: one flat, typed record (`Workload`), so the search and the
"knobs that would make it fit" can change a field and plan again without touching a Config."""
from __future__ import annotations

from dataclasses import dataclass

from megaprm.models.hf_spec import ModelSpec
from megaprm.models.logprobs import CHUNK_TOKENS_ACCELERATOR

# A prompt length the config does not bound (data.max_prompt_tokens unset): the recipes' own
# comments give 1024 (PROF-GRPO/GRPO script:43, PRIME script:20, PURE script:43) or 2048 (PAPO).
DEFAULT_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class Workload:
    actor: ModelSpec
    prm: ModelSpec | None      # a discriminative PRM's spec; None otherwise
    world: int                    # GPUs
    tp: int
    pp: int
    dtype_bytes: int              # 2 (bf16) or 4 (fp32)
    prompts: int                  # data.prompts_per_step
    n: int                        # rollout.n
    prompt_tokens: int            # longest prompt
    max_tokens: int               # rollout.max_tokens
    mean_prompt: float            # mean lengths (time only); memory uses the longest
    mean_response: float
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    mini_batches: int
    recompute: bool
    needs_ref: bool
    implicit: bool                # PRIME: a second trained policy-sized model
    judge: bool                   # a grader LLM in its own engine (not planned)
    engine: str                   # vllm | hf
    gpu_memory_utilization: float
    actor_offload: bool = False
    ref_offload: bool = False
    prm_offload: bool = False
    distributed_optimizer: bool | None = None   # None: Megatron's default here (dp > 1)
    logprob_chunk: int = CHUNK_TOKENS_ACCELERATOR  # the trainer's log-prob chunk on a GPU
    # rollout.placement=separate: the last `rollout_ranks` GPUs run the engines alone (tp
    # `rollout_tp` each, rollout/remote.py), the first world - rollout_ranks train; 0 = colocated
    rollout_ranks: int = 0
    max_staleness: int = 0        # rollout.max_staleness (separate only)
    rollout_tp: int = 1           # one engine's GPUs in the separate placement
    # the longest response of a step's batch (time only; None: rollout.max_tokens, which an RL
    # batch of hundreds of samples nearly always reaches). A synchronous batch waits for it;
    # `in_flight` (in-flight weight updates, partial rollout) keeps the engine fed instead
    max_response: float | None = None
    in_flight: bool = False
    rollout_logprobs: bool = False  # the old log-probs are the engine's: no trainer pass
    grad_reduce_in_fp32: bool = True  # actor.optim.grad_reduce_in_fp32 (Megatron's DDP option)
    ep: int = 1                   # parallel.ep: an MoE actor's experts split over ep dp ranks

    @property
    def separate(self) -> bool:
        return self.rollout_ranks > 0

    @property
    def trainer_world(self) -> int:
        """GPUs of the trainer (Megatron's tp x pp x dp)."""
        return self.world - self.rollout_ranks

    @property
    def engine_tp(self) -> int:
        """Tensor parallelism of one engine: the trainer's tp colocated, rollout_tp separate."""
        return self.rollout_tp if self.separate else self.tp

    @property
    def longest_response(self) -> float:
        return float(self.max_response or self.max_tokens)

    @property
    def dp(self) -> int:
        return self.trainer_world // (self.tp * self.pp)

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def micro_tokens(self) -> int:
        """Tokens of the largest micro-batch: a token budget, else padded rows."""
        if self.max_tokens_per_micro_batch:
            return max(self.max_tokens_per_micro_batch, self.seq_len)
        return self.micro_batch_size * self.seq_len

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def sharded_optimizer(self) -> bool:
        return self.dp > 1 if self.distributed_optimizer is None else self.distributed_optimizer


def workload_from_config(cfg, raw: dict, *, world: int, actor: ModelSpec,
                         prm: ModelSpec | None, prompt_tokens: int | None = None,
                         mean_response: float | None = None) -> Workload:
    """`cfg`: a validated Config; `raw`: its YAML + overrides as written (model.dtype "auto"
    means bf16 on the GPUs a plan is for, whatever this machine resolved it to)."""
    dtype = (raw.get("model") or {}).get("dtype", "auto")
    dtype = "bf16" if dtype == "auto" else cfg.model.dtype
    prompt = prompt_tokens or cfg.data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
    resp = float(mean_response) if mean_response else float(cfg.rollout.max_tokens)
    needs_ref = bool(cfg.actor.kl_coef or cfg.prm.kind == "implicit"
                     or (cfg.advantage.method == "pure" and cfg.advantage.pure.kl_coef))
    return Workload(
        actor=actor, prm=prm, world=world, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
        ep=cfg.parallel.ep,
        dtype_bytes=2 if dtype == "bf16" else 4, prompts=cfg.data.prompts_per_step,
        n=cfg.rollout.n, prompt_tokens=prompt, max_tokens=cfg.rollout.max_tokens,
        mean_prompt=float(prompt), mean_response=min(resp, cfg.rollout.max_tokens),
        micro_batch_size=cfg.actor.micro_batch_size,
        max_tokens_per_micro_batch=cfg.actor.max_tokens_per_micro_batch,
        mini_batches=cfg.actor.mini_batches, recompute=cfg.model.recompute,
        needs_ref=needs_ref, implicit=cfg.prm.kind == "implicit", judge=cfg.prm.kind == "judge",
        # auto plans the GPU run's engine: vLLM (a plan is made for GPUs, wherever it is made)
        engine="vllm" if cfg.rollout.engine == "auto" else cfg.rollout.engine,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        # the offload switches (actor/ref/prm.offload); absent: off
        actor_offload=bool(getattr(cfg.actor, "offload", False)),
        ref_offload=bool(getattr(getattr(cfg, "ref", None), "offload", False)),
        prm_offload=bool(getattr(cfg.prm, "offload", False)),
        rollout_ranks=cfg.rollout.ranks if cfg.rollout.placement == "separate" else 0,
        grad_reduce_in_fp32=cfg.actor.optim.grad_reduce_in_fp32,
        rollout_tp=cfg.rollout.tp if cfg.rollout.placement == "separate" else 1,
        max_staleness=cfg.rollout.max_staleness,
    )

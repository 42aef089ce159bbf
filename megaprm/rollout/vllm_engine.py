"""vLLM offline engine, colocated with training on the same GPUs (verl's "hybrid engine" layout).

Supported: vLLM 0.33.x (the `gpu` extra pins `vllm>=0.33.0,<0.34`, which pins torch 2.14.0 and
transformers >=5.16.1,<5.21). Every rule below was read in the 0.33.0 wheel's source; none of it
has been run on a GPU (see docs/rollout.md). Nothing is imported from vLLM until an engine is
built, so this module imports on machines without it.

Placement. Every training rank builds one engine. When the job has more than one rank
(WORLD_SIZE > 1) the engine runs under the trainer's torchrun with
`distributed_executor_backend="external_launcher"` and the trainer's tp: vLLM then takes its
device from LOCAL_RANK (`v1/executor/uniproc_executor.py:186-197`) and lays ranks out as
ExternalDP x DP x PP x PCP x TP (`distributed/parallel_state.py:2149-2162`), so its tp groups are
the trainer's contiguous tp groups and each of them is an independent engine. Without it, the
single-process executor puts every rank on local rank 0 (`uniproc_executor.py:77-88`). All ranks
pass the same engine seed (so the ranks of one tp group sample alike); the per-request seeds
carry the rollout's randomness. Building the engine leaves the caller's RNG states and current
CUDA device as they were (`engine.preserved_rng_and_device`). A separate placement's rollout
ranks build it the same way over their own default group, with tensor_parallel_size =
rollout.tp (rollout/remote.py, "Engines"); that path has not run with vLLM either.

Lifecycle (engine.RolloutEngine): generate -> sleep(level) -> ... -> update_weights(stream):
wake_up(tags=["weights"]) -> model.load_weights(stream) -> reset_prefix_cache() ->
wake_up(tags=["kv_cache"]). Why this order, from vLLM's source:
* Sleep unmaps every weights / kv_cache allocation (`device_allocator/cumem.py:233-290`): level 1
  keeps a host copy of the weights, level 2 keeps none (only the model's buffers,
  `v1/worker/gpu_worker.py:301-316`). Loading while the weights are asleep writes into unmapped
  memory; at level 1 the later wake then copies the stale host copy over whatever was loaded
  (`cumem.py:331-362`). So the weights are woken first, alone.
* The KV cache is woken last, after the new weights are in, so the weights' load never competes
  with the KV cache for memory; the prefix cache is reset in between because cached blocks hold
  keys/values of the old weights (0.33 also clears it at sleep, `v1/engine/core.py:1007`).
* The scheduler resumes only when every tag is awake (`core.py:1031-1057`), so generate() needs
  the KV cache woken too.

Weights go in through the in-process model (`llm.llm_engine.model_executor.driver_worker.worker
.model_runner.get_model().load_weights(weights=...)`, which fuses q/k/v and gate/up and keeps its
own tp shard), the path verl uses. It needs the engine core in this process:
VLLM_ENABLE_V1_MULTIPROCESSING=0 (`v1/engine/llm_engine.py:136-138`; external_launcher forces it,
`config/parallel.py:1050-1052`). 0.33's weight-transfer API (`init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update`) exists on `AsyncLLM` and the
worker only (`v1/engine/async_llm.py:1396-1432`), not on the offline `LLM` used here.

Log-probs: `logprobs_mode="processed_logprobs"` returns the log-prob after temperature and top-p,
i.e. the distribution vLLM sampled from (`v1/sample/sampler.py:326-334`), which is
`RolloutBatch.sampler_logprobs`' meaning. `skip_tokenizer_init=True`: prompts are token ids, and
the engine's EOS ids are passed as stop ids, so vLLM needs no tokenizer files.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megaprm.rollout.engine import (
    EngineAsleepError,
    RolloutBatch,
    SamplingParams,
    finish_reason,
    left_pad,
    preserved_rng_and_device,
)

INSTALL_HINT = ("the vLLM engine needs vLLM and a CUDA GPU: install the `gpu` extra with "
                "`pip install -e .[gpu]` (see README, GPU install), or use rollout.engine=hf")
MULTIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLEEP_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class VLLMEngineConfig:
    """tensor_parallel_size: vLLM tp (colocated: the trainer's tp, under the same torchrun);
    external_launcher: run under the caller's torchrun (`distributed_executor_backend=
    "external_launcher"`; required when WORLD_SIZE > 1, see the module docstring);
    gpu_memory_utilization: fraction of the GPU vLLM may take for weights + KV cache while awake;
    sleep_level: 1 offloads the weights to host memory and drops the KV cache, 2 drops both (each
    update must then bring every weight: `update_weights(strict=False)` is refused);
    seed: the engine seed, the same on every rank; eos_token_ids: always stop generation
    (passed as stop ids, since the engine runs without a tokenizer)."""

    tensor_parallel_size: int = 1
    external_launcher: bool = False
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    load_format: str = "auto"  # "dummy": random weights, the first update_weights brings them

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"VLLMEngineConfig.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "must be an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.sleep_level not in (1, 2):
            bad("sleep_level", "must be 1 (offload weights to host) or 2 (drop them)")
        if self.tensor_parallel_size > 1 and not self.external_launcher:
            bad("external_launcher", "must be True when tensor_parallel_size > 1 (colocated tp "
                "runs under the trainer's torchrun)")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def _multiproc_error() -> RuntimeError:
    return RuntimeError(
        f"vLLM engine: {MULTIPROC_ENV}={os.environ.get(MULTIPROC_ENV)!r} puts vLLM's engine core "
        f"in another process, where weights cannot be loaded; set {MULTIPROC_ENV}=0 (or unset it)")


class VLLMEngine:
    """RolloutEngine over `vllm.LLM` (see the module docstring for placement and lifecycle)."""

    def __init__(self, model_dir: str, cfg: VLLMEngineConfig = VLLMEngineConfig()):
        vllm = _import_vllm()
        if os.environ.get(MULTIPROC_ENV, "0") != "0":
            raise _multiproc_error()
        os.environ[MULTIPROC_ENV] = "0"
        kwargs = {"model": model_dir, "tensor_parallel_size": cfg.tensor_parallel_size,
                  "gpu_memory_utilization": cfg.gpu_memory_utilization,
                  "enable_sleep_mode": True, "dtype": cfg.dtype,
                  "enforce_eager": cfg.enforce_eager, "seed": cfg.seed,
                  "logprobs_mode": "processed_logprobs", "skip_tokenizer_init": True,
                  "load_format": cfg.load_format}
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.external_launcher:
            missing = [k for k in LAUNCHER_ENV if k not in os.environ]
            if missing:
                raise RuntimeError(f"vLLM engine with external_launcher needs the torchrun "
                                   f"environment; {missing} not set: start under torchrun")
            world = int(os.environ["WORLD_SIZE"])
            if world % cfg.tensor_parallel_size:
                raise ValueError(f"vLLM engine: WORLD_SIZE={world} is not a multiple of "
                                 f"tensor_parallel_size={cfg.tensor_parallel_size}")
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.cfg = cfg
        with preserved_rng_and_device():
            self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.pad_token_id = cfg.pad_token_id
        self._sleeping: set[str] = set()  # the tags asleep: {} or a subset of SLEEP_TAGS
        self._model()  # fail now, with the setting's name, if the worker is out of process

    @classmethod
    def from_pretrained(cls, model_dir: str,
                        cfg: VLLMEngineConfig = VLLMEngineConfig()) -> VLLMEngine:
        """Same as the constructor (the HFEngine spelling)."""
        return cls(model_dir, cfg)

    def _model(self):
        """The in-process model (vLLM's nn.Module, unwrapped from any CUDA-graph wrapper)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:  # multiprocess mode: no executor in this process
            raise _multiproc_error()
        runner = executor.driver_worker.worker.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    # ------------------------------------------------------------------------------ lifecycle

    @property
    def asleep(self) -> bool:
        return bool(self._sleeping)

    def sleep(self) -> None:
        """After a rollout: free the weights (offloaded at level 1, dropped at level 2) and the
        KV cache. A second call is a no-op (vLLM's executor would only warn)."""
        if not self._sleeping:
            self.llm.sleep(level=self.cfg.sleep_level)
            self._sleeping = set(SLEEP_TAGS)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                       strict: bool = True, wake_kv_cache: bool = True) -> int:
        """Before a rollout: wake weights -> load -> reset prefix cache -> wake KV cache
        (`wake_kv_cache=False`: left asleep, for `wake()` once the trainer's state is offloaded,
        trainer/lifecycle.py)."""
        if not strict and self.cfg.sleep_level == 2 and "weights" in self._sleeping:
            raise ValueError("update_weights(strict=False) after a level-2 sleep: the weights "
                             "were dropped, so a partial stream leaves garbage; send every "
                             "weight or use sleep_level=1")
        if "weights" in self._sleeping:
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        count = self._load(weights, strict)
        self.llm.reset_prefix_cache()
        if wake_kv_cache and "kv_cache" in self._sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self._sleeping.discard("kv_cache")
        return count

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = True) -> int:
        """Awake engine only: load the stream, then reset the prefix cache."""
        count = self._load(weights, strict)
        self.llm.reset_prefix_cache()
        return count

    def wake(self) -> None:
        """Wake everything asleep without loading: the KV cache after
        `update_weights(wake_kv_cache=False)`, or all of it (evaluation). After a level-2 sleep
        the weights are gone, so this raises: use update_weights."""
        if not self._sleeping:
            return
        if self.cfg.sleep_level == 2 and "weights" in self._sleeping:
            raise EngineAsleepError("VLLMEngine.wake() after a level-2 sleep: the weights were "
                                    "dropped; call update_weights() with the full stream")
        self.llm.wake_up(tags=[t for t in SLEEP_TAGS if t in self._sleeping])
        self._sleeping.clear()

    @torch.no_grad()
    def _load(self, weights, strict: bool) -> int:
        """vLLM's `load_weights` returns the names of the parameters it loaded; with strict=True
        any vLLM parameter left out raises (after a level-2 sleep it would hold garbage)."""
        if "weights" in self._sleeping:
            raise EngineAsleepError(
                "VLLMEngine.load_weights() while asleep: the weights are unmapped; call "
                "update_weights(), which wakes them (tags=['weights']) before loading")
        count = 0

        def counted():
            nonlocal count
            for name, t in weights:
                count += 1
                yield name, t

        model = self._model()
        loaded = set(model.load_weights(weights=counted()) or ())
        if strict:
            missing = sorted({n for n, _ in model.named_parameters()} - loaded)
            if missing:
                raise ValueError(f"load_weights(strict=True): vLLM parameters not loaded: "
                                 f"{missing[:10]}; pass strict=False for a partial update")
        return count

    # ------------------------------------------------------------------------------ sampling

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """One vLLM request per sample (row r seeded with seed + r, as in the HF engine)."""
        if self._sleeping:
            raise EngineAsleepError(f"VLLMEngine.generate() while {sorted(self._sleeping)} "
                                    "sleep: call update_weights() (or wake()) first")
        ids, mask = left_pad(prompts, self.pad_token_id, params.n)
        b = ids.shape[0]
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 31, ()))
        stops = sorted(set(params.stop_token_ids) | set(self.cfg.eos_token_ids))
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(params.n)]
        sps = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            stop_token_ids=stops, seed=seed + r, logprobs=0) for r in range(b)]
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        toks, lps, finish = [], [], []
        for o in outs:
            c = o.outputs[0]
            toks.append(list(c.token_ids))
            # logprobs[t] maps token id -> Logprob; the sampled token is always present
            lps.append([step[tid].logprob for tid, step in zip(c.token_ids, c.logprobs)])
            finish.append(finish_reason(c.token_ids, stops))
        width = max(len(t) for t in toks)
        resp = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        resp_lp = torch.zeros((b, width), dtype=torch.float32)
        resp_mask = torch.zeros((b, width), dtype=torch.long)
        for r, (t, lp) in enumerate(zip(toks, lps)):
            resp[r, :len(t)] = torch.tensor(t, dtype=torch.long)
            resp_lp[r, :len(t)] = torch.tensor(lp, dtype=torch.float32)
            resp_mask[r, :len(t)] = 1
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=resp,
                            response_mask=resp_mask, sampler_logprobs=resp_lp,
                            finish_reason=finish, group_index=torch.arange(b) // params.n,
                            pad_token_id=self.pad_token_id)

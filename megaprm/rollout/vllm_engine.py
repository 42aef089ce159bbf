"""vLLM offline engine, colocated with training on the same GPUs (verl's "hybrid engine" layout).

Version assumption: vLLM >= 0.10.2 (the V1 engine), for `LLM(logprobs_mode=...)`,
`LLM.sleep(level)` / `LLM.wake_up(tags)`, `LLM.collective_rpc` and per-request seeds. Nothing is
imported from vLLM until an engine is built, so this module imports on machines without it.

Colocation: every training rank builds one engine. With tensor_parallel_size > 1 the engine runs
under the training job's torchrun (`distributed_executor_backend="external_launcher"`): each
training process is one vLLM tp rank, and since `parallel.weight_sync` delivers the full model on
every rank, each rank hands the full stream to its own worker, whose `load_weights` keeps its
shard (vLLM's own contract: `model.load_weights(weights=iterable of (hf_name, tensor))`).
`VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the worker in this process, so the model is reached
directly (`llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`); when it is
not reachable, the stream goes through `collective_rpc` in per-bucket lists.

Log-probs: `logprobs_mode="processed_logprobs"` makes vLLM return the log-prob after temperature
and top-p, i.e. the distribution it sampled from, which is `RolloutBatch.sampler_logprobs`' meaning.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megaprm.rollout.engine import RolloutBatch, SamplingParams, left_pad

RPC_CHUNK_BYTES = 256 << 20
INSTALL_HINT = ("the vLLM engine needs vLLM and a CUDA GPU: install the `gpu` extra with "
                "`pip install -e .[gpu]`, or use rollout.engine=hf (megaprm.rollout.hf_engine)")


@dataclass(frozen=True)
class VLLMEngineConfig:
    """tensor_parallel_size: vLLM tp (colocated: = the training tp, under the same torchrun);
    gpu_memory_utilization: fraction of the GPU vLLM may take for weights + KV cache while awake;
    sleep_level: 1 offloads weights to host memory and drops the KV cache, 2 drops both (the next
    weight sync must then restore every weight)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    enable_sleep_mode: bool = True
    sleep_level: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    pad_token_id: int = 0

    def __post_init__(self):
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngineConfig.tensor_parallel_size={self.tensor_parallel_size!r}:"
                             " must be an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMEngineConfig.gpu_memory_utilization="
                             f"{self.gpu_memory_utilization!r}: must be in (0, 1]")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngineConfig.sleep_level={self.sleep_level!r}: must be 1 or 2")


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    if not torch.cuda.is_available():
        raise ImportError(f"{INSTALL_HINT} (vLLM is installed but CUDA is not available)")
    return vllm


def _load_on_worker(worker, weights):
    """Run inside a vLLM worker by collective_rpc: push one list of (name, tensor) pairs."""
    return worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine:
    """RolloutEngine over `vllm.LLM` (see the module docstring for the colocation contract)."""

    def __init__(self, model_dir: str, cfg: VLLMEngineConfig = VLLMEngineConfig()):
        vllm = _import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process
        self.cfg = cfg
        kwargs = {"model": model_dir, "tensor_parallel_size": cfg.tensor_parallel_size,
                  "gpu_memory_utilization": cfg.gpu_memory_utilization,
                  "enable_sleep_mode": cfg.enable_sleep_mode, "dtype": cfg.dtype,
                  "enforce_eager": cfg.enforce_eager, "seed": cfg.seed,
                  "logprobs_mode": "processed_logprobs"}
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.pad_token_id = cfg.pad_token_id
        self._asleep = False

    @classmethod
    def from_pretrained(cls, model_dir: str,
                        cfg: VLLMEngineConfig = VLLMEngineConfig()) -> VLLMEngine:
        """Same as the constructor (the HFEngine spelling)."""
        return cls(model_dir, cfg)

    def _model(self):
        """The in-process nn.Module, or None when the worker lives in another process."""
        try:
            executor = self.llm.llm_engine.model_executor
            worker = executor.driver_worker
            worker = getattr(worker, "worker", worker)
            return worker.model_runner.model
        except AttributeError:
            return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = True) -> int:
        """Stream (hf_name, tensor) pairs into vLLM's `load_weights` (which fuses q/k/v and
        gate/up and shards for its tp itself), then drop the prefix cache: cached KV blocks were
        computed with the old weights. With strict=True, vLLM parameters left unloaded raise
        (vLLM >= 0.10 returns the set it loaded)."""
        if self._asleep and self.cfg.sleep_level == 2:
            self.llm.wake_up(tags=["weights"])
        count = 0

        def counted():
            nonlocal count
            for name, t in weights:
                count += 1
                yield name, t

        model = self._model()
        if model is not None:
            loaded = model.load_weights(weights=counted())
            names = {n for n, _ in model.named_parameters()}
        else:  # out-of-process worker: ship bounded lists (one bucket's worth at a time)
            loaded, names = set(), None
            chunk, size = [], 0
            for name, t in counted():
                chunk.append((name, t))
                size += t.numel() * t.element_size()
                if size >= RPC_CHUNK_BYTES:
                    for result in self.llm.collective_rpc(_load_on_worker, args=(chunk,)):
                        loaded |= set(result or ())
                    chunk, size = [], 0
            for result in self.llm.collective_rpc(_load_on_worker, args=(chunk,)) if chunk else ():
                loaded |= set(result or ())
        if strict and loaded is not None and names is not None:
            missing = sorted(names - set(loaded))
            if missing:
                raise ValueError(f"load_weights(strict=True): vLLM parameters not loaded: "
                                 f"{missing[:10]}; pass strict=False for a partial update")
        self.llm.reset_prefix_cache()
        return count

    def sleep(self) -> None:
        if self.cfg.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """One vLLM request per sample (row r seeded with seed + r, as in the HF engine)."""
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake() first")
        ids, mask = left_pad(prompts, self.pad_token_id, params.n)
        b = ids.shape[0]
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 31, ()))
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(params.n)]
        sps = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids), seed=seed + r, logprobs=0)
            for r in range(b)]
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        toks, lps, finish = [], [], []
        for o in outs:
            c = o.outputs[0]
            toks.append(list(c.token_ids))
            # logprobs[t] maps token id -> Logprob; the sampled token is always present
            lps.append([step[tid].logprob for tid, step in zip(c.token_ids, c.logprobs)])
            finish.append("length" if c.finish_reason == "length" else "stop")
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

"""A recording stand-in for `vllm.LLM` on CPU: vLLM's sleep / wake / load / placement rules as its
source defines them, with a real transformers model doing the arithmetic.

Every rule cites the file of the vLLM 0.33.0 wheel it mirrors (paths under `vllm/`); where 0.10.2
differs and it matters, that is cited too. `install()` puts a module named `vllm` into
`sys.modules` (in the calling process only; spawned ranks must call it themselves).

What is modelled: the executor's sleeping tags, the cuMem allocator's mapped / offloaded state per
tag (weights, kv_cache), what level-1 / level-2 sleep keeps, the scheduler pause, the prefix cache,
placement (external_launcher vs the single-process executor; under external_launcher the
default process group, when one exists, is vLLM's world), multiprocess mode, reseeding of the
global RNGs at build time, and the sampler's processed log-probs. What is not: real memory, CUDA
graphs, tp sharding (every rank holds the full model), the scheduler's batching.
"""
from __future__ import annotations

import os
import random
import sys
import types
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist

VERSION = "0.33.0"
# Every LLM(...) keyword megaprm passes must exist in 0.33.0: `entrypoints/llm.py:180-230` names
# the first ones, the rest are EngineArgs fields (`engine/arg_utils.py:503,519,520,531,627,799`).
LLM_KWARGS = {"model", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode",
              "dtype", "enforce_eager", "seed", "logprobs_mode", "skip_tokenizer_init",
              "max_model_len", "distributed_executor_backend",
              "load_format"}  # EngineArgs.load_format (LoadConfig: "auto" | "dummy" | ...)


class IllegalMemoryAccess(RuntimeError):
    """What a write into an unmapped cuMem allocation becomes on a GPU (a CUDA error)."""


@dataclass
class SamplingParams:
    """The fields megaprm sets (`sampling_params.py:285-342`)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclass
class Allocator:
    """`device_allocator/cumem.py` CuMemAllocator, one allocation per tag."""

    mapped: dict = field(default_factory=lambda: {"weights": True, "kv_cache": True})
    backup: dict = field(default_factory=dict)  # tag -> host copy kept by sleep

    def sleep(self, offload_tags, model):
        # cumem.py:233-290: allocations whose tag is in offload_tags are copied to host memory,
        # every allocation is unmapped; an already-asleep allocation keeps its policy.
        for tag in ("weights", "kv_cache"):
            if not self.mapped[tag]:
                continue
            if tag in offload_tags and tag == "weights":
                self.backup[tag] = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.mapped[tag] = False

    def wake_up(self, tags, model):
        # cumem.py:331-362 (0.33.0): only asleep allocations are remapped (0.10.2 `cumem.py:217-
        # 238` remapped every allocation of the tag, awake or not); an offloaded one gets its
        # host copy back, any other gets fresh memory whose bytes are arbitrary (NaN here).
        for tag in ("weights", "kv_cache"):
            if self.mapped[tag] or not (tags is None or tag in tags):
                continue
            self.mapped[tag] = True
            if tag == "weights":
                saved = self.backup.pop(tag, None)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(saved[n]) if saved is not None else p.fill_(float("nan"))


class Model:
    """The worker's nn.Module as `load_weights` sees it (HF names here; vLLM maps them to its own
    fused parameters inside `load_weights`, e.g. `model_executor/models/qwen2.py:453-519`)."""

    def __init__(self, hf_model, allocator: Allocator, log: list):
        self.hf, self.alloc, self.log = hf_model, allocator, log
        self.version = 0  # bumped by every load: the prefix cache remembers it

    def named_parameters(self):
        return self.hf.named_parameters()

    def named_buffers(self):
        return self.hf.named_buffers()

    @torch.no_grad()
    def load_weights(self, weights):
        """Returns the set of parameter names loaded (`qwen2.py:519-521`, AutoWeightsLoader); an
        unknown name is a ValueError (`models/utils.py:442-448`). A tied head is the embedding's
        parameter (`qwen2.py:486-487`): an incoming `lm_head.weight` writes the embedding."""
        params = dict(self.hf.named_parameters())
        tied = "lm_head.weight" not in params
        loaded = set()
        names = []
        for name, t in weights:
            if not self.alloc.mapped["weights"]:
                # the parameters' storage is unmapped (cumem.py:278 unmap_and_release)
                raise IllegalMemoryAccess(f"load_weights({name!r}) while the weights sleep: "
                                          "CUDA error: an illegal memory access was encountered")
            if tied and name == "lm_head.weight":
                name = "model.embed_tokens.weight"
            if name not in params:
                raise ValueError(f"There is no module or parameter named {name!r}")
            params[name].copy_(t.to(params[name].dtype))
            loaded.add(name)
            names.append(name)
        self.version += 1
        self.log.append(("load_weights", len(names)))
        return loaded


class Worker:
    def __init__(self, model):
        self.model_runner = types.SimpleNamespace(model=model, get_model=lambda: model)


class Executor:
    """`v1/executor/abstract.py:397-435` (sleep / wake_up / sleeping_tags) over the worker's
    `v1/worker/gpu_worker.py:301-353` (what each level keeps) and the cuMem allocator."""

    def __init__(self, model: Model, log: list, warnings: list):
        self.model, self.log, self.warnings = model, log, warnings
        self.alloc = model.alloc
        self.driver_worker = types.SimpleNamespace(worker=Worker(model))
        self.sleeping_tags: set[str] = set()
        self.saved_buffers: dict = {}

    def sleep(self, level):
        if "weights" in self.sleeping_tags:  # abstract.py:400-403
            self.warnings.append("Executor is already sleeping.")
            return
        if level == 2:  # gpu_worker.py:305-316: level 2 keeps the buffers on the host
            self.saved_buffers = {n: b.clone() for n, b in self.model.named_buffers()}
        # sleep_mode_backend.py:127-137: level 1 offloads "weights", level 2 offloads nothing
        self.alloc.sleep(("weights",) if level == 1 else (), self.model.hf)
        self.sleeping_tags |= {"weights", "kv_cache"}  # abstract.py:407, SLEEP_TAGS :36

    def wake_up(self, tags):
        if not self.sleeping_tags:  # abstract.py:413-415
            self.warnings.append("Executor is not sleeping.")
            return
        for tag in tags or ():  # abstract.py:416-423: an awake tag aborts the whole call
            if tag not in self.sleeping_tags:
                self.warnings.append(f"Tag {tag} is not in sleeping tags {self.sleeping_tags}")
                return
        self.alloc.wake_up(tags, self.model.hf)
        if (tags is None or "weights" in tags) and self.saved_buffers:  # gpu_worker.py:347-353
            with torch.no_grad():
                for n, b in self.model.named_buffers():
                    b.copy_(self.saved_buffers[n])
            self.saved_buffers = {}
        if tags:  # abstract.py:431-435
            self.sleeping_tags -= set(tags)
        else:
            self.sleeping_tags.clear()


class LLMEngine:
    def __init__(self, executor: Executor | None):
        if executor is not None:  # llm_engine.py:136-138: only in-process mode exposes it
            self.model_executor = executor


class LLM:
    """`vllm.LLM` (0.33.0 `entrypoints/llm.py`). `log` records every call, in order."""

    finish_rule = VERSION  # "0.10.2" to check the length cap before EOS (see _finish)
    instances: ClassVar[list] = []  # every LLM built in this process (the tests read them)

    def __init__(self, **kwargs):
        unknown = set(kwargs) - LLM_KWARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = kwargs
        self.log: list = [("LLM", dict(kwargs))]
        self.warnings: list = []
        tp = kwargs.get("tensor_parallel_size", 1)
        backend = kwargs.get("distributed_executor_backend")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if backend == "external_launcher":
            # config/parallel.py:1050-1052 forces in-process mode; uniproc_executor.py:180-183
            # asserts it; :186-197 reads RANK / LOCAL_RANK and uses env:// (MASTER_ADDR/PORT)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                if k not in os.environ:
                    raise KeyError(k)
            self.local_rank = int(os.environ["LOCAL_RANK"])
            rank = int(os.environ["RANK"])
            if dist.is_initialized():
                # parallel_state.py `init_distributed_environment`: an initialized default group
                # is vLLM's world as it is; its groups are laid out over that group's ranks
                # while the worker is told RANK (`uniproc_executor.py` `_distributed_args`): the
                # stand-in asks that the two agree (these rules read in vLLM's GitHub source,
                # functions named, not in the 0.33.0 wheel)
                world = dist.get_world_size()
                if dist.get_rank() != rank:
                    raise RuntimeError(f"RANK={rank} but this process is rank "
                                       f"{dist.get_rank()} of the default group ({world})")
                # `ExecutorWithExternalLauncher.determine_available_memory`: a MIN all-reduce
                # over the world group, so every rank of that world builds its engine together
                dist.all_reduce(torch.zeros(1, dtype=torch.int64), op=dist.ReduceOp.MIN)
            # parallel_state.py:2149-2162: ranks reshape(-1, dp, pp, pcp, tp)
            if world % tp:
                raise RuntimeError(f"world size {world} is not divisible by tp {tp}")
            self.world, self.in_default_group = world, dist.is_initialized()
            self.tp_group = [rank // tp * tp + i for i in range(tp)]
        else:
            if tp > 1:  # parallel.py:1054-1062: tp > 1 in one process starts "mp" workers
                raise NotImplementedError("the stand-in models tp > 1 only under "
                                          "external_launcher (megaprm's colocated layout)")
            # uniproc_executor.py:77-88: the device index of device_config, i.e. local rank 0,
            # whatever the torchrun rank: every rank lands on GPU 0, as in vLLM
            self.local_rank = 0
            self.tp_group = [int(os.environ.get("RANK", "0"))]
        # envs.py:1444-1446: multiprocessing is on unless VLLM_ENABLE_V1_MULTIPROCESSING=0
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        if torch.cuda.is_available():  # gpu_worker.py:496
            torch.cuda.set_device(self.local_rank)
        seed = kwargs.get("seed", 0)
        _set_random_seed(seed)  # gpu_worker.py:517 (init_device)
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(kwargs["model"], dtype=torch.float32).eval()
        torch.rand(3)  # profiling / warm-up draws from the global generator
        _set_random_seed(seed)  # gpu_worker.py:1094 (compile_or_warm_up_model)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.model = Model(hf, Allocator(), self.log)
        self.executor = Executor(self.model, self.log, self.warnings)
        self.llm_engine = LLMEngine(self.executor if in_process else None)
        self.paused = False
        self.prefix_cache: dict[tuple, int] = {}  # prompt -> weights version of its KV blocks
        self.stale_prefix_hits = 0
        LLM.instances.append(self)

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1, mode: str = "abort"):
        self.log.append(("sleep", level))
        # without enable_sleep_mode nothing is allocated from the cuMem pool
        # (`config/model.py:666-672`), so sleep frees nothing: refuse it here
        if not self.sleep_mode:
            raise RuntimeError("stand-in: sleep() needs LLM(enable_sleep_mode=True)")
        # core.py:1006-1010: pause the scheduler and, at level >= 1, clear the prefix cache
        self.paused = True
        self.prefix_cache.clear()
        self.executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.log.append(("wake_up", None if tags is None else list(tags)))
        self.executor.wake_up(tags)
        fully_awake = not self.executor.sleeping_tags
        if fully_awake:  # core.py:1052-1057: scheduling resumes only when all tags are awake
            self.paused = False
        return fully_awake

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        self.log.append(("reset_prefix_cache",))
        self.prefix_cache.clear()
        return True

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        self.log.append(("generate", len(prompts)))
        if self.paused:  # the requests would wait in the paused scheduler forever
            raise RuntimeError("generate() on a sleeping LLM would hang (scheduler paused)")
        if not all(self.model.alloc.mapped.values()):
            raise IllegalMemoryAccess("forward pass over unmapped weights / KV cache")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            ids = list(prompt["prompt_token_ids"])
            key = tuple(ids)
            if key in self.prefix_cache and self.prefix_cache[key] != self.model.version:
                self.stale_prefix_hits += 1  # vLLM would reuse KV blocks of the old weights
            self.prefix_cache[key] = self.model.version
            outs.append(RequestOutput(ids, [self._sample(ids, sp)]))
        return outs

    def _sample(self, prompt: list[int], sp: SamplingParams) -> CompletionOutput:
        """Full-recompute decode. Random sampling is the exponential race of
        `v1/sample/ops/topk_topp_sampler.py` (probs / Exp(1) noise, argmax) with a per-request
        generator; the log-prob is `processed_logprobs` (`v1/sample/sampler.py:326-334`): after
        temperature and the top-p mask; greedy requests get the untempered log-softmax."""
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        stops = set(sp.stop_token_ids or ())
        ids, out, lps, reason = list(prompt), [], [], "length"
        for _ in range(sp.max_tokens):
            logits = self.model.hf(torch.tensor([ids])).logits[0, -1].float()
            if sp.temperature == 0:
                logp = torch.log_softmax(logits, -1)
                tok = int(logits.argmax())
            else:
                logp = torch.log_softmax(logits / sp.temperature, -1)
                if sp.top_p < 1:
                    sorted_lp, order = logp.sort(descending=True)
                    p = sorted_lp.exp()
                    drop = (p.cumsum(0) - p) >= sp.top_p
                    logp = logp.clone()
                    logp[order[drop]] = float("-inf")
                    logp = torch.log_softmax(logp, -1)
                q = torch.empty_like(logp).exponential_(generator=gen)
                tok = int((logp.exp() / q).argmax())
            out.append(tok)
            lps.append({tok: Logprob(float(logp[tok]), rank=1)})
            ids.append(tok)
            reason = self._finish(tok, stops, len(out), sp.max_tokens)
            if reason is not None:
                break
        return CompletionOutput(0, out, lps, reason or "length")

    @classmethod
    def _finish(cls, tok, stops, n_out, max_tokens):
        """0.33.0 `v1/core/sched/utils.py:104-119`: stop ids before the length cap; 0.10.2
        `utils.py:46-68`: the length cap first (an EOS as the last allowed token is "length")."""
        capped = n_out >= max_tokens
        if cls.finish_rule == "0.10.2" and capped:
            return "length"
        if tok in stops:
            return "stop"
        return "length" if capped else None


def _set_random_seed(seed):
    """`utils/torch_utils.py:528-539`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def module() -> types.ModuleType:
    """A module object `vllm` holding the stand-in (put it into sys.modules yourself)."""
    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams, mod.__version__ = LLM, SamplingParams, VERSION
    return mod


def install() -> types.ModuleType:
    """Make `import vllm` return this stand-in in the current process (spawned ranks)."""
    sys.modules["vllm"] = mod = module()
    return mod


def call_names(log) -> list:
    """A stand-in's call log without the constructor, wake tags / sleep level in the name."""
    out = []
    for entry in log[1:]:
        name = entry[0]
        if name == "wake_up":
            name += ":" + ",".join(entry[1] or ["all"])
        elif name == "sleep":
            name += f":{entry[1]}"
        out.append(name)
    return out

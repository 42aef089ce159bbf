"""The root config: a tree of typed dataclasses, loaded from YAML with dotted CLI overrides.

Each component's dataclass lives beside the component (advantage estimators in
`algorithms.registry`, the arithmetic task in `tasks.arithmetic`, optimiser in
`parallel.optimizer`, sampling and the engine in `rollout.config`); this module composes them. Unknown keys and bad values raise
`ConfigError` (megaprm/errors.py) naming the dotted field, the value and what would be valid.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from megaprm.algorithms.registry import AdvantageConfig
from megaprm.errors import ConfigError, check_value
from megaprm.parallel.device import DTYPE_CHOICES, resolve_dtype_name
from megaprm.parallel.optimizer import OptimConfig
from megaprm.rewards.judge import JudgeConfig
from megaprm.rollout.config import RolloutConfig
from megaprm.tasks.arithmetic import ArithmeticConfig


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism of an MoE policy: its experts split over ep data-parallel ranks

    def __post_init__(self):
        for k in ("tp", "pp", "ep"):
            v = getattr(self, k)
            check_value(isinstance(v, int) and v >= 1, f"parallel.{k}", v, "a positive integer")


@dataclass
class ModelConfig:
    """`path`: an HF directory (config.json + safetensors). The demo writes its own."""

    path: Optional[str] = None
    dtype: str = "auto"          # auto: bf16 on CUDA, fp32 on the CPU (resolved here); fp32 | bf16
    impl: Optional[str] = None   # layer spec te | sdpa | local; None: TE if it imports, else sdpa
    compile: bool = False        # torch.compile the layers (docs/actor.md)
    recompute: bool = False      # Megatron's full activation recompute, one layer at a time
    # MoE policies: Megatron's router losses added to the update, each off at 0 (RL recipes
    # train without them); aux = the switch load-balancing loss (HF's router_aux_loss_coef
    # uses it in pretraining), z = the router z-loss (Qwen's MoE models were not trained with one)
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0

    def __post_init__(self):
        check_value(self.dtype in DTYPE_CHOICES, "model.dtype", self.dtype,
               "auto (bf16 on CUDA, fp32 on the CPU), fp32 or bf16")
        # resolved once, where the run starts: the run dir's config.yaml and the checkpoints
        # name the dtype the models were built in
        self.dtype = resolve_dtype_name(self.dtype)
        check_value(self.impl in (None, "te", "sdpa", "local"), "model.impl", self.impl,
               "te, sdpa, local or null (automatic)")
        for k in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            v = getattr(self, k)
            check_value(isinstance(v, (int, float)) and v >= 0, f"model.{k}", v, "a number >= 0")


PROMPT_FORMATS = ("raw", "chat", "first_message")


@dataclass
class DataConfig:
    """`task`: arithmetic (embedded, exact step checker) or math (a jsonl/parquet prompt file,
    graded with math-verify). `prompts_per_step` is the global prompt batch over all dp ranks."""

    task: str = "arithmetic"
    path: Optional[str] = None
    eval_path: Optional[str] = None  # held-out prompts for trainer.eval_every (task=math)
    prompts_per_step: int = 16
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    on_bad_row: str = "skip"            # skip (counted, reported) | error (names file + line)
    keep_unanswered: bool = False       # keep rows without an answer, reward 0 (PURE does)
    max_prompt_tokens: Optional[int] = None  # counted on the rendered prompt's token ids
    long_prompt: str = "error"          # over max_prompt_tokens: truncate | drop | error
    # the text the policy is given (tasks.datasets.policy_prompt, docs/estimators.md): the
    # question through prompt_template into the user text, then raw (that text) | chat (the
    # tokenizer's chat template over [system_prompt, user], generation prompt added) |
    # first_message (that text: PAPO's pass-through template). A row carrying chat messages
    # must be that layout already (its question is read back), else it is a bad row
    prompt_format: str = "raw"
    prompt_template: str = "{question}"  # a plain question -> the user text
    system_prompt: Optional[str] = None  # chat: the system message (none: the row's own)

    def __post_init__(self):
        check_value(self.task in ("arithmetic", "math"), "data.task", self.task, "arithmetic or math")
        check_value(self.prompt_format in PROMPT_FORMATS, "data.prompt_format", self.prompt_format,
               "raw, chat or first_message")
        check_value(isinstance(self.prompt_template, str) and "{question}" in self.prompt_template,
               "data.prompt_template", self.prompt_template,
               "a string holding {question} (where the problem text goes)")
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError):
            check_value(False, "data.prompt_template", self.prompt_template,
                   "only the {question} field; write other braces doubled ({{ }})")
        check_value(self.system_prompt is None or self.prompt_format == "chat", "data.system_prompt",
               self.system_prompt, "a system message needs data.prompt_format=chat")
        check_value(self.on_bad_row in ("skip", "error"), "data.on_bad_row", self.on_bad_row,
               "skip or error")
        check_value(self.long_prompt in ("truncate", "drop", "error"), "data.long_prompt",
               self.long_prompt, "truncate, drop or error")
        check_value(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
               "data.max_prompt_tokens", self.max_prompt_tokens, "a positive token count")
        check_value(self.prompts_per_step >= 1, "data.prompts_per_step", self.prompts_per_step, ">= 1")
        if self.task == "math":
            check_value(self.path is not None, "data.path", self.path,
                   "data.task=math needs data.path (a .jsonl or verl-style .parquet file)")
        else:  # the embedded task reads no file: a file setting here would be silently ignored
            defaults = DataConfig.__dataclass_fields__
            ignored = [f"data.{k}={getattr(self, k)!r}" for k in _PROMPT_FILE_KEYS
                       if getattr(self, k) != defaults[k].default]
            if ignored:
                raise ConfigError(f"{', '.join(ignored)} would be ignored: data.task="
                                  f"{self.task!r} generates its prompts and reads no file; set "
                                  "data.task=math to train on a prompt file, or drop the key(s)")


# the DataConfig keys that only a prompt file (data.task=math) reads
_PROMPT_FILE_KEYS = ("path", "eval_path", "on_bad_row", "keep_unanswered", "max_prompt_tokens",
                     "long_prompt")


@dataclass
class ActorConfig:
    """PPO update. `mini_batches` optimiser steps per rollout; `loss_agg` per research §5.4."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, clip_grad=1.0))
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: Optional[float] = None
    loss_agg: str = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    mini_batches: int = 1
    micro_batch_size: int = 16
    # token budget per micro-batch (verl's ppo_max_token_len_per_gpu): sequences are packed into
    # rows of at most this many tokens instead of micro_batch_size padded rows; None: off
    max_tokens_per_micro_batch: Optional[int] = None
    # PURE's guard (released models/loss.py:81-84): a micro-batch whose mean PPO ratio exceeds
    # this contributes no gradient (loss x 0); None: off
    skip_ratio_above: Optional[float] = None
    # what that mean is: token (over the micro-batch's tokens) | sequence (the mean of its
    # sequences' token means, PURE's release with its 2-row micro-batches)
    skip_ratio_scope: str = "token"
    # shuffle each rank's rows before splitting them into mini-batches (old verl's actor, PRIME:
    # dataloader shuffle=True); seeded by trainer.seed, step and dp rank. False: in order
    shuffle_mini_batches: bool = False
    # the temperature of every log-prob the update uses (actor old/new, entropy, reference,
    # KL): "rollout" (rollout.temperature, as verl does) or a number (PURE: 1.0 while sampling
    # at 0.5, its actor's log-probs take no temperature)
    logprob_temperature: Any = "rollout"
    # parameters, grads and optimizer state to (pinned) host memory while the engine generates,
    # back after it sleeps (trainer/lifecycle.py, docs/lifecycle.md); bit-exact, costs two copies
    offload: bool = False

    def __post_init__(self):
        check_value(isinstance(self.offload, bool), "actor.offload", self.offload, "true or false")
        check_value(self.skip_ratio_scope in ("token", "sequence"), "actor.skip_ratio_scope",
               self.skip_ratio_scope, "token or sequence (PURE's release)")
        t = self.logprob_temperature
        check_value(t == "rollout" or (isinstance(t, (int, float)) and not isinstance(t, bool)
                                  and t > 0), "actor.logprob_temperature", t,
               "rollout (the sampling temperature) or a number > 0")
        check_value(self.loss_agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"),
               "actor.loss_agg", self.loss_agg, "token-mean, seq-mean-token-mean, "
               "seq-mean-token-sum or seq-mean-token-sum-norm (Dr.GRPO; divides by "
               "rollout.max_tokens)")
        check_value(self.kl_kind in ("k1", "k2", "k3", "low_var_kl"), "actor.kl_kind", self.kl_kind,
               "k1, k2, k3 or low_var_kl")
        check_value(self.mini_batches >= 1, "actor.mini_batches", self.mini_batches, ">= 1")
        check_value(self.micro_batch_size >= 1, "actor.micro_batch_size", self.micro_batch_size, ">= 1")
        check_value(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 2,
               "actor.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch,
               "a token budget >= the longest prompt + response, or null")
        check_value(self.eps_low >= 0 and self.eps_high >= 0, "actor.eps_low/eps_high",
               (self.eps_low, self.eps_high), ">= 0")


@dataclass
class PRMConfig:
    """`kind`: discriminative (a PRM directory, scores per step), implicit (PRIME: a causal LM
    initialised from the policy, updated online with outcome labels), oracle (the arithmetic
    task's exact step labels as scores 1/0: the best any PRM could do), judge (PAPO: a
    generative grader LLM at `path` grades correct responses against a reference solution,
    rewards/judge.py; its sampling in `judge`), or none."""

    kind: str = "discriminative"
    path: Optional[str] = None
    # how responses are fed to a discriminative PRM (rewards.scoring): auto | qwen25_math_prm |
    # pure | raw | megaprm; auto errors for a downloaded PRM it cannot identify
    input_format: str = "auto"
    beta: float = 0.05
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, clip_grad=10.0))
    low_score: float = 0.5  # a step is "low" (PRM says wrong) below this probability
    # PRIME's implicit PRM: optimiser steps per iteration on the accuracy-filtered rollouts
    # (released: 4 = 1024 responses / reward_model.mini_batch_size 256) and the update order
    # (after: each mini-batch scored inside the update, as released; none: never trained)
    mini_batches: int = 1
    update: str = "after"
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # prm.kind=judge: the grader's sampling
    # the discriminative PRM's forward: compact (rows compacted, right-padded, causal mask:
    # exact) | released (PROF-GRPO's prof_dp_rm.py: the batch left-padded to its longest row
    # and run with no attention mask, so real tokens attend to the padding)
    forward: str = "compact"
    # the PRM's parameters (implicit PRM: and grads and optimizer state) to host memory while
    # the engine generates (as actor.offload)
    offload: bool = False

    def __post_init__(self):
        check_value(isinstance(self.offload, bool), "prm.offload", self.offload, "true or false")
        check_value(self.kind in ("discriminative", "implicit", "oracle", "judge", "none"), "prm.kind",
               self.kind, "discriminative, implicit, oracle (exact step labels, arithmetic task), "
               "judge (a generative grader LLM at prm.path) or none")
        check_value(self.kind != "judge" or bool(self.path), "prm.path", self.path,
               "prm.kind=judge needs prm.path: the grader model's HF directory")
        check_value(isinstance(self.mini_batches, int) and self.mini_batches >= 1, "prm.mini_batches",
               self.mini_batches, "an integer >= 1")
        check_value(self.update in ("after", "none"), "prm.update", self.update,
               "after (released PRIME) or none")
        check_value(self.forward in ("compact", "released"), "prm.forward", self.forward,
               "compact (exact) or released (left-padded, no attention mask, as PROF-GRPO)")
        check_value(self.input_format in ("auto", "qwen25_math_prm", "pure", "raw", "megaprm"),
               "prm.input_format", self.input_format, "auto, qwen25_math_prm, pure, raw or megaprm")


@dataclass
class RefConfig:
    """The reference policy: a frozen copy of `model.path`, built when a KL term needs it
    (actor.kl_coef, advantage.pure.kl_coef) or PRIME's implicit PRM scores against it.
    `offload`: its parameters to host memory while the engine generates (as actor.offload)."""

    offload: bool = False

    def __post_init__(self):
        check_value(isinstance(self.offload, bool), "ref.offload", self.offload, "true or false")


VERIFIERS = ("math_verify", "prof_math_verify", "hendrycks_math", "prime_math", "verl_prime_math")


@dataclass
class RewardConfig:
    """The outcome verifier of data.task=math (rewards.verifiers, docs/estimators.md):
    math_verify (lenient: LaTeX/symbolic equivalence, the boxed answer first),
    prof_math_verify (PROF-GRPO's call of math-verify), hendrycks_math (PURE: the last
    \\boxed{} equals the answer as a string after the MATH normalisation), prime_math (PRIME:
    the released grader, rewards.prime_grader), verl_prime_math (PAPO: verl's copy of it).
    `llm_fallback` (PAPO's USE_LLM_VERIFIER): a response the rules call wrong is asked again
    of the prm.kind=judge grader, which may flip it to correct."""

    verifier: str = "math_verify"
    llm_fallback: bool = False

    def __post_init__(self):
        check_value(self.verifier in VERIFIERS, "reward.verifier", self.verifier,
               "math_verify, prof_math_verify, hendrycks_math, prime_math or verl_prime_math")


@dataclass
class TrainerConfig:
    """Run length, seed, run directory, checkpoints and logging.

    `save_every`: 0 = only at the end; `keep_last`: checkpoints kept (0 = all); `resume`: restart
    from `run_dir/checkpoints/latest` (refused when the method/model/data/rollout/update config
    differs, unless `allow_config_change`); `eval_every`: held-out greedy evaluation every N steps
    (0 = never) on `eval_problems` problems; `export_hf`: write the final policy as an HF
    directory `run_dir/hf`; `log_samples`: generations per step written to samples.jsonl."""

    steps: int = 20
    seed: int = 1234
    run_dir: str = "runs/default"
    save_every: int = 0
    keep_last: int = 0
    resume: bool = True
    resume_fallback: bool = True  # a damaged newest checkpoint: use the previous intact one
    # resume=false in a run_dir holding a run: refused, or with this moved to run_dir/replaced-*/
    replace_run: bool = False
    allow_config_change: bool = False
    eval_every: int = 0
    eval_problems: int = 64
    export_hf: bool = False
    log_samples: int = 4
    wandb: str = "offline"  # offline | online | disabled
    progress: bool = True

    def __post_init__(self):
        check_value(self.steps >= 0, "trainer.steps", self.steps, ">= 0")
        for k in ("save_every", "keep_last", "eval_every", "log_samples"):
            v = getattr(self, k)
            check_value(isinstance(v, int) and v >= 0, f"trainer.{k}", v, "an integer >= 0 (0 = off)")
        check_value(self.eval_problems >= 1, "trainer.eval_problems", self.eval_problems, ">= 1")
        check_value(self.wandb in ("offline", "online", "disabled"), "trainer.wandb", self.wandb,
               "offline, online or disabled")
        if self.replace_run and self.resume:  # it would resume the run it is meant to replace
            raise ConfigError("trainer.replace_run=true starts a new run (moving the earlier "
                              "one aside) but trainer.resume=true resumes it; set "
                              "trainer.resume=false with it")


@dataclass
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self):
        if self.reward.llm_fallback and self.prm.kind != "judge":
            raise ConfigError("reward.llm_fallback asks the grader LLM of prm.kind=judge; set "
                              f"prm.kind=judge or reward.llm_fallback=false (got prm.kind="
                              f"{self.prm.kind!r})")
        if self.reward.llm_fallback and self.data.task != "math":
            raise ConfigError("reward.llm_fallback re-grades math answers; data.task="
                              f"{self.data.task!r} is checked exactly. Set it to false")
        needs_steps = self.advantage.method in ("pure", "prof_grpo", "papo", "blend")
        if needs_steps and self.prm.kind not in ("discriminative", "oracle", "judge"):
            raise ConfigError(f"advantage.method={self.advantage.method!r} needs per-step scores: "
                              f"set prm.kind=discriminative, oracle or judge (got "
                              f"{self.prm.kind!r})")
        if self.prm.kind == "judge" and self.advantage.method == "pure":
            raise ConfigError("advantage.method=pure places step rewards on tokens; prm.kind=judge "
                              "gives one grade per response. Use prm.kind=discriminative")
        if self.prm.kind == "oracle" and self.data.task != "arithmetic":
            raise ConfigError("prm.kind=oracle scores steps with the exact checker of the "
                              f"arithmetic task; data.task={self.data.task!r} has none")
        if self.trainer.eval_every and self.data.task == "math" and not self.data.eval_path:
            raise ConfigError("trainer.eval_every needs data.eval_path (held-out prompts) for "
                              "data.task=math; set it or trainer.eval_every=0")
        if self.advantage.method == "prime" and self.prm.kind != "implicit":
            raise ConfigError("advantage.method='prime' needs prm.kind=implicit "
                              f"(got {self.prm.kind!r})")


# ----------------------------------------------------------------------------- (de)serialise

def _build(cls, data: Any, path: str):
    """dict -> dataclass `cls`, recursively; unknown keys name the path and the valid keys."""
    if not dataclasses.is_dataclass(cls):
        return data
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'{path}.{k}'.lstrip('.') for k in unknown]}; "
                          f"valid keys at {path or 'top level'}: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        sub = f"{path}.{k}".lstrip(".")
        hint = hints[k]
        kwargs[k] = _build(hint, v, sub) if dataclasses.is_dataclass(hint) else _coerce(hint, v, sub)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None


def _coerce(hint, v, path):
    """A YAML value for a field typed `hint`: checked (a bool is not a number; floats must be
    finite, else every step would be skipped or diverge), widened int -> float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if v is None and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) == 1:  # Optional[X]
            return _coerce(args[0], v, path)
        return v
    if hint is float and isinstance(v, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            v = float(v)
        except ValueError:
            pass
    if hint in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ConfigError(f"{path}={v!r} must be a number ({hint.__name__}), not "
                          f"{type(v).__name__}")
    if hint is int and not isinstance(v, int):
        raise ConfigError(f"{path}={v!r} must be an integer")
    if hint is float:
        v = float(v)
        if not math.isfinite(v):
            raise ConfigError(f"{path}={v!r} must be a finite number")
        return v
    if origin is tuple and isinstance(v, list):
        return tuple(v)
    if hint in (str, bool) and not isinstance(v, hint):
        raise ConfigError(f"{path}={v!r} must be of type {hint.__name__}")
    return v


def coerce_fields(cls, data: dict, path: str = "") -> dict:
    """`data` with each value for a scalar field of dataclass `cls` checked and widened as
    `load_config` does (YAML 1.1 reads "8e-3" as a string: it becomes 8e-3; a list for a tuple
    field becomes a tuple); keys `cls` lacks and nested dataclass fields are left as they are,
    for the caller's own checks."""
    hints = typing.get_type_hints(cls)
    return {k: (_coerce(hints[k], v, f"{path}.{k}".lstrip("."))
                if k in hints and not dataclasses.is_dataclass(hints[k]) else v)
            for k, v in data.items()}


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        if not isinstance(d.setdefault(p, {}), dict):
            raise ConfigError(f"override {key}: {p} is not a section")
        d = d[p]
    d[parts[-1]] = value


def read_yaml_with_overrides(path: Optional[str], overrides: Optional[list], *,
                             example: str, override_example: str) -> dict:
    """A YAML mapping (optional file) with dotted `a.b.c=value` overrides applied (values parsed
    as YAML), for every config loader. `example` / `override_example` go into the errors."""
    data: dict = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"config file {path!r} does not exist; pass a YAML file such as "
                              f"{example}")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got "
                              f"{type(data).__name__}")
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. {override_example}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:  # e.g. an unbalanced `{` in a template
            why = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(
                f"override {key.strip()}={raw!r}: the value is not valid YAML ({why}); quote "
                f"it as a string, e.g. \"{key.strip()}='{raw}'\"") from None
        _set_dotted(data, key.strip(), value)
    return data


def load_config(path: Optional[str] = None, overrides: Optional[list] = None) -> Config:
    """YAML file (optional) + `a.b.c=value` overrides (values parsed as YAML) -> validated Config."""
    data = read_yaml_with_overrides(path, overrides, example="configs/prof_grpo_tiny.yaml",
                                    override_example="actor.optim.lr=1e-5")
    return _build(Config, data, "")


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config to `path` whole or not at all: a failed write (a full disk)
    leaves no `.tmp` behind and is one line naming the path and the reason."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fix = ("no space left on device (ENOSPC): free space or set trainer.run_dir to a "
               "larger disk" if e.errno == errno.ENOSPC else f"{e.strerror or e}")
        raise ConfigError(f"writing {path} failed: {fix}") from None

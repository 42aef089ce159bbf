"""Train a discriminative PRM on step-labelled solutions (PURE's recipe, research notes §2.1).

Data: the arithmetic task (exact step labels from `tasks.arithmetic.check_steps`) or TRL's
stepwise JSONL, one row per solution:

    {"prompt": str, "completions": [step strings], "labels": [bool, one per step]}

Malformed rows are skipped, counted and reported with file:line. Each example goes through the
PRM input builder of `rewards.scoring` (`build_prm_batch`), so training and scoring see the same
token layout: response = steps joined by "\\n\\n" (+ EOS when the solution is complete), every
step scored at its closing token, under the PRM's `PRMInputFormat` (raw by default).

Recipe: two stages, as PURE's PRM: (1) the trunk frozen, the head trained (lr 1e-4); (2) the
whole model (lr 1e-6). Loss: per-step 2-class cross-entropy at the closing positions, mean over
the steps of the *global* batch (every dp rank divides its sum by the global step count; Megatron
sums grads over dp and micro-batches), so any (tp, pp, dp, micro-batch) layout takes the same
step. Evaluation: step-level AUROC of the step score against the labels, and F1 of error
detection (a step is flagged bad when p_good < 0.5), on held-out solutions. The trained PRM is
saved in the HF format (safetensors + config.json + tokenizer) and reloads with
`models.mapping.load_hf_weights`.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaprm.config import coerce_fields, read_yaml_with_overrides
from megaprm.models import mapping
from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.logprobs import vocab_parallel_logprobs
from megaprm.models.prm import (
    PRM_HEADS,
    as_prm_spec,
    build_prm,
    gather_positions,
    hf_prm_config,
    load_trunk_from_hf,
)
from megaprm.parallel import cpu, pipeline
from megaprm.parallel.device import DTYPE_CHOICES, DTYPES, resolve_dtype_name, to_host
from megaprm.parallel.groups import Groups
from megaprm.parallel.optimizer import OptimConfig, Optimizer
from megaprm.rewards import scoring
from megaprm.rewards.prm_eval import step_auroc  # moved there; importable here as before
from megaprm.rewards.steps import STEP_SEP, segment_steps, separator_token_ids
from megaprm.rollout import weight_sync
from megaprm.tasks import arithmetic


# ----------------------------------------------------------------------------------- config

@dataclass
class PRMTrainConfig:
    """Everything `train_prm` needs (the parallel layout comes in as `Groups`)."""

    model_dir: str                      # HF dir: a causal LM (trunk; fresh head) or a PRM
    output_dir: Optional[str] = None    # the trained PRM in HF format; None = not saved
    tokenizer_dir: Optional[str] = None  # default: model_dir
    head: str = "token_cls"             # "token_cls" (PURE) | "prm_mlp" (Qwen2.5-Math-PRM)
    train_jsonl: Optional[str] = None   # TRL stepwise rows; None = the arithmetic task
    eval_jsonl: Optional[str] = None    # held-out rows; None = hold out eval_fraction
    eval_fraction: float = 0.1
    arithmetic: arithmetic.ArithmeticConfig = field(default_factory=arithmetic.ArithmeticConfig)
    num_train: int = 4096               # arithmetic solutions to train on
    num_eval: int = 512                 # arithmetic held-out solutions (other problems' seed)
    step_marker: Optional[str] = None   # None = raw responses; "\n" = PURE's PRM input format
    global_batch_size: int = 32         # solutions per optimiser step, over all dp ranks
    micro_batch_size: int = 8
    stage1_steps: int = 100             # head only
    stage1_lr: float = 1e-4
    stage2_steps: int = 100             # full model
    stage2_lr: float = 1e-6
    warmup_steps: int = 0               # linear warm-up at the start of each stage
    lr_decay: str = "constant"          # after warm-up: "constant" | "cosine" (to 0 at stage end)
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    clip_grad: float = 1.0
    # megaprm's addition to PURE's recipe: an auxiliary next-token loss on the fully-correct
    # solutions of each batch, weighted by this (0 = off, PURE). It keeps the trunk computing
    # the solution while the head learns to judge it: a tiny PRM trained from scratch on the
    # arithmetic task reaches AUROC >= 0.9 with it and stays near 0.7 without (docs/prm.md).
    lm_loss_weight: float = 0.0
    dtype: str = "auto"                 # parameters: auto = bf16 on CUDA, fp32 on the CPU; fp32 | bf16
    seed: int = 0
    log_every: int = 20

    def __post_init__(self):
        def bad(name, valid):
            raise ValueError(f"PRMTrainConfig.{name}={getattr(self, name)!r}: {valid}")

        if not isinstance(self.model_dir, str) or not os.path.isdir(self.model_dir):
            bad("model_dir", "must be an existing HF model directory (config.json + safetensors)")
        if self.head not in PRM_HEADS:
            bad("head", f"valid heads are {PRM_HEADS}")
        for name in ("train_jsonl", "eval_jsonl"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                bad(name, "file not found; give a JSONL file of "
                          '{"prompt": str, "completions": [str], "labels": [bool]} rows')
        if self.eval_jsonl is not None and self.train_jsonl is None:
            bad("eval_jsonl", "needs train_jsonl (the arithmetic task makes its own eval set)")
        if not 0.0 < self.eval_fraction < 1.0:
            bad("eval_fraction", "must be in (0, 1)")
        if isinstance(self.arithmetic, dict):
            self.arithmetic = arithmetic.ArithmeticConfig(**self.arithmetic)
        for name in ("num_train", "num_eval", "global_batch_size", "micro_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(name, "must be a positive integer")
        if self.global_batch_size % self.micro_batch_size:
            bad("global_batch_size", f"must be a multiple of micro_batch_size="
                                     f"{self.micro_batch_size} (times the dp size)")
        for name in ("stage1_steps", "stage2_steps", "warmup_steps", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                bad(name, "must be an integer >= 0")
        if self.stage1_steps + self.stage2_steps == 0:
            bad("stage2_steps", "stage1_steps + stage2_steps must be > 0")
        for name in ("stage1_lr", "stage2_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                bad(name, "must be a positive finite number")
        if not (isinstance(self.lm_loss_weight, (int, float)) and self.lm_loss_weight >= 0
                and math.isfinite(self.lm_loss_weight)):
            bad("lm_loss_weight", "must be a finite number >= 0 (0 disables the auxiliary LM loss)")
        if self.dtype not in DTYPE_CHOICES:
            bad("dtype", f"valid values are {DTYPE_CHOICES} (auto: bf16 on CUDA, fp32 on the CPU)")
        self.dtype = resolve_dtype_name(self.dtype)
        if self.lr_decay not in ("constant", "cosine"):
            bad("lr_decay", "valid values are 'constant' and 'cosine'")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if self.clip_grad < 0:
            bad("clip_grad", "must be >= 0 (0 disables clipping)")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")
        if self.step_marker is not None and not (isinstance(self.step_marker, str)
                                                 and self.step_marker):
            bad("step_marker", 'must be None (raw) or the text of one token, e.g. "\\n"')


# ------------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class StepExample:
    """One step-labelled solution. response: the steps joined by "\\n\\n" (no EOS);
    labels[k] = 1 iff step k is good; kind: "reference", a corruption kind, or "jsonl"."""

    prompt: str
    response: str
    labels: Tuple[int, ...]
    ends_with_eos: bool = True
    kind: str = "jsonl"
    source: str = ""  # file:line of a JSONL row


def arithmetic_examples(cfg: arithmetic.ArithmeticConfig, n: int, seed: int) -> List[StepExample]:
    """Half reference solutions, half corrupted, the corruption kinds taken in turn (so every
    kind is present); step labels from the exact checker (local labels)."""
    problems = arithmetic.generate_problems(cfg, n, seed)
    rng = random.Random(seed * 1_000_003 + 7)
    out = []
    for i, problem in enumerate(problems):
        kind = ("reference" if i % 2 == 0
                else arithmetic.CORRUPTION_KINDS[(i // 2) % len(arithmetic.CORRUPTION_KINDS)])
        if kind == "reference":
            text = arithmetic.reference_solution(problem)
        else:
            text = arithmetic.corrupt_solution(problem, rng, kind, cfg.allow_negative)
        eos = kind != "truncated"
        check = arithmetic.check_steps(problem, text, ends_with_eos=eos)
        out.append(StepExample(problem.prompt, text, tuple(int(c) for c in check.step_correct),
                               eos, kind))
    return out


def _row_problem(row) -> Optional[str]:
    """Why a JSONL row is unusable, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for key in ("prompt", "completions", "labels"):
        if key not in row:
            return f"missing key {key!r}"
    if not isinstance(row["prompt"], str):
        return "'prompt' must be a string"
    steps, labels = row["completions"], row["labels"]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        return "'completions' must be a non-empty list of strings"
    if not isinstance(labels, list) or not all(isinstance(b, bool) or b in (0, 1) for b in labels):
        return "'labels' must be a list of booleans"
    if len(labels) != len(steps):
        return f"{len(steps)} completions but {len(labels)} labels"
    for k, s in enumerate(steps):
        if STEP_SEP in s:
            return f"completion {k} contains the step separator {STEP_SEP!r}"
    return None


def read_stepwise_jsonl(path: str) -> Tuple[List[StepExample], List[str]]:
    """TRL stepwise rows -> (examples, skipped), skipped = ["file:line: why", ...]."""
    examples, skipped = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                skipped.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
                continue
            problem = _row_problem(row)
            if problem is not None:
                skipped.append(f"{path}:{lineno}: {problem}")
                continue
            examples.append(StepExample(row["prompt"], STEP_SEP.join(row["completions"]),
                                        tuple(int(b) for b in row["labels"]), True, "jsonl",
                                        f"{path}:{lineno}"))
    return examples, skipped


@dataclass(frozen=True)
class EncodedSteps:
    """PRM inputs of N labelled solutions: batch (scoring.PRMBatch), labels [N, S] long
    (0 where ~batch.step_mask), kinds: N strings."""

    batch: scoring.PRMBatch
    labels: torch.Tensor
    kinds: Tuple[str, ...]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def select(self, rows: torch.Tensor) -> "EncodedSteps":
        """Rows `rows` (1-D long), trimmed to their own longest sequence / step count."""
        b = self.batch.select(rows)
        L = max(int(b.lengths.max()) if len(rows) else 1, 1)
        S = max(int(b.step_mask.sum(1).max()) if len(rows) else 1, 1)
        b = scoring.PRMBatch(b.input_ids[:, :L], b.lengths, b.score_index[:, :S],
                             b.step_mask[:, :S])
        return EncodedSteps(b, self.labels[rows][:, :S], tuple(self.kinds[i] for i in rows))


def encode_examples(examples: Sequence[StepExample], tokenizer, fmt: scoring.PRMInputFormat
                    ) -> Tuple[EncodedSteps, List[str]]:
    """Tokenise, segment and lay out examples like rollouts are scored. Examples whose
    segmentation does not give one step per label are skipped (reported by source)."""
    with cpu.paused():  # host work that never names CUDA: no call through the CPU shim
        return _encode_examples(examples, tokenizer, fmt)


def _encode_examples(examples, tokenizer, fmt):
    sep_ids = separator_token_ids(tokenizer)
    eos = tokenizer.eos_token_id
    if not examples:
        prompt_ids, response_ids = [], []
    else:  # one batched call each (a fast tokenizer's encode_batch), not one per text
        prompt_ids = tokenizer([ex.prompt for ex in examples], add_special_tokens=False).input_ids
        response_ids = tokenizer([ex.response for ex in examples],
                                 add_special_tokens=False).input_ids
    prompts, responses = [], []
    for ex, p_ids, ids in zip(examples, prompt_ids, response_ids):
        prompts.append(torch.tensor(p_ids, dtype=torch.long))
        if ex.ends_with_eos and eos is not None:
            ids = ids + [eos]
        responses.append(torch.tensor(ids, dtype=torch.long))
    resp_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    T = max([int(resp_len.max()) if responses else 0, 1])
    resp = _right_padded(responses, T)
    mask = torch.arange(T)[None, :] < resp_len[:, None]
    seg = segment_steps(resp, mask, sep_ids)
    keep, skipped = [], []
    for i, ex in enumerate(examples):
        if int(seg.num_steps[i]) != len(ex.labels):
            skipped.append(f"{ex.source or ex.kind}: the tokenised response has "
                           f"{int(seg.num_steps[i])} steps but {len(ex.labels)} labels")
        else:
            keep.append(i)
    idx = torch.tensor(keep, dtype=torch.long)
    seg = type(seg)(**{k: getattr(seg, k)[idx] for k in seg.__dataclass_fields__})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = scoring.build_prm_batch([prompts[i] for i in keep], [responses[i] for i in keep],
                                    seg, fmt, pad_id=pad)
    labels = _right_padded([torch.tensor(examples[i].labels, dtype=torch.long) for i in keep],
                           batch.step_mask.shape[1])
    return EncodedSteps(batch, labels, tuple(examples[i].kind for i in keep)), skipped


def _right_padded(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[len(rows), width] long: each 1-D row (at most `width` long) then zeros."""
    out = torch.zeros(len(rows), width, dtype=torch.long)
    if rows:
        padded = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
        out[:, : padded.shape[1]] = padded
    return out


# ------------------------------------------------------------------------------- evaluation

@dataclass(frozen=True)
class PRMEval:
    """Step-level metrics on held-out solutions. f1: error detection (positive class = bad
    step, flagged when p_good < 0.5); accuracy: of that decision; per_kind: kind -> (steps,
    accuracy)."""

    auroc: float
    f1: float
    accuracy: float
    num_steps: int
    num_bad: int
    per_kind: dict


def step_metrics(p_good: torch.Tensor, labels: torch.Tensor, kinds: Sequence[str]) -> PRMEval:
    """p_good, labels: 1-D over steps; kinds: the solution kind of each step."""
    flagged, bad = p_good < 0.5, labels == 0
    tp = int((flagged & bad).sum())
    precision = tp / max(int(flagged.sum()), 1)
    recall = tp / max(int(bad.sum()), 1)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    right = flagged == bad
    per_kind = {}
    for kind in sorted(set(kinds)):
        sel = torch.tensor([k == kind for k in kinds], dtype=torch.bool)
        per_kind[kind] = (int(sel.sum()), float(right[sel].double().mean()))
    return PRMEval(auroc=step_auroc(p_good, labels), f1=f1, accuracy=float(right.double().mean()),
                   num_steps=int(labels.numel()), num_bad=int(bad.sum()), per_kind=per_kind)


def evaluate_prm(model, groups: Groups, data: EncodedSteps, *, head: str,
                 micro_batch_size: int) -> PRMEval:
    """Score `data` (rows split over dp ranks) and compute the metrics on every rank."""
    rows = torch.arange(groups.dp_rank, len(data), groups.dp_size)
    part = data.select(rows)
    scores = scoring.run_prm(model, groups, part.batch, head=head,
                             micro_batch_size=micro_batch_size, keep_logits=True)
    mask = part.batch.step_mask
    p_good = torch.softmax(scores.logits, -1)[..., 1][mask]
    kinds = [part.kinds[i] for i in range(len(part)) for _ in range(int(mask[i].sum()))]
    gathered = scoring.all_gather_rows((p_good, part.labels[mask], kinds), groups)
    p_good = torch.cat([g[0] for g in gathered])
    labels = torch.cat([g[1] for g in gathered])
    return step_metrics(p_good, labels, [k for g in gathered for k in g[2]])


# --------------------------------------------------------------------------------- training

@dataclass
class PRMTrainResult:
    history: List[dict]        # per optimiser step: stage, step, loss, grad_norm, lr
    eval: PRMEval
    train_seconds: float       # the two stages, evaluation and saving excluded
    num_train: int
    num_eval: int
    skipped: List[str]         # "file:line: why" for every unusable row
    output_dir: Optional[str]


def _all_steps_good(labels: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """[N] True for the solutions whose every step is labelled good."""
    return ((labels == 1) | ~step_mask).all(1)


def lm_loss_mask(data: EncodedSteps) -> torch.Tensor:
    """[N, L] 1 at every next-token position (t predicts t+1) of the solutions whose steps are
    all good: the auxiliary LM loss imitates correct solutions only."""
    good = _all_steps_good(data.labels, data.batch.step_mask)
    L = data.batch.input_ids.shape[1]
    pos = torch.arange(L)[None, :] < (data.batch.lengths - 1)[:, None]
    return (pos & good[:, None]).float()


def prm_train_step(model, optimizer, groups: Groups, data: EncodedSteps, rows: torch.Tensor, *,
                   micro_batch_size: int, lm_loss_weight: float = 0.0,
                   vocab_size: Optional[int] = None) -> Tuple[float, float, float]:
    """One optimiser step on the global batch `rows` (the same on every rank; this dp rank takes
    its contiguous share). Returns (mean step cross-entropy of the global batch, grad norm,
    mean auxiliary LM token loss or 0). The LM term needs a PRM built with `aux_lm`."""
    totals, grad_norm = _local_train_step(model, optimizer, groups, data, rows,
                                          micro_batch_size=micro_batch_size,
                                          lm_loss_weight=lm_loss_weight, vocab_size=vocab_size)
    ((loss, lm),) = reduce_step_losses([totals], groups)
    return loss, grad_norm, lm


def reduce_step_losses(totals: Sequence[torch.Tensor], groups: Groups
                       ) -> List[Tuple[float, float]]:
    """[(loss, lm loss)] of the global batch of each step, from every rank's per-step local
    sums (`_local_train_step`, [2] float64 each, zeros off the last stage): one dp all-reduce
    and one pp broadcast for all the steps given, not one of each per step."""
    if not totals:
        return []
    stacked = torch.stack(list(totals))
    if groups.dp_size > 1:
        dist.all_reduce(stacked, group=groups.host_dp)
    return [tuple(row) for row in pipeline.broadcast_from_last_stage(stacked, groups).tolist()]


def _local_train_step(model, optimizer, groups: Groups, data: EncodedSteps, rows: torch.Tensor,
                      *, micro_batch_size: int, lm_loss_weight: float,
                      vocab_size: Optional[int]) -> Tuple[torch.Tensor, float]:
    """`prm_train_step` without the loss reduction: (this rank's [2] float64 sums of the step
    loss and LM loss, each already divided by its global count; grad norm)."""
    per_rank = len(rows) // groups.dp_size
    local = data.select(rows[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank])
    denom = int(data.batch.step_mask[rows].sum())  # steps in the global batch: all ranks agree
    lm_mask, lm_denom = None, 1
    if lm_loss_weight:
        lm_mask = lm_loss_mask(local)
        # the global count of LM positions, the same on every rank (no select of the batch)
        good = _all_steps_good(data.labels[rows], data.batch.step_mask[rows])
        lm_denom = max(int(((data.batch.lengths[rows] - 1).clamp(min=0) * good).sum()), 1)
    if groups.pp_size > 1:  # one [b, L] shape for p2p: the global batch's longest row
        L = int(data.batch.lengths[rows].max())
        local = EncodedSteps(scoring.PRMBatch(pipeline.pad_to(local.batch.input_ids, L),
                                              local.batch.lengths, local.batch.score_index,
                                              local.batch.step_mask), local.labels, local.kinds)
        if lm_mask is not None:
            lm_mask = F.pad(lm_mask, (0, L - lm_mask.shape[1]))

    def post(mb, logits):  # logits [b, L, 2 (+ h: hidden states, with the aux LM)], last stage
        index, mask, labels = mb.payload
        z = gather_positions(logits[..., :2], index).float()  # [b, S, 2]
        ce = F.cross_entropy(z.reshape(-1, 2), labels.reshape(-1), reduction="none")
        loss = (ce.view(mask.shape) * mask).sum() / denom
        lm = loss.new_zeros(())  # on the loss's device: the two are stacked below
        if lm_loss_weight:
            # the LM head runs on the n positions the loss counts (correct solutions, t
            # predicting t + 1), not on all b * L: the same loss without the vocabulary-sized
            # logits of wrong solutions and padding
            keep = mb.loss_mask.bool()  # [b, L]
            target = torch.roll(mb.input_ids, -1, dims=1)[keep]  # [n]
            lm_logits = getattr(model, "module", model).lm_logits(logits[..., 2:][keep])
            logp = vocab_parallel_logprobs(lm_logits, target, tp_group=groups.tp,
                                           tp_rank=groups.tp_rank, vocab_size=vocab_size)
            lm = -logp.sum() / lm_denom
        return loss + lm_loss_weight * lm, torch.stack([loss.detach(), lm.detach()])

    optimizer.zero_grad()
    mbs = scoring.micro_batches(local.batch, micro_batch_size, groups.pp_size, local.labels,
                                loss_mask=lm_mask)
    parts = pipeline.run(model, mbs, groups=groups, post=post, forward_only=False)
    grad_norm, _ = optimizer.step()
    totals = to_host(sum(parts)).double() if parts else torch.zeros(2, dtype=torch.float64)
    return totals, grad_norm


def _load_data(cfg: PRMTrainConfig, tokenizer, fmt) -> Tuple[EncodedSteps, EncodedSteps, list]:
    if cfg.train_jsonl is None:
        train = arithmetic_examples(cfg.arithmetic, cfg.num_train, cfg.seed)
        held = arithmetic_examples(cfg.arithmetic, cfg.num_eval, cfg.seed + 1_000_000)
        skipped = []
    else:
        train, skipped = read_stepwise_jsonl(cfg.train_jsonl)
        if cfg.eval_jsonl is not None:
            held, more = read_stepwise_jsonl(cfg.eval_jsonl)
            skipped += more
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
            n_eval = max(1, int(round(cfg.eval_fraction * len(train))))
            held = [train[i] for i in order[:n_eval]]
            train = [train[i] for i in order[n_eval:]]
    enc_train, more = encode_examples(train, tokenizer, fmt)
    enc_eval, more_eval = encode_examples(held, tokenizer, fmt)
    skipped += more + more_eval
    if len(enc_train) == 0 or len(enc_eval) == 0:
        raise ValueError(f"no usable training/held-out solutions ({len(enc_train)}/"
                         f"{len(enc_eval)}); skipped rows: {skipped[:5]}")
    return enc_train, enc_eval, skipped


def _input_format(cfg: PRMTrainConfig, tokenizer) -> scoring.PRMInputFormat:
    if cfg.step_marker is None:
        return scoring.PRMInputFormat()
    ids = tokenizer(cfg.step_marker, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ValueError(f"PRMTrainConfig.step_marker={cfg.step_marker!r} is {len(ids)} tokens "
                         "for this tokenizer; it must be exactly one token")
    return scoring.PRMInputFormat(step_marker_id=ids[0])


def build_trainable_prm(cfg: PRMTrainConfig, groups: Groups):
    """(model stage, PRM spec): the PRM of cfg.model_dir, or its trunk under a fresh head."""
    spec = spec_from_hf(cfg.model_dir)
    prm_spec = as_prm_spec(spec, cfg.head)
    model = build_prm(prm_spec, tp=groups.tp_size, pp=groups.pp_size, pp_rank=groups.pp_rank,
                      head_seed=cfg.seed, aux_lm=cfg.lm_loss_weight > 0,
                      dtype=DTYPES[cfg.dtype])
    load = load_trunk_from_hf if spec.head == "lm" else mapping.load_hf_weights
    load(model, cfg.model_dir, prm_spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
         pp=groups.pp_size, pp_rank=groups.pp_rank)
    return model, prm_spec


def load_tokenizer(path: str):
    """The tokenizer saved in `path`. A plain tokenizer.json pipeline (the task's char
    tokenizer) is loaded as such: AutoTokenizer would pick the model family's class from
    config.json (Qwen2Tokenizer), which rebuilds the pre-tokenizer and splits "\n\n"."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "tokenizer_config.json")
    try:
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cls = json.load(f).get("tokenizer_class")
            if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {path!r} ({e}); save one with the model or "
                         "set PRMTrainConfig.tokenizer_dir") from e


def _lr_at(step: int, base: float, warmup: int, total: int = 0, decay: str = "constant") -> float:
    """Linear warm-up over `warmup` steps, then constant or cosine to 0 at step `total`."""
    lr = base * min(1.0, (step + 1) / warmup) if warmup else base
    if decay == "cosine" and total > warmup and step >= warmup:
        lr *= 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    return lr


def train_prm(cfg: PRMTrainConfig, groups: Groups,
              log: Optional[Callable[[str], None]] = None) -> PRMTrainResult:
    """Train (two stages), evaluate on held-out solutions, save. Call on every rank."""
    log = log or (lambda msg: print(msg, flush=True) if groups.rank == 0 else None)
    if cfg.global_batch_size % (groups.dp_size * cfg.micro_batch_size):
        raise ValueError(f"PRMTrainConfig.global_batch_size={cfg.global_batch_size}: must be a "
                         f"multiple of dp * micro_batch_size = {groups.dp_size} * "
                         f"{cfg.micro_batch_size}")
    tokenizer = load_tokenizer(cfg.tokenizer_dir or cfg.model_dir)
    fmt = _input_format(cfg, tokenizer)
    train, held, skipped = _load_data(cfg, tokenizer, fmt)
    if skipped:
        log(f"skipped {len(skipped)} unusable rows, e.g. " + "; ".join(skipped[:3]))
    # progress before the first step's line (data and model build took ~40 s silent on a CPU)
    log(f"{len(train)} training and {len(held)} held-out solutions; building the PRM from "
        f"{cfg.model_dir} ...")
    model, spec = build_trainable_prm(cfg, groups)
    ddp = pipeline.wrap_ddp(model, groups)
    log(f"training: {cfg.stage1_steps} head step(s), then {cfg.stage2_steps} whole-model "
        "step(s) ...")
    # stage 1 trains the head (and the auxiliary LM head, which is as new to the task)
    head_params = [p for n, p in ddp.module.named_parameters()
                   if n.startswith("score.") or n.startswith("output_layer.")]
    ddp.module.emit_lm_logits = cfg.lm_loss_weight > 0
    history = []
    pending = []  # local loss sums of the steps whose global losses are not reduced yet
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(len(train), generator=gen), 0
    for stage, steps, lr, params in ((1, cfg.stage1_steps, cfg.stage1_lr, head_params),
                                     (2, cfg.stage2_steps, cfg.stage2_lr, None)):
        if steps == 0:
            continue
        opt = Optimizer(ddp, OptimConfig(
            lr=lr, weight_decay=cfg.weight_decay, betas=cfg.betas, clip_grad=cfg.clip_grad),
            groups, params=params)
        for step in range(steps):
            if cursor + cfg.global_batch_size > len(train):  # next epoch
                order, cursor = torch.randperm(len(train), generator=gen), 0
            rows = order[cursor: cursor + cfg.global_batch_size]
            cursor += cfg.global_batch_size
            step_lr = _lr_at(step, lr, cfg.warmup_steps, steps, cfg.lr_decay)
            opt.set_lr(step_lr)
            totals, grad_norm = _local_train_step(ddp, opt, groups, train, rows,
                                                  micro_batch_size=cfg.micro_batch_size,
                                                  lm_loss_weight=cfg.lm_loss_weight,
                                                  vocab_size=spec.vocab_size)
            history.append(dict(stage=stage, step=step, loss=None, lm_loss=None,
                                grad_norm=grad_norm, lr=step_lr))
            pending.append(totals)
            log_now = cfg.log_every and (step % cfg.log_every == 0 or step == steps - 1)
            if log_now or step == steps - 1:  # the losses since the last reduction, at once
                for h, (loss, lm) in zip(history[-len(pending):],
                                         reduce_step_losses(pending, groups)):
                    h.update(loss=loss, lm_loss=lm)
                pending = []
            if log_now:
                h = history[-1]
                log(f"stage {stage} step {step}/{steps} loss {h['loss']:.4f} "
                    + (f"lm {h['lm_loss']:.4f} " if cfg.lm_loss_weight else "")
                    + f"grad_norm {grad_norm:.3f} ({time.perf_counter() - t0:.0f}s)")
    train_seconds = time.perf_counter() - t0
    ddp.module.emit_lm_logits = False
    result = evaluate_prm(ddp, groups, held, head=spec.head,
                          micro_batch_size=cfg.micro_batch_size)
    log(f"held-out steps {result.num_steps} (bad {result.num_bad}): AUROC {result.auroc:.4f} "
        f"F1(error) {result.f1:.4f} accuracy {result.accuracy:.4f}; trained in "
        f"{train_seconds / 60:.2f} min")
    if cfg.output_dir is not None:
        save_prm(ddp, groups, spec, cfg.output_dir, tokenizer=tokenizer, fmt=fmt,
                 extra={"megaprm_prm_train": {"eval": asdict(result),
                                              "train_seconds": train_seconds}})
    return PRMTrainResult(history, result, train_seconds, len(train), len(held), skipped,
                          cfg.output_dir)


def save_prm(model, groups: Groups, spec, output_dir: str, *, tokenizer=None,
             fmt: scoring.PRMInputFormat = scoring.PRMInputFormat(), extra=None) -> None:
    """Write the PRM in the HF format: every rank joins the gather, global rank 0 writes, and
    every rank returns once the directory is complete."""
    tensors = {name: to_host(t.detach()).contiguous()
               for name, t in weight_sync.iter_hf_weights(model, groups, spec)}
    if groups.rank == 0:
        _write_hf_dir(tensors, spec, output_dir, tokenizer, fmt, extra)
    if groups.distributed and groups.world_size > 1:
        dist.barrier()


def _write_hf_dir(tensors, spec, output_dir, tokenizer, fmt, extra) -> None:
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_prm_config(spec, **fmt.to_hf(), **(extra or {}))
    # config.json names the dtype the weights are saved in (the trained one, bf16 on CUDA)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        name = str(dtypes.pop()).removeprefix("torch.")
        cfg.update({k: name for k in ("dtype", "torch_dtype") if k in cfg or k == "dtype"})
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, default=str)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)


# ------------------------------------------------------------------------------------ CLI

def load_prm_config(path: str, overrides: Sequence[str] = ()) -> Tuple[PRMTrainConfig, int, int]:
    """A YAML file of PRMTrainConfig fields (plus `parallel: {tp, pp}`) and dotted `key=value`
    overrides -> (config, tp, pp). Unknown keys and malformed overrides raise ValueError."""
    raw = read_yaml_with_overrides(path, list(overrides), example="configs/prm/tiny.yaml",
                                   override_example="stage2_steps=200 or "
                                                    "arithmetic.operand_max=9")
    par = raw.pop("parallel", None) or {}
    fields = set(PRMTrainConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - fields) + [f"parallel.{k}" for k in sorted(set(par) - {"tp", "pp"})]
    if unknown:
        raise ValueError(f"{path}: unknown PRM config key(s) {unknown}; valid keys: "
                         f"{sorted(fields)} and parallel.tp / parallel.pp")
    raw = coerce_fields(PRMTrainConfig, raw)  # e.g. stage2_lr=8e-3, a string to YAML 1.1
    return PRMTrainConfig(**raw), int(par.get("tp", 1)), int(par.get("pp", 1))

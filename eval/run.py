"""avg@k / pass@k evaluation on the shipped math sets (MATH500, AIME24, AMC23, Minerva, OlympiadBench).

For each benchmark: every problem is sampled k times, each sample is graded with math-verify
against the gold answer (`rewards.verifiers.MathVerifier`, killable per-sample timeout), and

    avg@k  = mean over problems of (correct samples / k)       (the PRIME / PURE / PROF metric)
    pass@k = mean over problems of 1 - C(n-c, k) / C(n, k)     (Chen et al. 2021, unbiased; n = k)

The "average" row is the unweighted mean over benchmarks (each benchmark counts once, as in the
papers' tables), not a mean over problems.

Prompt (the seeds' format, PURE / PROF-GRPO style): the question, then one fixed instruction,

    PROMPT_TEMPLATE = "{question} Let's think step by step and output the final answer within \\boxed{}."

sent as a single user message through the tokenizer's chat template when it has one (with the
generation prompt appended), else as raw text. The data is read offline from `eval/data/`.

`--model` is an HF directory (config.json + safetensors + tokenizer) or a Megatron checkpoint
written by `checkpoint_tools` (marked by `megaprm_checkpoint.json`), which is exported to HF in
a temporary directory first (`python -m checkpoint_tools export-hf`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from checkpoint_tools.layout import ConversionError, resolve_checkpoint
from megaprm.rewards.verifiers import MathVerifier
from megaprm.tasks.datasets import BENCHMARKS, load_benchmark

PROMPT_TEMPLATE = "{question} Let's think step by step and output the final answer within \\boxed{{}}."


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate and how to sample. `limit`: first N problems of each benchmark (None:
    all). `batch_prompts`: prompts per generate() call (each expands to k rows)."""

    model: str
    benchmarks: tuple[str, ...] = BENCHMARKS
    k: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 4096  # capped to what the model's positions allow (see `fit_max_tokens`)
    engine: str = "hf"
    limit: int | None = None
    seed: int = 0
    batch_prompts: int = 8
    verify_timeout_s: float = 5.0
    progress: bool = True

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"eval: {name}={getattr(self, name)!r}: {why}")

        unknown = [b for b in self.benchmarks if b not in BENCHMARKS]
        if unknown or not self.benchmarks:
            bad("benchmarks", f"expected a non-empty subset of {','.join(BENCHMARKS)}")
        if self.k < 1:
            bad("k", "must be >= 1 (samples per problem)")
        if self.engine not in ("hf", "vllm"):
            bad("engine", "expected hf or vllm")
        if self.limit is not None and self.limit < 1:
            bad("limit", "must be >= 1 (or omitted for every problem)")
        if self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.batch_prompts < 1:
            bad("batch_prompts", "must be >= 1")


# ---------------------------------------------------------------------------------- metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # product form of C(n-c, k) / C(n, k): no huge binomials
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def summarize(correct: Sequence[Sequence[float]], k: int) -> dict:
    """correct [P][k] in {0, 1} -> {"avg@k", "pass@k"} means over the P problems."""
    if not correct:
        return {"avg@k": float("nan"), "pass@k": float("nan")}
    avg = sum(sum(row) / len(row) for row in correct) / len(correct)
    pk = sum(pass_at_k(len(row), int(sum(row)), k) for row in correct) / len(correct)
    return {"avg@k": avg, "pass@k": pk}


def grade(responses: Sequence[str], golds: Sequence[str], verifier=None,
          timeout_s: float = 5.0) -> list[float]:
    """1.0 / 0.0 per response: math-verify equivalence of its (boxed) answer with the gold."""
    verifier = verifier or MathVerifier()
    return verifier.score(list(responses), list(golds), timeout_s=timeout_s)


# ---------------------------------------------------------------------------------- prompts
def format_prompt(question: str) -> str:
    return PROMPT_TEMPLATE.format(question=question)


def prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one problem: the chat template (one user turn + generation prompt) when the
    tokenizer has one, else the raw formatted text."""
    text = format_prompt(question)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------- model
def is_megatron_checkpoint(path: str) -> bool:
    """A megaprm checkpoint in the one format (checkpoint_tools.layout.resolve_checkpoint: a
    checkpoint, a trainer's step_N or its run directory)."""
    try:
        resolve_checkpoint(path)
    except ConversionError:
        return False
    return True


def resolve_model(path: str, workdir: str) -> str:
    """An HF directory to load: `path` itself, or a Megatron checkpoint exported into `workdir`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path}: no such directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if not is_megatron_checkpoint(path):
        raise ValueError(f"--model {path}: neither an HF model directory (config.json) nor a "
                         "megaprm checkpoint (checkpoint_tools import-hf, a "
                         "trainer run directory or its checkpoints/step_N)")
    out = os.path.join(workdir, "hf")
    cmd = [sys.executable, "-m", "checkpoint_tools", "export-hf", "--ckpt", path, "--out", out,
           "--no-verify"]
    print(f"eval: exporting Megatron checkpoint {path} -> {out}", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    if proc.returncode != 0:
        raise ValueError(f"--model {path}: export-hf failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}")
    return out


def build_engine(cfg: EvalConfig, hf_dir: str, tokenizer):
    """The one engine factory (rollout.factory), one process: this rank's device."""
    # deferred: bound at call time (tests and benchmarks replace it); torch (run imports without it)
    from megaprm.parallel.device import rank_device
    from megaprm.rollout.config import RolloutConfig
    from megaprm.rollout.factory import build_engine as build

    return build(RolloutConfig(engine=cfg.engine), hf_dir, tokenizer, world_size=1, tp_size=1,
                 seed=cfg.seed, device=rank_device())


def fit_max_tokens(max_tokens: int, hf_dir: str, longest_prompt: int) -> tuple[int, str | None]:
    """`max_tokens` capped so that the longest prompt plus its response fits the model's
    `max_position_embeddings`; returns the value and a one-line notice when it was capped."""
    import json

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        positions = json.load(f).get("max_position_embeddings")
    if not positions or longest_prompt + max_tokens <= positions:
        return max_tokens, None
    fit = positions - longest_prompt
    if fit < 1:
        raise ValueError(f"eval: the longest prompt ({longest_prompt} tokens) leaves no room for "
                         f"a response in the model's {positions} positions")
    return fit, (f"eval: max_tokens {max_tokens} + the longest prompt ({longest_prompt} tokens) "
                 f"exceed the model's {positions} positions; generating up to {fit} tokens")


# ---------------------------------------------------------------------------------- run
def _eval_benchmark(name: str, cfg: EvalConfig, loaded, engine, tokenizer, verifier,
                    bar) -> dict:
    # deferred: torch (run imports without it)
    from megaprm.rollout.engine import SamplingParams

    records, load = loaded
    t0 = time.perf_counter()
    correct: list[list[float]] = []
    n_tokens = 0
    for lo in range(0, len(records), cfg.batch_prompts):
        chunk = records[lo:lo + cfg.batch_prompts]
        # one line per sample batch before it runs (a batch of k samples of up to max_tokens
        # each can take minutes on a CPU, and the bar moves only when it ends)
        if cfg.progress:
            bar.write(f"eval {name}: problems {lo + 1}-{lo + len(chunk)} of {len(records)}, "
                      f"{len(chunk) * cfg.k} samples (k={cfg.k}) of up to {cfg.max_tokens} "
                      "tokens ...", file=sys.stderr)
        params = SamplingParams(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_tokens=cfg.max_tokens, seed=cfg.seed + lo * cfg.k)
        batch = engine.generate([prompt_ids(tokenizer, r.prompt) for r in chunk], params)
        n_tokens += int(batch.response_lengths.sum())
        texts = batch.decode_responses(tokenizer)  # row i*k + j: sample j of problem i
        golds = [r.answer for r in chunk for _ in range(cfg.k)]
        scores = grade(texts, golds, verifier, cfg.verify_timeout_s)
        correct += [scores[i * cfg.k:(i + 1) * cfg.k] for i in range(len(chunk))]
        bar.update(len(chunk))
    result = {"problems": len(records), **summarize(correct, cfg.k),
              "response_tokens": n_tokens, "time_s": round(time.perf_counter() - t0, 3),
              "skipped_rows": len(load.skipped),
              "per_problem": [{"index": r.index, "correct": int(sum(c))}
                              for r, c in zip(records, correct)]}
    return result


def evaluate_benchmarks(cfg: EvalConfig) -> dict:
    """Run the whole evaluation and return the report (see `format_table` for the summary)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megaprm-eval-") as work:
        hf_dir = resolve_model(cfg.model, work)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        engine = build_engine(cfg, hf_dir, tokenizer)
        loaded = {b: load_benchmark(b, limit=cfg.limit) for b in cfg.benchmarks}
        longest = max(len(prompt_ids(tokenizer, r.prompt)) for records, _ in loaded.values()
                      for r in records)
        max_tokens, notice = fit_max_tokens(cfg.max_tokens, hf_dir, longest)
        if notice:
            print(notice, file=sys.stderr)
            cfg = replace(cfg, max_tokens=max_tokens)
        verifier = MathVerifier()
        total = sum(len(records) for records, _ in loaded.values())
        if cfg.progress:  # the work up front: k and max_tokens are what make an eval long
            print(f"eval: {total} problem(s) x k={cfg.k} samples of up to {cfg.max_tokens} "
                  f"tokens on the {cfg.engine} engine, {cfg.batch_prompts} problem(s) per "
                  "generate call (--k and --max-tokens shrink it)", file=sys.stderr, flush=True)
        per = {}
        try:
            with tqdm(total=total, desc=f"eval avg@{cfg.k}", unit="problem",
                      disable=not cfg.progress) as bar:
                for name in cfg.benchmarks:
                    bar.set_postfix_str(name)
                    per[name] = _eval_benchmark(name, cfg, loaded[name], engine, tokenizer,
                                                verifier, bar)
        finally:
            verifier.close()
        chat = bool(getattr(tokenizer, "chat_template", None))
    average = {m: sum(r[m] for r in per.values()) / len(per)
               for m in ("avg@k", "pass@k", "time_s")}
    return {"config": asdict(cfg), "exported_from_megatron": is_megatron_checkpoint(cfg.model),
            "prompt_template": PROMPT_TEMPLATE, "chat_template_applied": chat,
            "benchmarks": per, "average": average,
            "total_time_s": round(time.perf_counter() - t0, 3)}


def format_table(report: dict) -> str:
    k = report["config"]["k"]
    head = f"{'benchmark':<16}{'problems':>9}{f'avg@{k}':>10}{f'pass@{k}':>10}{'time_s':>9}"
    lines = [head, "-" * len(head)]
    for name, r in report["benchmarks"].items():
        lines.append(f"{name:<16}{r['problems']:>9}{r['avg@k']:>10.4f}{r['pass@k']:>10.4f}"
                     f"{r['time_s']:>9.1f}")
    a = report["average"]
    lines += ["-" * len(head),
              (f"{'average':<16}{'':>9}{a['avg@k']:>10.4f}{a['pass@k']:>10.4f}"
               f"{a.get('time_s', float('nan')):>9.1f}"),
              f"total {report['total_time_s']:.1f} s (model load and export included)"]
    return "\n".join(lines)

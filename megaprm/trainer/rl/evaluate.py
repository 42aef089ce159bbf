"""Greedy evaluation on held-out problems through a rollout engine (the demo's before/after and
the trainer's `trainer.eval_every`). dp-sharded: every rank decodes its share, counts are summed
over the dp group (host side). Arithmetic is checked step by step; math is graded by math-verify.
"""
from __future__ import annotations

from megaprm.parallel.groups import Groups
from megaprm.parallel.host import dp_reduce
from megaprm.rewards.verifiers import score_outcomes
from megaprm.rollout.engine import SamplingParams
from megaprm.tasks.arithmetic import check_steps, generate_problems
from megaprm.tasks.datasets import load_prompts
from megaprm.trainer.rl.data import HELD_OUT_SEED, prompt_formatter, render_with


def shard(problems: list, groups: Groups) -> tuple[int, int]:
    """[lo, hi) of `problems` that this dp rank evaluates (contiguous, every problem once)."""
    n = len(problems)
    return groups.dp_rank * n // groups.dp_size, (groups.dp_rank + 1) * n // groups.dp_size


def evaluate_arithmetic(engine, tokenizer, groups: Groups, problems: list,
                        max_tokens: int = 64, *, temperature: float = 0.0, n: int = 1,
                        seed: int = 0, fmt=None, per_problem: bool = False) -> dict:
    """accuracy, the share of correct answers resting on a wrong step, fully-correct share.
    Greedy by default; `temperature > 0` draws `n` samples per problem (seeded per dp rank, so
    the result does not depend on the order of evaluations) and counts every sample. `fmt`:
    question -> the policy's prompt text (the trainer's data.prompt_format; None: as is).
    dp-sharded (`shard`); the counts are summed over the dp group. `per_problem`: also every
    problem's counts - `correct`, `wrong_step` (correct with a wrong step), `clean` (correct
    with every step correct), each out of the n samples - in problem order (the comparison's
    bootstrap over problems, `experiments/arithmetic/stats.py`)."""
    import torch
    import torch.distributed as dist

    total = len(problems)
    lo, hi = shard(problems, groups)
    local = problems[lo:hi]
    n = n if temperature > 0 else 1
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens,
                            stop_token_ids=(tokenizer.eos_token_id,),
                            seed=(seed + 1_000_003 * groups.dp_rank) % 2**31)
    fmt = fmt or (lambda q: q)
    counts = torch.zeros(3, total, dtype=torch.float64)  # correct, wrong_step, clean
    if local:
        batch = engine.generate([tokenizer.encode(fmt(p.prompt), add_special_tokens=False)
                                 for p in local], params)
        texts = batch.decode_responses(tokenizer)
        for g, t, r in zip(batch.group_index.tolist(), texts, batch.finish_reason):
            c = check_steps(local[g], t, ends_with_eos=r == "stop")
            counts[0, lo + g] += c.final_correct
            counts[1, lo + g] += c.correct_with_wrong_step
            counts[2, lo + g] += bool(c.all_steps_correct and c.final_correct)
    if groups.dp_size > 1:
        dist.all_reduce(counts, group=groups.host_dp)
    correct, wrong, clean = (counts[i].tolist() for i in range(3))
    samples = total * n
    out = {"accuracy": sum(correct) / max(samples, 1),
           "correct_with_wrong_step": sum(wrong) / max(sum(correct), 1),
           "all_steps_correct": sum(clean) / max(samples, 1), "problems": total,
           "samples": samples}
    if per_problem:
        out["per_problem"] = {"correct": [int(x) for x in correct],
                              "wrong_step": [int(x) for x in wrong],
                              "clean": [int(x) for x in clean]}
    return out


def evaluate_math(engine, tokenizer, groups: Groups, prompts: list, answers: list,
                  max_tokens: int, verifier: str = "math_verify") -> dict:
    """Greedy accuracy of `prompts` (the policy's prompt texts) graded by `verifier`
    (reward.verifier)."""
    per = len(prompts) // groups.dp_size
    lo = groups.dp_rank * per
    batch = engine.generate([tokenizer.encode(p, add_special_tokens=False)
                             for p in prompts[lo:lo + per]],
                            SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens,
                                           stop_token_ids=(tokenizer.eos_token_id,)))
    scores = score_outcomes(batch.decode_responses(tokenizer), answers[lo:lo + per], kind="math",
                            verifier=verifier)
    counts = dp_reduce({"total": len(scores), "correct": float(scores.sum())}, groups)
    return {"accuracy": counts["correct"] / max(counts["total"], 1),
            "problems": int(counts["total"])}


def evaluate_with(cfg, engine, tok, groups) -> dict:
    """The held-out evaluation of `trainer.eval_problems` problems through `engine` (dp-sharded
    over `groups`; a separate placement's rollout rank evaluates them all)."""
    n = cfg.trainer.eval_problems
    fmt = prompt_formatter(cfg.data, tok)  # the training prompts' format
    if cfg.data.task == "arithmetic":
        problems = generate_problems(cfg.data.arithmetic, n, seed=HELD_OUT_SEED)
        return evaluate_arithmetic(engine, tok, groups, problems,
                                   max_tokens=cfg.rollout.max_tokens, fmt=fmt)

    records, _ = load_prompts(cfg.data.eval_path, limit=n, render=render_with(fmt))
    return evaluate_math(engine, tok, groups, [x.text for x in records],
                         [x.answer for x in records], max_tokens=cfg.rollout.max_tokens,
                         verifier=cfg.reward.verifier)

"""The prompts of each step: block b = the b-th batch of `data.prompts_per_step` prompts
(arithmetic: generated from the seed; math: a prompt file walked in order), formatted for the
policy and encoded for the engine."""
from __future__ import annotations

from dataclasses import dataclass

from megaprm.config import Config
from megaprm.errors import ConfigError
from megaprm.tasks.arithmetic import generate_problems, reference_solution
from megaprm.tasks.datasets import load_prompts, policy_prompt

HELD_OUT_SEED = 987_654_321  # arithmetic eval problems; training draws seed*100_003 + step


@dataclass
class Prompts:
    """One block of `data.prompts_per_step` prompts (global, before the dp split): the prompt
    texts, the verifier's truths (arithmetic: `Problem`s; math: answer strings), and what a
    generative judge is shown (problem statement, reference solution or None)."""

    texts: list
    truths: list
    problems: list
    references: list

    def shard(self, lo: int, hi: int) -> "Prompts":
        return Prompts(self.texts[lo:hi], self.truths[lo:hi], self.problems[lo:hi],
                       self.references[lo:hi])

    @staticmethod
    def cat(parts: list) -> "Prompts":
        return Prompts(*([x for p in parts for x in getattr(p, f)]
                         for f in ("texts", "truths", "problems", "references")))

def encode_prompts(tokenizer, texts: list) -> list:
    """The token ids the engine is given: each prompt text encoded without added special tokens
    (a chat template's markers are in the text and parse as the special tokens they name), as
    verl's tokenize_and_postprocess_data and OpenRLHF's tokenizer call do."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def prompt_formatter(d, tokenizer):
    """(question, messages=None) -> the policy's prompt text under `data.prompt_format` (and
    data.prompt_template / system_prompt; tasks.datasets.policy_prompt). A chat format needs
    the policy tokenizer's chat template: refused here, before any model is built."""
    if d.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.prompt_format='chat' needs a chat template in the policy's "
                          "tokenizer (tokenizer_config.json chat_template); this one has none. "
                          "Use data.prompt_format=raw or a tokenizer with a template")

    def fmt(question, messages=None):
        return policy_prompt(question, messages, fmt=d.prompt_format,
                             template=d.prompt_template, system=d.system_prompt,
                             tokenizer=tokenizer)
    return fmt


def render_with(fmt):
    """A `load_prompts` render: a record -> its policy prompt under `fmt` (prompt_formatter)."""
    return lambda rec: fmt(rec.prompt, rec.meta.get("messages"))


def make_data(cfg: Config, tokenizer=None, log=None):
    """block -> `Prompts`: the global prompt batch number `block`, deterministic in it (a step
    without refill uses block = step, so resume needs nothing else; with refill the next block
    is saved trainer state). A prompt file is read once, each row rendered into its prompt
    (a row that is not the recipe's layout is a bad row), with its load report printed (`log`)
    and `data.*` row rules applied (max_prompt_tokens on the rendered prompt); it is walked in
    order, block after block."""
    P = cfg.data.prompts_per_step
    d = cfg.data
    fmt = prompt_formatter(d, tokenizer)
    if cfg.data.task == "arithmetic":
        def arithmetic(block):
            probs = generate_problems(cfg.data.arithmetic, P,
                                      seed=cfg.trainer.seed * 100_003 + block)
            texts = [p.prompt for p in probs]
            return Prompts([fmt(t) for t in texts], probs, texts,
                           [reference_solution(p) for p in probs])
        return arithmetic

    records, report = load_prompts(d.path, on_bad_row=d.on_bad_row,
                                   keep_unanswered=d.keep_unanswered,
                                   max_prompt_tokens=d.max_prompt_tokens,
                                   long_prompt=d.long_prompt,
                                   tokenizer=tokenizer if d.max_prompt_tokens else None, log=log,
                                   render=render_with(fmt))
    if not records:
        raise ConfigError(f"data.path={d.path!r}: no usable rows ({report.summary()})")

    def math(block):
        rows = [records[(block * P + i) % len(records)] for i in range(P)]
        return Prompts([r.text for r in rows],
                       [r.answer for r in rows],
                       [r.prompt if r.question is None else r.question for r in rows], [r.reference for r in rows])
    math.report = report
    return math

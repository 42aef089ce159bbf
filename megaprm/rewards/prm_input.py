"""How a PRM reads a response: its input format (`prm.input_format`, recorded by
`megaprm train-prm` in the PRM's config.json) and whether it can read the policy's tokens at all.
Light on purpose (transformers' tokenizers, no Megatron): `megaprm train` checks both before any
rank starts. The layouts themselves are described in `rewards/scoring.py`, which builds them."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megaprm.errors import ConfigError
from megaprm.rewards.steps import PROF_MAX_STEPS, prof_steps

HF_CONFIG_KEY = "megaprm_prm_input"
PRM_INPUT_FORMATS = ("auto", "qwen25_math_prm", "pure", "raw", "megaprm")
QWEN_PRM_STEP_TOKEN = "<extra_0>"
# PROF-GRPO's system message, exactly as released (prof_dp_rm.py:268): a plain string, so the
# braces stay doubled; the PRM's model card writes "\boxed{}".
PROF_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{{}}."


@dataclass(frozen=True)
class PRMInputFormat:
    """How responses are laid out for the PRM (module docstring). None = raw tokens."""

    step_marker_id: Optional[int] = None

    def to_hf(self) -> dict:
        return {HF_CONFIG_KEY: {"step_marker_id": self.step_marker_id}}

    @classmethod
    def from_hf(cls, hf_config: dict) -> "PRMInputFormat":
        """The format a megaprm-trained PRM recorded; raw when the config says nothing (prefer
        `resolve_prm_input_format`, which refuses to guess for a downloaded PRM)."""
        entry = hf_config.get(HF_CONFIG_KEY) or {}
        return cls(step_marker_id=entry.get("step_marker_id"))


@dataclass(frozen=True)
class ChatStepFormat:
    """A text-level PRM format (Qwen2.5-Math-PRM as PROF-GRPO calls it; module docstring).

    `tokenizer` is the PRM's (it decodes the policy's ids too: PROF's policy and PRM share the
    Qwen2.5 vocabulary); `max_length` truncates on the right like the released tokenizer call
    (reward_model.model.max_length = actor.ppo_max_token_len_per_gpu, verl default 16384)."""

    tokenizer: Any = field(compare=False, repr=False)
    step_token: str = QWEN_PRM_STEP_TOKEN
    system: str = PROF_PRM_SYSTEM
    max_steps: int = PROF_MAX_STEPS
    max_length: int = 16384
    name: str = "qwen25_math_prm"

    @property
    def step_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.step_token))

    def conversation(self, prompt_text: str, response_text: str) -> str:
        """The released PRM input string of one sample (prof_dp_rm.py:269-280): the query is the
        decoded prompt with the system message removed, the steps joined and closed by
        `step_token`, through the PRM's chat template (no generation prompt)."""
        query = prompt_text.replace(self.system, "").strip()
        steps = prof_steps(response_text)
        messages = [{"role": "system", "content": self.system},
                    {"role": "user", "content": query},
                    {"role": "assistant", "content": self.step_token.join(steps) + self.step_token}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=False)


AnyPRMFormat = Union[PRMInputFormat, ChatStepFormat]


def _load_prm_tokenizer(prm_dir: str):
    """The tokenizer saved with the PRM, or None. A plain tokenizer.json pipeline is loaded as
    such (AutoTokenizer would rebuild it as the model family's class from config.json)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not any(os.path.isfile(os.path.join(prm_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        cfg_file = os.path.join(prm_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                if json.load(f).get("tokenizer_class") in ("TokenizersBackend",
                                                           "PreTrainedTokenizerFast"):
                    return PreTrainedTokenizerFast.from_pretrained(prm_dir)
        return AutoTokenizer.from_pretrained(prm_dir)
    except (OSError, ValueError, KeyError):
        return None


def resolve_prm_input_format(name: str, prm_dir: str, *, hf_config: Optional[dict] = None,
                             tokenizer=None, max_length: int = 16384) -> AnyPRMFormat:
    """`prm.input_format` -> the format to score with (module docstring). `tokenizer`: the PRM's
    (loaded from `prm_dir` when None and needed). Raises ConfigError with the choices. A PRM
    megaprm trained is scored in the layout it recorded: a name that would feed it another one
    (qwen25_math_prm's chat layout for a PRM trained on raw tokens) is refused, not used."""
    if hf_config is None:
        with open(os.path.join(prm_dir, "config.json"), encoding="utf-8") as f:
            hf_config = json.load(f)
    fmt = _resolve_named(name, prm_dir, hf_config, tokenizer, max_length)
    if HF_CONFIG_KEY in hf_config and fmt != PRMInputFormat.from_hf(hf_config):
        raise ConfigError(
            f"prm.input_format={name} would feed the PRM at prm.path={prm_dir!r} another layout "
            f"than the one it was trained on by megaprm train-prm (step marker id "
            f"{PRMInputFormat.from_hf(hf_config).step_marker_id}, recorded in its config.json as "
            f"{HF_CONFIG_KEY!r}); set prm.input_format=auto, which reads the record")
    return fmt


def _resolve_named(name: str, prm_dir: str, hf_config: dict, tokenizer,
                   max_length: int) -> AnyPRMFormat:
    choices = ", ".join(PRM_INPUT_FORMATS)
    if name not in PRM_INPUT_FORMATS:
        raise ConfigError(f"prm.input_format={name!r} is not valid: one of {choices}")
    archs = hf_config.get("architectures") or []
    recorded = HF_CONFIG_KEY in hf_config
    if name == "auto":
        if recorded:
            name = "megaprm"
        else:
            tok = tokenizer if tokenizer is not None else _load_prm_tokenizer(prm_dir)
            if ("Qwen2ForProcessRewardModel" in archs and tok is not None
                    and QWEN_PRM_STEP_TOKEN in tok.get_vocab() and tok.chat_template):
                name, tokenizer = "qwen25_math_prm", tok
            else:
                raise ConfigError(
                    f"prm.input_format=auto cannot tell how to feed the PRM at prm.path={prm_dir!r} "
                    f"(architectures={archs}, no {HF_CONFIG_KEY!r} record); set prm.input_format "
                    f"to one of qwen25_math_prm, pure, raw, megaprm")
    if name == "megaprm":
        if not recorded:
            raise ConfigError(f"prm.input_format=megaprm but {prm_dir}/config.json has no "
                              f"{HF_CONFIG_KEY!r} record (not written by megaprm train-prm); "
                              f"set prm.input_format to one of qwen25_math_prm, pure, raw")
        return PRMInputFormat.from_hf(hf_config)
    if name == "raw":
        return PRMInputFormat()
    tok = tokenizer if tokenizer is not None else _load_prm_tokenizer(prm_dir)
    if tok is None:
        raise ConfigError(f"prm.input_format={name} needs the PRM's tokenizer, and {prm_dir!r} has "
                          "none; save the tokenizer next to the PRM")
    if name == "pure":
        ids = tok("\n", add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise ConfigError(f"prm.input_format=pure: the tokenizer of {prm_dir!r} encodes "
                              f"'\\n' as {len(ids)} tokens; PURE's PRM reads one '\\n' per step")
        return PRMInputFormat(step_marker_id=ids[0])
    if QWEN_PRM_STEP_TOKEN not in tok.get_vocab() or not tok.chat_template:
        raise ConfigError(f"prm.input_format=qwen25_math_prm: the tokenizer of {prm_dir!r} needs "
                          f"the {QWEN_PRM_STEP_TOKEN} token and a chat template (Qwen2.5-Math-PRM's);"
                          " for a PRM trained by megaprm train-prm set prm.input_format=auto (it "
                          "reads the layout the PRM recorded; docs/your-model.md)")
    return ChatStepFormat(tokenizer=tok, max_length=max_length)


def check_prm_reads_policy(prm_dir: str, policy_dir: str, *, prm_tokenizer=None,
                           policy_tokenizer=None, prm_vocab_size: Optional[int] = None) -> None:
    """A PRM scores the policy's token ids (raw, pure and megaprm layouts) or decodes them with
    its own tokenizer (qwen25_math_prm): either way every token of the policy's tokenizer must
    have the same id in the PRM's (the PRM's may add tokens, as Qwen2.5-Math-PRM's <extra_0>),
    and the PRM's embedding must have a row for every id. ConfigError in one line otherwise
    (a character-level PRM under a 151k-token Qwen policy scored ~0 at every step, silently).
    A PRM saved without a tokenizer is checked on its embedding rows alone."""
    policy_tok = policy_tokenizer or _load_prm_tokenizer(policy_dir)
    if policy_tok is None:
        return  # the policy's own check says it has no tokenizer
    pv = policy_tok.get_vocab()
    fix = ("train a PRM from the policy's trunk (megaprm train-prm model_dir=<the policy>, "
           "docs/your-model.md) or use one released for the policy's tokenizer")
    if prm_vocab_size is not None and prm_vocab_size < max(pv.values()) + 1:
        raise ConfigError(
            f"prm.path={prm_dir!r} has {prm_vocab_size} embedding rows but the policy's "
            f"tokenizer (model.path={policy_dir!r}) has ids up to {max(pv.values())}: the PRM "
            f"cannot read the policy's tokens; {fix}")
    prm_tok = prm_tokenizer or _load_prm_tokenizer(prm_dir)
    if prm_tok is None:
        return
    qv = prm_tok.get_vocab()
    other = [t for t, i in pv.items() if qv.get(t) != i]
    if other:
        raise ConfigError(
            f"prm.path={prm_dir!r} reads another vocabulary than the policy (model.path="
            f"{policy_dir!r}): {len(other)} of the policy's {len(pv)} tokens have another id or "
            f"none in the PRM's {len(qv)}-token tokenizer (e.g. {sorted(other)[:3]}); {fix}")

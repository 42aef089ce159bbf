"""The prompt each recipe's policy and PRM receive, with a real Qwen2.5 tokenizer and chat
template (tests/qwen25.py), against the released code's construction, transcribed here by hand:

* PURE (CJReinforce/PURE): prompts_dataset.py preprocess_data with train_pure_ray.py:269's
  input_template (no chat template), tokenised without special tokens; the PRM input of
  experience_maker.py:831-852 (prompt tokens, each step without its closing token, then "\\n").
* PRIME (PRIME-RL/PRIME): rl_dataset.py:132 apply_chat_template(row messages,
  add_generation_prompt=True), torch_functional.py:236 tokenizer(..., add_special_tokens=False);
  its implicit PRM reads the policy's own ids.
* PROF-GRPO (amazon-science/PROF-GRPO): data_preprocess/numina_math.py:45-46 system message and
  instruction, verl's chat template; the PRM input of prof_dp_rm.py:259-299.
* PAPO (ScopeHLS/Process-Aware-Policy-Optimization): the 7B-base script's custom chat template
  `{{ messages[0]["content"] }}` (script:72), rendered here through Jinja itself.
"""
import json
from pathlib import Path

import pytest
import torch

from megaprm.config import ConfigError, DataConfig, load_config
from megaprm.rewards.scoring import (
    batch_from_rollouts,
    chat_batch_from_rollouts,
    resolve_prm_input_format,
)
from megaprm.rewards.steps import separator_token_ids
from megaprm.tasks.datasets import load_prompts
from megaprm.trainer.data import encode_prompts, prompt_formatter
from tests.qwen25 import qwen25_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUESTION = "What is the smallest positive integer $n$ such that $3n \\equiv 1 \\pmod{7}$?"
RESPONSE = ("We need $3n = 7k + 1$.\n\nTrying $n = 5$: $15 = 14 + 1$.\n\n"
            "So the answer is $\\boxed{5}$.")
BOXED = "\\boxed{}"


@pytest.fixture(scope="module")
def tok():
    return qwen25_tokenizer()


def _policy_prompt(recipe: str, row: dict, tmp_path, tok) -> tuple[str, list]:
    """The recipe's prompt for `row` through megaprm's own path: the row written to a jsonl
    file, loaded, formatted and encoded as the trainer does."""
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"))
    path = tmp_path / f"{recipe}.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    (rec,), _ = load_prompts(path)
    text = prompt_formatter(cfg.data, tok)(rec.prompt, rec.meta.get("messages"))
    return text, encode_prompts(tok, [text])[0]


def _rollout(prompt_ids, response_ids, pad):
    """One left-padded prompt and one right-padded response, as the engine returns them."""
    P, R = len(prompt_ids) + 3, len(response_ids) + 2
    p = torch.full((1, P), pad)
    p[0, P - len(prompt_ids):] = torch.tensor(prompt_ids)
    pm = torch.zeros(1, P, dtype=torch.long)
    pm[0, P - len(prompt_ids):] = 1
    r = torch.full((1, R), pad)
    r[0, :len(response_ids)] = torch.tensor(response_ids)
    rm = torch.zeros(1, R, dtype=torch.long)
    rm[0, :len(response_ids)] = 1
    return p, pm, r, rm


def test_pure_prompt_and_prm_input(tok, tmp_path):
    text, ids = _policy_prompt("pure", {"question": QUESTION, "answer": "5"}, tmp_path, tok)
    # released: input_template.format(question); the template's "\n" are newlines
    template = ('{}\n\nPlease reason step by step with steps separated by "\n\n", and put your '
                'final answer within \\boxed{{}}.')
    released = template.format(QUESTION)
    assert text == released
    assert released.endswith('separated by "\n\n", and put your final answer within \\boxed{}.')
    assert ids == tok(released, add_special_tokens=False).input_ids
    assert 151644 not in ids  # no chat template

    # the PRM input: prompt tokens, then each step's tokens without its closing token + "\n"
    resp = tok(RESPONSE, add_special_tokens=False).input_ids + [tok.eos_token_id]
    newline = tok.encode("\n", add_special_tokens=False)
    closing = [j for j, t in enumerate(resp) if tok.decode([t]).endswith("\n\n")]
    closing.append(len(resp) - 1)  # the last step closes at the last valid token (EOS)
    released_prm, start = list(ids), 0
    for j in closing:
        released_prm += resp[start:j] + newline
        start = j + 1
    fmt = resolve_prm_input_format("pure", "unused", hf_config={}, tokenizer=tok)
    batch, _ = batch_from_rollouts(*_rollout(ids, resp, tok.pad_token_id),
                                   separator_token_ids(tok), fmt, pad_id=tok.pad_token_id)
    assert batch.input_ids[0, :batch.lengths[0]].tolist() == released_prm
    assert len(closing) == 3


def test_prime_prompt_is_the_chat_template_over_the_rows_messages(tok, tmp_path):
    messages = [{"role": "system", "content": "When tackling complex reasoning tasks, you have "
                 "access to the following actions. [ASSESS] [ADVANCE] [OUTPUT]"},
                {"role": "user", "content": QUESTION + "\n\nPresent the answer in LaTex format: "
                 "\\boxed{Your answer}"}]
    row = {"data_source": "numina_olympiads", "prompt": messages,
           "reward_model": {"ground_truth": "5"}}
    text, ids = _policy_prompt("prime", row, tmp_path, tok)
    released = ("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n"
                "<|im_start|>user\n" + messages[1]["content"] + "<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert text == released
    assert ids == tok(released, add_special_tokens=False).input_ids
    assert ids[0] == 151644 and ids[-3:] == [151644, 77091, 198]  # <|im_start|>assistant\n


def test_prof_prompt_and_prm_input(tok, tmp_path):
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    user = QUESTION + " Let's think step by step and output the final answer within \\boxed{}."
    released = ("<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\n" + user
                + "<|im_end|>\n<|im_start|>assistant\n")
    # a plain numina row (system message and instruction added by the recipe) and the
    # released parquet row (both already in it) give the same prompt
    plain, ids = _policy_prompt("prof_grpo", {"problem": QUESTION, "answer": "5"}, tmp_path, tok)
    verl_row = {"data_source": "numina_math", "reward_model": {"ground_truth": "5"},
                "prompt": [{"role": "system", "content": system},
                           {"role": "user", "content": user}]}
    from_parquet, ids2 = _policy_prompt("prof_grpo", verl_row, tmp_path, tok)
    assert plain == from_parquet == released
    assert ids == ids2 == tok(released, add_special_tokens=False).input_ids

    # the PRM input (prof_dp_rm.py): the decoded prompt (special tokens dropped, so the role
    # words stay), the system string with doubled braces removed (it never matches), steps
    # split on "\n\n", joined and closed by <extra_0>, through the chat template
    resp = tok(RESPONSE, add_special_tokens=False).input_ids + [tok.eos_token_id]
    prm_system = "Please reason step by step, and put your final answer within \\boxed{{}}."
    query = tok.decode(ids, skip_special_tokens=True).replace(prm_system, "").strip()
    assert query.startswith("system\n" + system + "\nuser\n" + QUESTION)
    steps = [s.strip() for s in tok.decode(resp, skip_special_tokens=True).strip().split("\n\n")
             if s.strip()]
    conversation = tok.apply_chat_template(
        [{"role": "system", "content": prm_system}, {"role": "user", "content": query},
         {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}],
        tokenize=False, add_generation_prompt=False)
    released_prm = tok(conversation, truncation=True, max_length=4096).input_ids
    fmt = resolve_prm_input_format("qwen25_math_prm", "unused", hf_config={}, tokenizer=tok)
    batch = chat_batch_from_rollouts(*_rollout(ids, resp, tok.pad_token_id), fmt)
    assert batch.input_ids[0, :batch.lengths[0]].tolist() == released_prm
    step_token = tok.convert_tokens_to_ids("<extra_0>")
    assert batch.step_mask.sum() == len(steps) == 3
    assert all(released_prm[i] == step_token for i in batch.score_index[0].tolist())


def test_papo_prompt_is_the_first_message_as_is(tok, tmp_path):
    user = QUESTION + " Please put the final answer in \\boxed{}."
    row = {"data_source": "numina_math_process", "prompt": [{"role": "user", "content": user}],
           "reward_model": {"ground_truth": "5"}, "extra_info": {"reference_solution": "n=5"}}
    text, ids = _policy_prompt("papo", row, tmp_path, tok)
    released = tok.apply_chat_template(row["prompt"], chat_template='{{ messages[0]["content"] }}',
                                       tokenize=False, add_generation_prompt=True)
    assert text == released == user
    assert ids == tok(released, add_special_tokens=False).input_ids


def test_prompt_format_settings_are_checked(tok):
    with pytest.raises(ConfigError, match="data.prompt_format"):
        DataConfig(prompt_format="template")
    with pytest.raises(ConfigError, match="data.prompt_template"):
        DataConfig(prompt_template="no placeholder")
    with pytest.raises(ConfigError, match="data.prompt_template"):
        DataConfig(prompt_template="{question} in \\boxed{}")  # single braces: format fails
    with pytest.raises(ConfigError, match="data.system_prompt"):
        DataConfig(system_prompt="be brief")  # needs prompt_format=chat

    class NoTemplate:
        chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        prompt_formatter(DataConfig(prompt_format="chat"), NoTemplate())
    # the chat format without a system message: the template's own default applies
    fmt = prompt_formatter(DataConfig(prompt_format="chat"), tok)
    assert fmt(QUESTION).startswith("<|im_start|>system\nPlease reason step by step")
    assert BOXED in fmt(QUESTION)

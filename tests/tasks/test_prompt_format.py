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

from megaprm.config import DataConfig, load_config
from megaprm.errors import ConfigError
from megaprm.rewards.scoring import (
    batch_from_rollouts,
    chat_batch_from_rollouts,
    resolve_prm_input_format,
)
from megaprm.rewards.steps import separator_token_ids
from megaprm.tasks.datasets import DataError
from megaprm.trainer.rl.data import encode_prompts, make_data, prompt_formatter
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
    file, read by the trainer's data phase (make_data: loaded, rendered, length-checked) and
    encoded as the trainer does."""
    path = tmp_path / f"{recipe}.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"),
                      [f"data.path={path}", "data.prompts_per_step=1", "data.on_bad_row=error"])
    (text,) = make_data(cfg, tok)(0).texts
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


# PRIME-RL/PRIME training/scripts/data_prepare.py:7-39 short_system_prompt, copied by hand
PRIME_SYSTEM = ("\nWhen tackling complex reasoning tasks, you have access to the following "
                "actions. Use them as needed to progress through your thought process.\n\n"
                "[ASSESS]\n\n[ADVANCE]\n\n[VERIFY]\n\n[SIMPLIFY]\n\n[SYNTHESIZE]\n\n[PIVOT]\n\n"
                "[OUTPUT]\n\nYou should strictly follow the format below:\n\n[ACTION NAME]\n\n"
                "# Your action step 1\n\n# Your action step 2\n\n# Your action step 3\n\n...\n\n"
                "Next action: [NEXT ACTION NAME]\n\n")
# README.md:96: Eurus-2-RL-Data's math instruction
PRIME_USER = QUESTION + "\n\nPresent the answer in LaTex format: \\boxed{Your answer}"


def test_prime_prompt_from_a_plain_row_and_from_a_release_row(tok, tmp_path):
    # data_prepare.py:55-64 builds [system, user: the row's instruction]; rl_dataset.py:132
    # applies the chat template with the generation prompt
    messages = [{"role": "system", "content": PRIME_SYSTEM},
                {"role": "user", "content": PRIME_USER}]
    released = ("<|im_start|>system\n" + PRIME_SYSTEM + "<|im_end|>\n"
                "<|im_start|>user\n" + PRIME_USER + "<|im_end|>\n<|im_start|>assistant\n")
    release_row = {"data_source": "numina_olympiads", "prompt": messages, "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": "5"},
                   "extra_info": {"split": "dummy", "index": 0}}
    from_release, ids = _policy_prompt("prime", release_row, tmp_path, tok)
    from_plain, ids2 = _policy_prompt("prime", {"problem": QUESTION, "answer": "5"}, tmp_path, tok)
    assert from_release == from_plain == released
    assert ids == ids2 == tok(released, add_special_tokens=False).input_ids
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


def test_papo_prompt_from_a_plain_row_and_from_a_release_row(tok, tmp_path):
    # data/convert_numina_math.py:27,51: one user message, system text + problem + instruction;
    # the 7B-base script's pass-through chat template `{{ messages[0]["content"] }}` (script:72)
    user = ("You are a knowledgeable math assistant. Answer the following questions and think "
            "step by step. " + QUESTION + " Please output the final answer within \\boxed{}.")
    row = {"data_source": "numina_math_process", "prompt": [{"role": "user", "content": user}],
           "reward_model": {"ground_truth": "5", "style": "llm_process"},
           "extra_info": {"question": QUESTION, "reference_solution": "n=5"}}
    released = tok.apply_chat_template(row["prompt"], chat_template='{{ messages[0]["content"] }}',
                                       tokenize=False, add_generation_prompt=True)
    from_release, ids = _policy_prompt("papo", row, tmp_path, tok)
    from_plain, ids2 = _policy_prompt(
        "papo", {"problem": QUESTION, "answer": "5", "solution": "n=5"}, tmp_path, tok)
    assert from_release == from_plain == released == user
    assert ids == ids2 == tok(released, add_special_tokens=False).input_ids


def test_pure_and_prof_plain_rows_equal_their_release_rows(tok, tmp_path):
    """PURE's release reads plain questions; a message row that already holds its instruction
    gives the same prompt, and PROF's verl row (above) likewise."""
    pure_user = ('{}\n\nPlease reason step by step with steps separated by "\n\n", and put your '
                 'final answer within \\boxed{{}}.').format(QUESTION)
    plain, ids = _policy_prompt("pure", {"question": QUESTION, "answer": "5"}, tmp_path, tok)
    msg, ids2 = _policy_prompt("pure", {"prompt": [{"role": "user", "content": pure_user}],
                                        "answer": "5"}, tmp_path, tok)
    assert plain == msg == pure_user and ids == ids2


@pytest.mark.parametrize("recipe, messages, why", [
    # PRIME: a user message without the system message, or without the instruction
    ("prime", [{"role": "user", "content": PRIME_USER}], "no system message"),
    ("prime", [{"role": "system", "content": PRIME_SYSTEM},
               {"role": "user", "content": QUESTION}], "not data.prompt_template"),
    # PAPO: the bare question, or a system message its pass-through template would print
    ("papo", [{"role": "user", "content": QUESTION}], "not data.prompt_template"),
    ("papo", [{"role": "system", "content": "s"}, {"role": "user", "content": QUESTION}],
     "a system message"),
    # PURE: a chat turn history
    ("pure", [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "5"}],
     "roles"),
])
def test_a_row_of_neither_layout_is_reported_by_name(recipe, messages, why, tok, tmp_path):
    good = {"problem": QUESTION, "answer": "5"}
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in
                              [good, {"prompt": messages, "answer": "5"}, good]) + "\n")
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"), [f"data.path={path}",
                                                          "data.prompts_per_step=2"])
    data = make_data(cfg, tok)
    report = data.report
    assert (report.loaded, report.skip_kinds["layout"]) == (2, 1)
    assert report.skipped[0][1] == 2 and why in report.skipped[0][2]
    assert "line 2: not this recipe's prompt layout" in report.summary()
    with pytest.raises(DataError, match=f"line 2: not this recipe's prompt layout.*{why}"):
        make_data(load_config(str(CONFIGS / f"{recipe}.yaml"),
                              [f"data.path={path}", "data.on_bad_row=error"]), tok)


def test_the_prompt_limit_counts_the_rendered_prompt(tok, tmp_path):
    """Each recipe's limit as released, counted on the rendered prompt's ids: a question that
    fits the limit bare but not with the recipe's system message and instruction is dropped by
    PRIME (rl_dataset.py:115-117) and cut to the limit by PURE (experience_maker.py:191-199)."""
    limits = {r: (c.data.max_prompt_tokens, c.data.long_prompt) for r, c in
              ((r, load_config(str(CONFIGS / f"{r}.yaml"))) for r in
               ("prime", "pure", "prof_grpo", "papo"))}
    assert limits == {"prime": (1024, "drop"), "pure": (1024, "truncate"),
                      "prof_grpo": (1024, "drop"), "papo": (2048, "drop")}
    long_q = "Let x be 7. " * 100
    bare = len(tok(long_q, add_special_tokens=False).input_ids)
    limit = bare + 10  # the bare question fits; rendered with the instruction it does not
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"problem": long_q, "answer": "7"}) + "\n"
                    + json.dumps({"problem": QUESTION, "answer": "5"}) + "\n")
    for recipe in ("prime", "pure"):
        cfg = load_config(str(CONFIGS / f"{recipe}.yaml"), [f"data.path={path}",
                                                              "data.prompts_per_step=2",
                                                              f"data.max_prompt_tokens={limit}"])
        data = make_data(cfg, tok)
        texts = data(0).texts
        if recipe == "prime":  # dropped: only the short question is left
            assert data.report.skip_kinds["too long"] == 1 and data.report.loaded == 1
            assert texts[0] == texts[1] and QUESTION in texts[0]
        else:  # PURE: cut to `limit` ids of the rendered prompt (its instruction was at the end)
            assert data.report.truncated == 1
            assert len(tok(texts[0], add_special_tokens=False).input_ids) == limit
            assert texts[0].startswith(long_q) and not texts[0].endswith("\\boxed{}.")


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

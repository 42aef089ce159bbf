"""PAPO's generative judge: prompt, grade parsing pinned to the released rules, and a tiny random
transformers model end to end through HFEngine on CPU."""
import string

import pytest
import torch

from megaprm.rewards import judge as J


def test_prompt_has_the_released_structure():
    p = J.build_judge_prompt("What is 2+2?", "2+2=4, so \\boxed{4}.", "It is \\boxed{4}.")
    # sections in the released order, each field once, the scale and the answer format
    heads = ["## Task", "## Grading scale", "## Problem", "## Reference Solution",
             "## Student Solution", "## Assessment"]
    pos = [p.index(h) for h in heads]
    assert pos == sorted(pos)
    assert p.index("What is 2+2?") > p.index("## Problem")
    assert p.index("2+2=4, so") > p.index("## Reference Solution")
    assert p.index("It is \\boxed{4}.") > p.index("## Student Solution")
    for grade in ("* 1:", "* 0.5:", "* 0:"):
        assert grade in p
    assert p.rstrip().endswith("Score: \\boxed{...}")
    # braces in the fields are not format fields
    assert "{x}" in J.build_judge_prompt("{x}", "r", "s")


@pytest.mark.parametrize("text,grade", [
    ("Analysis: fine.\n\nScore: \\boxed{1}", 1.0),
    ("Score: \\boxed{0.5}", 0.5),
    ("Score: \\boxed{ 0 }", 0.0),
    ("Score: \\boxed{1.0}", 1.0),
    ("first \\boxed{0} then \\boxed{1}", 1.0),          # the last box counts
    ("\\boxed{\\frac{1}{2}}", None),                    # not a number
    ("Score: \\boxed{0.7}", None),                      # off the scale, no fallback
    ("\\boxed{2}\nThe score is 0.5", 0.5),              # box off the scale -> regex fallback
    ("Final score: 1", 1.0),
    ("score is: 0.5", 0.5),
    ("Score: 1.\n", 1.0),
    ("SCORE: 1", None),                                 # the released regex is score|Score
    ("the score is 0.5 or score: 1", 0.5),              # the first regex match counts
    ("\\fbox{0.5}", 0.5),
    ("Score: \\boxed{...}", None),                      # the template echoed back
    ("\\boxed{1", None),                                # unbalanced
    ("", None),
])
def test_parse_grade(text, grade):
    assert J.parse_grade(text) == grade


def test_think_and_harmony_channels():
    assert J.strip_think("<think>Score: \\boxed{0}</think> ok") == "ok"
    raw = ("<|channel|>analysis<|message|>maybe \\boxed{0}<|end|><|start|>assistant"
           "<|channel|>final<|message|>Score: \\boxed{0.5}<|return|>")
    assert J.parse_grade(J.final_channel(raw)) == 0.5
    assert J.final_channel("plain \\boxed{1}") == "plain \\boxed{1}"
    # cut off in the analysis (max_tokens): the endpoint's content is empty, graded 0
    cut = "<|channel|>analysis<|message|>The student is right. Score: \\boxed{1}"
    assert J.final_channel(cut) == "" and J.parse_grade(J.final_channel(cut)) is None


class _CannedEngine:
    """Returns fixed grader answers (by prompt order) and records what it was asked."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers, self.prompts = tokenizer, list(answers), []

    def generate(self, prompts, params):
        self.prompts += prompts
        self.params = params
        answers, self.answers = self.answers[:len(prompts)], self.answers[len(prompts):]
        return canned_batch(self.tok, prompts, answers)


def canned_batch(tok, prompts, answers):
    """A RolloutBatch whose responses are the given answer texts (one per prompt)."""
    from megaprm.rollout.engine import RolloutBatch, left_pad

    ids, mask = left_pad(prompts, tok.pad_token_id, 1)
    rows = [tok(a, add_special_tokens=False).input_ids for a in answers]
    R = max(map(len, rows))
    resp = torch.full((len(rows), R), tok.pad_token_id)
    rmask = torch.zeros(len(rows), R, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, :len(r)] = torch.tensor(r)
        rmask[i, :len(r)] = 1
    return RolloutBatch(ids, mask, resp, rmask, torch.zeros(len(rows), R),
                        ["stop"] * len(rows), torch.arange(len(rows)), tok.pad_token_id)


def _printable_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def test_judges_correct_answers_only_and_scores_as_released():
    tok = _printable_tokenizer()
    outcome = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    responses = ["<think>hmm</think>x=4", "wrong", "  <think>only thinking</think> ", "x=4",
                 "x=4", "x=4", "also wrong"]
    refs = ["ref"] * 7
    refs[3] = None                                                  # no reference -> 0, no call
    answers = ["Score: \\boxed{0.5}", "garbage", "<think>\\boxed{0}</think>The score is 1"]
    eng = _CannedEngine(tok, answers)
    res = J.judge_process_scores(eng, tok, ["p"] * 7, refs, responses, outcome,
                                 J.JudgeConfig(max_tokens=8))
    # asked about rows 0, 4, 5 only (correct, with a reference and a non-empty solution)
    assert len(eng.prompts) == 3
    assert tok.decode(eng.prompts[0]) == J.build_judge_prompt("p", "ref", "x=4")
    assert eng.params.temperature == 0.1 and eng.params.n == 1
    assert res.judged.tolist() == [True, False, False, False, True, True, False]
    assert res.parsed.tolist() == [True, False, False, False, False, True, False]
    assert res.scores.tolist() == [0.5, 0, 0, 0, 0, 1.0, 0]
    assert res.metrics["judge/judged"] == 3 and res.metrics["judge/unparseable"] == 1
    assert res.metrics["judge/no_reference"] == 1 and res.metrics["judge/empty_solution"] == 1
    steps, mask = res.as_step_scores()
    assert steps.shape == (7, 1) and mask.all() and torch.equal(steps[:, 0], res.scores)


def test_papo_process_score_from_judge_reaches_the_estimator():
    """The judge's [B, 1] scores used as PAPO's p_i: the registry's PAPO advantage equals the
    estimator called directly on the grades."""
    from megaprm.algorithms import advantages as A
    from megaprm.algorithms.registry import AdvantageConfig, AdvantageInputs, compute_advantages

    tok = _printable_tokenizer()
    outcome = torch.tensor([1.0, 1.0, 1.0, 0.0])
    eng = _CannedEngine(tok, ["\\boxed{1}", "\\boxed{0.5}", "no grade"])
    res = J.judge_process_scores(eng, tok, ["p"] * 4, ["r"] * 4, ["a"] * 4, outcome)
    steps, mask = res.as_step_scores()
    gids = torch.zeros(4, dtype=torch.long)
    x = AdvantageInputs(outcome=outcome, group_ids=gids, response_mask=torch.ones(4, 3),
                        process_step_scores=steps, step_mask=mask)
    out = compute_advantages(AdvantageConfig(method="papo"), x)
    want = A.papo(outcome, torch.tensor([1.0, 0.5, 0.0, 0.0]), gids)
    assert torch.allclose(out.advantages[:, 0], want)


def test_tiny_random_grader_end_to_end_on_cpu(tmp_path):
    """A tiny random Qwen2 through megaprm's transformers engine: its grades are noise, so most
    or all are unparseable; every judged row is counted and scored exactly as parse_grade says
    (0 when unparseable), incorrect rows are never sent, and a fixed seed repeats the result."""
    from megaprm.models.tiny import build_hf_model, tiny_config
    from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig

    tok = _printable_tokenizer()
    model = build_hf_model(tiny_config("qwen2", vocab_size=len(tok), hidden_size=32, num_layers=2,
                                       num_heads=4, num_kv_heads=2, intermediate_size=64,
                                       max_position_embeddings=1024,
                                       eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id), seed=0)
    eng = HFEngine(model, HFEngineConfig(pad_token_id=tok.pad_token_id,
                                         eos_token_ids=(tok.eos_token_id,)))
    outcome = torch.tensor([1.0, 0.0, 1.0, 1.0])
    cfg = J.JudgeConfig(max_tokens=12, temperature=1.0, seed=3)
    args = (["1+1?"] * 4, ["1+1=2"] * 4, ["2", "3", "\\boxed{2}", "two"], outcome)
    res = J.judge_process_scores(eng, tok, *args, cfg)
    assert res.judged.tolist() == [True, False, True, True]
    for i in range(4):
        if res.judged[i]:
            grade = J.parse_grade(res.texts[i])
            assert bool(res.parsed[i]) == (grade is not None)
            assert res.scores[i].item() == (0.0 if grade is None else grade)
        else:
            assert res.texts[i] is None and res.scores[i] == 0
    assert res.metrics["judge/unparseable"] == 3 - int(res.parsed.sum())
    again = J.judge_process_scores(eng, tok, *args, cfg)
    assert again.texts == res.texts and torch.equal(again.scores, res.scores)


def test_judge_config_validation():
    with pytest.raises(ValueError, match="prm.judge.engine='api'"):
        J.JudgeConfig(engine="api")
    with pytest.raises(ValueError, match="prm.judge.max_tokens=0"):
        J.JudgeConfig(max_tokens=0)


def test_prompt_goes_through_the_graders_chat_template():
    """One user message, generation prompt added (the released chat-completions call)."""
    tok = _printable_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
                         "m['content'] + '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    eng = _CannedEngine(tok, ["Score: \\boxed{1}"])
    res = J.judge_process_scores(eng, tok, ["p"], ["r"], ["s"], torch.tensor([1.0]))
    want = ("<|im_start|>user\n" + J.build_judge_prompt("p", "r", "s")
            + "<|im_end|>\n<|im_start|>assistant\n")
    assert all(isinstance(t, int) for t in eng.prompts[0])
    assert tok.decode(eng.prompts[0]) == want
    assert res.scores.tolist() == [1.0]


# ------------------------------------------------------------------ PAPO's answer fallback

@pytest.mark.parametrize("text,verdict", [
    ("Same value.\nFinal Grade: CORRECT", True),
    ("final grade: incorrect", False),
    ("Final Grade: INCORRECT, though CORRECT in form", False),   # the verdict line decides
    ("This is CORRECT.", True),                                  # no line: a bare CORRECT
    ("Not CORRECT; INCORRECT.", False),
    ("", False),
])
def test_parse_verdict(text, verdict):
    assert J.parse_verdict(text) is verdict


def test_llm_fallback_asks_only_rule_failures_and_flips_on_correct():
    tok = _printable_tokenizer()
    outcome = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    responses = ["\\boxed{4}", "so \\boxed{2^2}", "<think>x</think>four", "<think>a</think>",
                 "\\boxed{5}"]
    eng = _CannedEngine(tok, ["Final Grade: CORRECT", "Final Grade: INCORRECT",
                              "<think>Final Grade: INCORRECT</think>CORRECT"])
    out, m = J.llm_answer_fallback(eng, tok, ["What is 2+2?"] * 5, ["4"] * 5, responses, outcome,
                                   J.JudgeConfig(max_tokens=8))
    # rows 1, 2, 4 asked (rule said wrong, non-empty answer); row 3's answer is empty
    assert len(eng.prompts) == 3
    assert tok.decode(eng.prompts[0]) == J.ANSWER_TEMPLATE.format(
        question="What is 2+2?", student="2^2", reference="4")
    assert tok.decode(eng.prompts[1]).startswith("Question: What is 2+2?\n\nStudent's Answer: "
                                                 "four\n")
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert m == {"reward/llm_fallback_asked_frac": 3 / 5,
                 "reward/llm_fallback_flipped_frac": 2 / 5}
    assert outcome.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the input is not modified

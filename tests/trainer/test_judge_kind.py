"""prm.kind=judge in the trainer: PAPO's generative grader scores the correct responses of a
tiny RL step on CPU; what reaches the estimator equals an independent judge_process_scores
call on the same texts, and incorrect responses score 0 without a grader call."""
import pytest
import torch

from megaprm.parallel import launch
from tests.rewards.test_judge import canned_batch
from tests.rl_setup import rl_config, tiny_policy_and_prm

JUDGE = ["prm.kind=judge", "prm.judge.max_tokens=6", "prm.judge.temperature=1.0",
         "prm.judge.seed=5", "rollout.max_tokens=8", "actor.micro_batch_size=8",
         "trainer.steps=1", "trainer.save_every=0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny policy + PRM, and a tiny causal-LM grader with room for the rubric prompt."""
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("models")
    policy, prm = tiny_policy_and_prm(root)
    tok = build_char_tokenizer()
    grader = save_tiny_model("qwen2", str(root / "grader"), seed=7, tokenizer=tok,
                             vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64, max_position_embeddings=2048,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return policy, prm, grader


class _Canned:
    """A grader engine with fixed answers (cycled), recording the prompts it gets."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.prompts, self.asleep = tok, answers, [], False

    def wake(self):
        self.asleep = False

    def sleep(self):
        self.asleep = True

    def generate(self, prompts, params):
        assert not self.asleep
        start = len(self.prompts)
        self.prompts += prompts
        return canned_batch(self.tok, prompts, [self.answers[(start + i) % len(self.answers)]
                                                for i in range(len(prompts))])


def _work(run_dir, policy, prm, grader, canned):
    """One PAPO step with the judge; half the responses forced correct. Records the judge's
    inputs and result, what the estimator got and gave, and the grader's prompts."""
    import megaprm.rewards.judge as J
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import advantage_phase as phase
    from megaprm.trainer.rl import loop

    g = init_distributed()
    cfg = rl_config(run_dir, policy, prm, "papo", [*JUDGE, f"prm.path={grader}"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    seen = {}
    if canned:
        tr.grader = _Canned(tr.grader_tok, ["\\boxed{1}", "\\boxed{0.5}", "12", "\\boxed{0}"])
    calls = []
    real_generate = tr.grader.generate

    def generate(prompts, params):
        calls.append(len(prompts))
        return real_generate(prompts, params)
    tr.grader.generate = generate
    real_outcome = tr.outcome_reward

    def outcome(batch, prompts, group_ids, step):
        sb = real_outcome(batch, prompts, group_ids, step)
        sb.outcome = (torch.arange(sb.outcome.numel()) % 3 == 0).float()
        return sb
    tr.outcome_reward = outcome
    real_judge, real_adv = J.judge_process_scores, phase.compute_advantages

    def judge(engine, tok, problems, refs, texts, outcome, jcfg):
        res = real_judge(engine, tok, problems, refs, texts, outcome, jcfg)
        seen["judge_args"] = (list(problems), list(refs), list(texts), outcome.clone(), jcfg)
        seen["judge"] = res
        return res

    def compute(acfg, inputs, **kw):
        out = real_adv(acfg, inputs, **kw)
        seen["inputs"], seen["out"] = inputs, out
        return out
    J.judge_process_scores, phase.compute_advantages = judge, compute
    hist = tr.fit()
    seen["calls"] = calls
    seen["group_ids"] = seen["inputs"].group_ids
    return hist[0], seen


def test_judge_scores_reach_the_estimator_as_an_independent_call_gives(models, tmp_path):
    from transformers import AutoTokenizer

    from megaprm.config import load_config
    from megaprm.rewards.judge import JudgeConfig, judge_process_scores
    from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig
    from megaprm.tasks.arithmetic import generate_problems, reference_solution
    from tests.rl_setup import DEMO_YAML

    policy, prm, grader = models
    m, seen = launch.spawn(_work, 1, str(tmp_path), policy, prm, grader, False)[0]
    problems, refs, texts, outcome, jcfg = seen["judge_args"]
    # the data carries the problem and the task's reference solution of each row's prompt
    cfg = load_config(DEMO_YAML, ["data.prompts_per_step=4"])
    probs = generate_problems(cfg.data.arithmetic, 4, seed=cfg.trainer.seed * 100_003)
    rows = seen["group_ids"].tolist()
    assert problems == [probs[i].prompt for i in rows]
    assert refs == [reference_solution(probs[i]) for i in rows]
    assert jcfg == JudgeConfig(max_tokens=6, temperature=1.0, seed=5)  # step 0, dp rank 0
    # an independent grader engine on the same texts gives the same grades and answers
    tok = AutoTokenizer.from_pretrained(grader)
    eng = HFEngine.from_pretrained(grader, HFEngineConfig(pad_token_id=tok.pad_token_id,
                                                          eos_token_ids=(tok.eos_token_id,)))
    want = judge_process_scores(eng, tok, problems, refs, texts, outcome, jcfg)
    assert want.texts == seen["judge"].texts
    x = seen["inputs"]
    assert torch.equal(x.process_step_scores[:, 0], want.scores)
    assert x.step_mask.shape == (len(texts), 1) and x.step_mask.all()
    # only correct responses are graded; incorrect ones score 0 without a call
    correct = outcome == 1
    assert seen["calls"] == [int(want.judged.sum())] and not want.judged[~correct].any()
    assert torch.all(x.process_step_scores[~correct] == 0)
    assert m["judge/judged"] == float(want.judged.sum())
    assert m["judge/unparseable"] == float((want.judged & ~want.parsed).sum())


def test_judge_grades_drive_papo_advantages(models, tmp_path):
    """With a grader that answers fixed grades, PAPO's advantages in the step are the
    estimator's on those grades (non-trivial process z-scores)."""
    from megaprm.algorithms import advantages as A

    policy, prm, grader = models
    m, seen = launch.spawn(_work, 1, str(tmp_path), policy, prm, grader, True)[0]
    _, _, texts, outcome, _ = seen["judge_args"]
    correct = (outcome == 1).nonzero()[:, 0].tolist()
    cycle = [1.0, 0.5, 0.0, 0.0]  # "12" is unparseable -> 0
    want = torch.zeros(len(texts))
    k = 0
    for i in correct:
        if texts[i].strip():
            want[i] = cycle[k % 4]
            k += 1
    assert seen["calls"] == [k]
    assert torch.equal(seen["inputs"].process_step_scores[:, 0], want)
    adv = A.papo(outcome, want, seen["group_ids"])
    assert torch.allclose(seen["out"].advantages[:, 0], adv, atol=1e-6)
    assert m["judge/unparseable"] == float(sum(1 for j in range(k) if j % 4 == 2))


def test_judge_config_and_recipe():
    import os

    from megaprm.config import load_config
    from megaprm.errors import ConfigError

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    papo = load_config(os.path.join(root, "papo.yaml"))
    assert papo.prm.kind == "judge" and papo.prm.path.endswith("gpt-oss-20b")
    assert (papo.prm.judge.temperature, papo.prm.judge.max_tokens) == (0.1, 16384)
    with pytest.raises(ConfigError, match=r"prm.path=None is not valid: prm.kind=judge needs"):
        load_config(None, ["prm.kind=judge", "advantage.method=papo"])
    with pytest.raises(ConfigError, match=r"advantage.method=pure places step rewards"):
        load_config(None, ["prm.kind=judge", "prm.path=x", "advantage.method=pure"])
    with pytest.raises(ConfigError, match=r"prm.judge.*temperature"):
        load_config(None, ["prm.kind=judge", "prm.path=x", "prm.judge.temperature=-1"])
    # PAPO's outcome: verl's prime_math rules, then the grader's answer fallback (USE_LLM_VERIFIER)
    assert (papo.reward.verifier, papo.reward.llm_fallback) == ("verl_prime_math", True)
    with pytest.raises(ConfigError, match=r"reward.llm_fallback asks the grader"):
        load_config(None, ["reward.llm_fallback=true"])
    with pytest.raises(ConfigError, match=r"reward.verifier='exact' is not valid"):
        load_config(None, ["reward.verifier=exact"])


def test_prompt_files_carry_the_reference_solution(tmp_path):
    """What PAPO's grader reads (llm_proof_grading.py:171-173): extra_info.reference_solution,
    else a reference_solution / solution column; extra_info.question as the problem."""
    import json

    from megaprm.config import load_config
    from megaprm.trainer.rl.data import make_data

    rows = [{"prompt": "p0", "answer": "1",
             "extra_info": {"reference_solution": "r0", "question": "q0"}},
            {"problem": "p1", "answer": "2", "solution": "so \\boxed{2}"},
            {"prompt": "p2", "answer": "3"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["data.task=math", f"data.path={path}", "data.prompts_per_step=3"])
    block = make_data(cfg)(0)
    assert block.texts == ["p0", "p1", "p2"] and block.truths == ["1", "2", "3"]
    assert block.problems == ["q0", "p1", "p2"]
    assert block.references == ["r0", "so \\boxed{2}", None]

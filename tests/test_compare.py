"""`megaprm compare` (issue 20) on a tiny budget, as users run it: 2 ranks, 2 methods, 1 seed,
learned and oracle process rewards, the reward-hacking run; its evaluation against an
independent greedy decode by transformers and the exact checker; resumability; the table's
statistics against the statistics module; bad input -> one line, exit 2."""
import json
import os
import statistics

import pytest

from megaprm import compare
from tests.test_megaprm_cli import MEGAPRM, one_line_error, run

TINY = ["--methods", "grpo,prof_grpo", "--seeds", "1", "--oracle", "grpo,prof_grpo",
        "--rl-steps", "2", "--hack-steps", "2", "--eval-problems", "16", "--sampled-n", "2",
        "--warmup-steps", "100", "--prm-steps", "20", "--prm-examples", "256",
        "--wandb", "disabled", "--nproc", "2", "trainer.progress=false"]


def _greedy_reference(model_dir, problems):
    """transformers' own greedy decode, one problem at a time, checked step by step."""
    import torch
    from transformers import AutoModelForCausalLM

    from megaprm.tasks.arithmetic import check_steps
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    correct = clean = wrong = 0
    for p in problems:
        ids = torch.tensor([tok.encode(p.prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=64,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        resp = out[0, ids.shape[1]:].tolist()
        stopped = tok.eos_token_id in resp
        if stopped:
            resp = resp[:resp.index(tok.eos_token_id) + 1]
        text = tok.decode(resp, skip_special_tokens=True)
        c = check_steps(p, text, ends_with_eos=stopped)
        correct += c.final_correct
        wrong += c.correct_with_wrong_step
        clean += c.all_steps_correct and c.final_correct
    n = len(problems)
    return {"accuracy": correct / n, "all_steps_correct": clean / n,
            "correct_with_wrong_step": wrong / max(correct, 1)}


def test_compare_tiny_end_to_end_resumable(tmp_path):
    rd = tmp_path / "cmp"
    p = run([*MEGAPRM, "compare", "--run-dir", str(rd), *TINY], timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(rd / "compare.json"))
    rows = {(r["method"], r["prm"]): r for r in rep["rows"]}
    assert set(rows) == {("grpo", "learned"), ("prof_grpo", "learned"),
                         ("prof_grpo", "oracle"), ("grpo", "oracle")}
    # GRPO reads no step scores: its oracle row is its learned run, said so, not re-run
    assert rows[("grpo", "oracle")]["same_run_as_learned"]
    assert not os.path.isdir(rd / "rl" / "grpo-oracle-s0")
    for name in ("grpo-learned-s0", "prof_grpo-learned-s0", "prof_grpo-oracle-s0",
                 "hack-pure-prm-only-s0"):
        res = json.load(open(rd / "rl" / name / "result.json"))
        metrics = [json.loads(x) for x in open(rd / "rl" / name / "metrics.jsonl")]
        assert [m["step"] for m in metrics] == [0, 1]
        assert res["curves"]["reward/outcome_mean"] == [m["reward/outcome_mean"]
                                                        for m in metrics]
        assert res["sampled"]["problems"] == 16 and res["sampled"]["samples"] == 32
    hack = json.load(open(rd / "rl" / "hack-pure-prm-only-s0" / "result.json"))
    assert "advantage.pure.reward_mode=PRM" in hack["overrides"]
    assert rep["hack"]["curves"]["prm/outcome_agreement"]

    # the baseline row is the warm-up policy's greedy accuracy as transformers decodes it
    problems = compare.eval_problems(compare.CompareConfig(eval_problems=16))
    ref = _greedy_reference(str(rd / "sft"), problems)
    base = rep["baseline"]["greedy"]
    for k in ("accuracy", "all_steps_correct", "correct_with_wrong_step"):
        assert base[k] == pytest.approx(ref[k]), (k, base, ref)
    assert ref["accuracy"] > 0  # the warm-up learned something: the check is not vacuous

    # table, plots
    md = open(rd / "compare.md").read()
    assert "| prof_grpo | oracle |" in md and "Reward hacking" in md
    for png in ("compare_bars.png", "compare_curves.png", "reward_hacking.png"):
        assert os.path.getsize(rd / "plots" / png) > 10_000

    # resumable: a second call re-runs nothing; a lost result re-runs that run alone, and the
    # seeded run reproduces its numbers
    first = json.load(open(rd / "rl" / "prof_grpo-learned-s0" / "result.json"))
    mtime = os.path.getmtime(rd / "rl" / "grpo-learned-s0" / "result.json")
    os.remove(rd / "rl" / "prof_grpo-learned-s0" / "result.json")
    p = run([*MEGAPRM, "compare", "--run-dir", str(rd), *TINY], timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "warm-up: reusing" in p.stdout and "PRM: reusing" in p.stdout, p.stdout
    assert os.path.getmtime(rd / "rl" / "grpo-learned-s0" / "result.json") == mtime
    again = json.load(open(rd / "rl" / "prof_grpo-learned-s0" / "result.json"))
    assert again["greedy"] == first["greedy"] and again["sampled"] == first["sampled"]
    assert again["curves"] == first["curves"]


def test_mean_ci_matches_statistics_module():
    xs = [0.62, 0.70, 0.81]
    got = compare.mean_ci(xs)
    assert got["mean"] == pytest.approx(statistics.mean(xs))
    # t_{0.975, 2} = 4.303 (two-sided 95%, 2 degrees of freedom)
    assert got["ci95"] == pytest.approx(4.303 * statistics.stdev(xs) / 3 ** 0.5)
    assert compare.mean_ci([0.5])["ci95"] is None and compare.mean_ci([])["mean"] is None


def test_aggregate_rows_per_method_and_reward():
    ccfg = compare.CompareConfig(methods=("grpo", "papo"), seeds=2, oracle=("grpo", "papo"))
    runs = compare.plan(ccfg)
    assert [r.name for r in runs] == ["grpo-learned-s0", "grpo-learned-s1", "papo-learned-s0",
                                      "papo-learned-s1", "papo-oracle-s0", "papo-oracle-s1",
                                      "hack-pure-prm-only-s0"]
    results = []
    for i, r in enumerate(runs):
        results.append({**r.__dict__, "name": r.name,
                        "greedy": {"accuracy": 0.1 * i, "all_steps_correct": 0.0,
                                   "correct_with_wrong_step": 0.0},
                        "sampled": {"accuracy": 0.0, "correct_with_wrong_step": 0.0},
                        "train_end": {}, "curves": {}})
    rows = {(r["method"], r["prm"]): r for r in compare.aggregate(results, ccfg)}
    assert rows[("papo", "oracle")]["greedy accuracy"]["per_seed"] == pytest.approx([0.4, 0.5])
    assert rows[("grpo", "oracle")]["greedy accuracy"] == rows[("grpo", "learned")][
        "greedy accuracy"]
    assert rows[("grpo", "oracle")]["same_run_as_learned"]
    assert ("pure", "learned") not in rows  # the reward-hacking run is reported apart


@pytest.mark.parametrize("args,needle", [
    (["--methods", "grpo,nosuch"], "unknown method(s) ['nosuch']"),
    (["--methods", "grpo", "--oracle", "papo"], "add it to --methods"),
    (["--methods", "grpo", "--oracle", "", "actor.nosuch=1"], "actor.nosuch"),
])
def test_compare_bad_input_one_line(tmp_path, args, needle):
    p = run([*MEGAPRM, "compare", "--run-dir", str(tmp_path / "x"), *args])
    one_line_error(p, "megaprm compare: error:", needle)
    assert not os.path.exists(tmp_path / "x")

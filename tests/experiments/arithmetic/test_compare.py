"""`megaprm compare` on a tiny budget, as users run it: 2 ranks, 2 methods,
1 seed, learned and oracle process rewards, the reward-hacking run; killed after its first cell
and resumed, then re-evaluated at a larger size from its final checkpoints; its evaluation
against an independent greedy decode by transformers and the exact checker; the paired design
(same seed, same step-0 samples across methods); the docs generated from the report; bad
input -> one line, exit 2. The statistics (the rows `stats.aggregate` makes of the cells
included): test_stats.py; the tables: test_report.py."""
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from megaprm.experiments.arithmetic import compare, report, runs
from tests.test_megaprm_cli import MEGAPRM, ROOT, one_line_error, run

TINY = ["--methods", "grpo,prof_grpo", "--seeds", "1", "--oracle", "grpo,prof_grpo",
        "--rl-steps", "2", "--hack-steps", "2", "--eval-problems", "32", "--sampled-n", "2",
        "--warmup-steps", "300", "--prm-steps", "20", "--prm-examples", "256",
        "--wandb", "disabled", "--bootstrap-reps", "200", "--nproc", "2",
        "trainer.progress=false"]


def _greedy_reference(model_dir, problems):
    """transformers' own greedy decode, one problem at a time, checked step by step."""
    import torch
    from transformers import AutoModelForCausalLM

    from megaprm.tasks.arithmetic import check_steps
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    correct, clean, wrong, first = [], [], [], []
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
        correct.append(int(c.final_correct))
        wrong.append(int(c.correct_with_wrong_step))
        clean.append(int(c.all_steps_correct and c.final_correct))
        first.append(int(bool(c.step_correct) and c.step_correct[0]))
    n = len(problems)
    return {"accuracy": sum(correct) / n, "all_steps_correct": sum(clean) / n,
            "correct_with_wrong_step": sum(wrong) / max(sum(correct), 1),
            "first_step_correct": sum(first) / n,
            "per_problem": {"correct": correct, "wrong_step": wrong, "clean": clean}}


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def _run_until_killed(args, done_file, next_started, next_done, log, timeout=1200):
    """Start `megaprm compare`, kill its whole process group (launcher and ranks) once
    `done_file` exists and the next cell has begun (`next_started` exists) but not finished
    (`next_done` does not): a run stopped in the middle of its next cell. (A fixed wait after
    the first cell was not: on a faster box a 2-step cell finished within it.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        t0 = time.time()
        try:
            while not (os.path.exists(done_file) and os.path.exists(next_started)):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.time() - t0 < timeout, "the first cell never finished"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(next_done), "the next cell finished before the kill"
    for _ in range(40):  # no process of the group is left behind
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.25)
    else:
        raise AssertionError("a process of the killed run is still alive")


@pytest.mark.slow
@pytest.mark.learning
def test_compare_tiny_end_to_end_killed_and_resumed(tmp_path):
    rd = tmp_path / "cmp"
    st = rd / "start0"  # the one start's warm-up, PRM, baseline and cells
    first = st / "rl" / "grpo-learned-s0" / "result.json"
    second = st / "rl" / "prof_grpo-learned-s0"
    _run_until_killed([*MEGAPRM, "compare", "--run-dir", str(rd), *TINY], first,
                      second / "metrics.jsonl", second / "result.json", tmp_path / "killed.log")
    mtime = os.path.getmtime(first)
    assert not os.path.exists(rd / "compare.json")  # killed before the end
    # resumed: the finished cell is read back, not re-run; the rest runs, and what a resumed run
    # reads back is kept in a state directory too (--state-dir; restored at the end below)
    state = tmp_path / "state"
    p = run([*MEGAPRM, "compare", "--run-dir", str(rd), *TINY, "--state-dir", str(state)],
            timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "restored 0 unit(s)" in p.stdout and "file(s) saved to" in p.stdout, p.stdout
    assert "warm-up: reusing" in p.stdout and "PRM: reusing" in p.stdout, p.stdout
    assert "grpo-learned-s0: reusing the finished run" in p.stdout, p.stdout
    assert "prof_grpo-learned-s0: reusing" not in p.stdout
    # the progress line estimates the rest from the finished cells' recorded cost (3 cells
    # and the hack run: each line but the last has some to go)
    assert p.stdout.count(" cell(s) to go ~") == 3, p.stdout
    assert os.path.getmtime(first) == mtime
    rep = _load(rd / "compare.json")
    assert rep["missing"] == [] and len(rep["planned"]) == 4
    assert rep["config"]["bootstrap_reps"] == 200  # --bootstrap-reps reaches the intervals
    # what another machine needs to rebuild it: the commit, the code versions, torch, the CPU;
    # no absolute path (compare.json is committed)
    prov = rep["provenance"]
    assert len(prov["commit"]) == 40 and prov["torch"] == __import__("torch").__version__
    assert prov["start_code"]["code"] and prov["cells_by_rl_code"] == {
        prov["rl_code"]["code"]: 4}
    assert prov["cpu"]["aten_capability"] and prov["cpu"]["cores"]
    assert prov["cells_by_cpu"] == {
        f"{prov['cpu']['model']} (ATen {prov['cpu']['aten_capability']})": 4}
    def strings(x):
        if isinstance(x, dict):
            return [s for v in x.values() for s in strings(v)]
        return [s for v in x for s in strings(v)] if isinstance(x, list) else [x]
    assert not [s for s in strings(rep) if isinstance(s, str) and s.startswith("/")]
    # the start's PRM judged as the field does: first-error F1 and step AUROC per error kind
    judged = rep["starts"][0]["prm_judged"]
    assert 0 <= judged["f1"] <= 1 and judged["solutions"] == compare.JUDGE_SOLUTIONS
    assert set(judged["per_kind"]) >= {"reference", "wrong_result", "truncated"}
    rows = {(r["method"], r["prm"]): r for r in rep["rows"]}
    assert set(rows) == {("grpo", "learned"), ("prof_grpo", "learned"),
                         ("prof_grpo", "oracle"), ("grpo", "oracle")}
    # GRPO reads no step scores: its oracle row is its learned run, said so, not re-run
    assert rows[("grpo", "oracle")]["same_run_as_learned"]
    assert not os.path.isdir(st / "rl" / "grpo-oracle-s0")
    res = {}
    for name in ("grpo-learned-s0", "prof_grpo-learned-s0", "prof_grpo-oracle-s0",
                 "hack-pure-prm-only-s0"):
        res[name] = _load(st / "rl" / name / "result.json")
        metrics = _lines(st / "rl" / name / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [0, 1]
        assert res[name]["curves"]["reward/outcome_mean"] == [m["reward/outcome_mean"]
                                                              for m in metrics]
        assert res[name]["sampled"]["problems"] == 32 and res[name]["sampled"]["samples"] == 64
        for ev in ("greedy", "sampled"):  # the per-problem counts add up to the totals
            e = res[name][ev]
            pp = e["per_problem"]
            assert len(pp["correct"]) == 32
            assert sum(pp["correct"]) / e["samples"] == pytest.approx(e["accuracy"])
            assert sum(pp["wrong_step"]) / max(sum(pp["correct"]), 1) == pytest.approx(
                e["correct_with_wrong_step"])
    hack = res["hack-pure-prm-only-s0"]
    assert "advantage.pure.reward_mode=PRM" in hack["overrides"]
    assert rep["hack"]["curves"]["prm/outcome_agreement"]

    # paired design: the same seed samples the same responses at step 0 (same warm-up, prompts
    # and sampling seed), whichever method (these are rollout-side monitors, before any update);
    # the (killed and re-run) PROF-GRPO cell reproduces GRPO's step 0 in another process
    m0 = {n: _lines(st / "rl" / n / "metrics.jsonl")[0]
          for n in ("grpo-learned-s0", "prof_grpo-learned-s0", "prof_grpo-oracle-s0")}
    for k in ("reward/outcome_mean", "response/length_mean", "exact/correct_with_wrong_step_frac"):
        assert m0["grpo-learned-s0"][k] == m0["prof_grpo-learned-s0"][k] == \
            m0["prof_grpo-oracle-s0"][k], k

    # the paired difference of the report is each seed's own difference
    d = rows[("prof_grpo", "learned")]["paired"]["greedy accuracy"]
    assert d["per_seed"] == pytest.approx([res["prof_grpo-learned-s0"]["greedy"]["accuracy"]
                                           - res["grpo-learned-s0"]["greedy"]["accuracy"]])
    assert d["lo"] <= d["mean"] <= d["hi"]

    # the baseline row is the warm-up policy's greedy accuracy as transformers decodes it
    problems = runs.held_out_problems(32)
    ref = _greedy_reference(str(st / "sft"), problems)
    base = rep["baseline"]["greedy"]
    for k in ("accuracy", "all_steps_correct", "correct_with_wrong_step"):
        assert base[k] == pytest.approx(ref[k]), (k, base, ref)
    # problem by problem, not only the sums (compare.json keeps the sums; baseline.json all)
    assert _load(st / "baseline.json")["greedy"]["per_problem"] == ref["per_problem"]
    # The check is not vacuous: the warm-up solves some problems. A training outcome, so its
    # budget (TINY's --warmup-steps, --eval-problems) holds with a margin on every CPU kernel
    # path and seed measured (docs/testing.md; with 100 steps and 16 problems it solved 0-3
    # and failed on an AVX-512 CPU).
    assert sum(ref["per_problem"]["correct"]) >= 1, ref

    # table, plots
    md = (rd / "compare.md").read_text()
    assert "| prof_grpo | oracle |" in md and "Reward hacking" in md and "Paired difference" in md
    for png in ("compare_bars.png", "compare_paired.png", "compare_curves.png",
                "reward_hacking.png"):
        assert os.path.getsize(rd / "plots" / png) > 10_000

    # the docs are generated from the report alone: --from-json writes the blocks that
    # --only-finished (no new run) writes from the run directory
    for name in ("README.md", "compare.md"):
        (tmp_path / name).write_text("x\n<!-- megaprm:compare begin -->\n<!-- megaprm:compare "
                                     "end -->\ny\n")
    docs = ["--write-readme", "--readme", str(tmp_path / "README.md"),
            "--doc", str(tmp_path / "compare.md")]
    p = run([*MEGAPRM, "compare", "--from-json", str(rd / "compare.json"), *docs])
    assert p.returncode == 0, p.stderr[-3000:]
    from_json = (tmp_path / "README.md").read_text(), (tmp_path / "compare.md").read_text()
    assert "| prof_grpo, learned | 1 |" in from_json[0], from_json[0]
    assert report.markdown(rep, title=False).strip() in from_json[1]
    (tmp_path / "README.md").write_text("x\n<!-- megaprm:compare begin -->\n<!-- megaprm:compare "
                                        "end -->\ny\n")
    # ... and from the state alone, on a "fresh machine" whose run directory is gone: the
    # start's two stages, its baseline and PRM judgement and the four cells are restored
    fresh = tmp_path / "fresh"
    p = run([*MEGAPRM, "compare", "--run-dir", str(fresh), *TINY, "--only-finished", *docs,
             "--state-dir", str(state)], timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restored 8 unit(s)" in p.stdout, p.stdout
    assert p.stdout.count("reusing the finished run") == 4, p.stdout  # nothing re-run
    assert os.path.getmtime(first) == mtime
    again = _load(fresh / "compare.json")
    assert again["rows"] == rep["rows"]  # read back from disk: the same rows, same intervals
    assert not os.path.exists(fresh / "start0" / "init")  # not needed, not kept

    # a larger evaluation of the same runs: each finished cell's final policy is exported from
    # its last checkpoint and evaluated again; nothing is trained again
    bigger = [*TINY]
    bigger[bigger.index("--eval-problems") + 1] = "48"
    p = run([*MEGAPRM, "compare", "--run-dir", str(rd), *bigger], timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("re-evaluating its final policy") == 4, p.stdout
    assert "reusing the finished run" not in p.stdout and "moved to" not in p.stdout
    problems = runs.held_out_problems(48)
    for name, old in res.items():
        cell = st / "rl" / name
        new = _load(cell / "result.json")
        assert new["reevaluated"]["problems_before"] == 32
        assert new["greedy"]["problems"] == new["sampled"]["problems"] == 48
        assert new["rl_s"] == old["rl_s"] and new["curves"] == old["curves"]  # not re-trained
        assert [m["step"] for m in _lines(cell / "metrics.jsonl")] == [0, 1]
        assert _load(cell / f"result.{old['digest'][:8]}.json") == old  # the earlier one kept
        # on the first 32 problems it is the run's own evaluation, problem by problem
        for k, v in old["greedy"]["per_problem"].items():
            assert new["greedy"]["per_problem"][k][:32] == v, (name, k)
    # the policy evaluated is the one the run ended with: transformers' own greedy decode of
    # its last checkpoint, exported by the conversion tool with its logit check (one cell: an
    # export with its check starts ranks, ~1-2 min each on a loaded 2-core box)
    out = tmp_path / "grpo-learned-s0-hf"
    c = run([*MEGAPRM, "convert", "export-hf", "--ckpt", str(st / "rl" / "grpo-learned-s0"),
             "--out", str(out)], timeout=600)
    assert c.returncode == 0, c.stderr[-3000:]
    assert _load(st / "rl" / "grpo-learned-s0" / "result.json")["greedy"]["per_problem"] == \
        _greedy_reference(str(out), problems)["per_problem"]
    assert not os.path.exists(st / "reevaluated")  # the exported policies are not kept
    assert _load(rd / "compare.json")["eval_problems"] == 48


def test_plan_is_seed_major_with_fewer_seeds_for_some_rows():
    ccfg = runs.CompareConfig(methods=("grpo", "papo", "prime_scaled"), seeds=2,
                                 method_seeds={"prime_scaled": 1}, oracle=("grpo", "papo"))
    assert [r.name for r in runs.plan(ccfg)] == [
        "grpo-learned-s0", "papo-learned-s0", "prime_scaled-implicit-s0", "papo-oracle-s0",
        "grpo-learned-s1", "papo-learned-s1", "papo-oracle-s1", "hack-pure-prm-only-s0"]
    # starts are the outer level: start 0's cells (and the hack run, paired with start 0's
    # seed 0), then start 1's, in the same order
    two = runs.plan(runs.CompareConfig(methods=("grpo", "papo"), seeds=1, oracle=(),
                                       starts=2))
    assert [(r.start, r.name) for r in two] == [
        (0, "grpo-learned-s0"), (0, "papo-learned-s0"), (0, "hack-pure-prm-only-s0"),
        (1, "grpo-learned-s0"), (1, "papo-learned-s0")]
    # the variant runs PRIME with its own beta on top of PRIME's overrides; seed s is the
    # trainer seed of every row's run s (the paired design)
    ov = runs.run_overrides(runs.RunSpec("prime_scaled", "implicit", 1), ccfg, "S", "P")
    assert "advantage.method=prime" in ov and "prm.kind=implicit" in ov
    assert ov.index("prm.beta=1.0") > ov.index("prm.kind=implicit")
    assert "trainer.seed=1" in ov
    assert "trainer.seed=1" in runs.run_overrides(runs.RunSpec("grpo", "learned", 1),
                                                     ccfg, "S", "P")


def test_method_seeds_checked():
    with pytest.raises(ValueError, match="between 1 and --seeds"):
        runs.CompareConfig(methods=("grpo",), seeds=2, method_seeds={"grpo": 3}, oracle=())
    with pytest.raises(ValueError, match="unknown method"):
        runs.CompareConfig(methods=("grpo",), method_seeds={"nosuch": 1}, oracle=())


@pytest.mark.parametrize("args,needle", [
    (["--methods", "grpo,nosuch"], "unknown method(s) ['nosuch']"),
    (["--methods", "grpo", "--oracle", "papo"], "add it to --methods"),
    (["--methods", "grpo", "--oracle", "", "actor.nosuch=1"], "actor.nosuch"),
    (["--from-json", "nosuch.json"], "--from-json nosuch.json: no such file"),
    # a fresh directory: nothing to report, and nothing is trained to find that out
    (["--only-finished"], "has no warm-up, no PRM, no finished run with these settings"),
    (["--bootstrap-reps", "20"], "--bootstrap-reps 20: give at least 100"),
])
def test_compare_bad_input_one_line(tmp_path, args, needle):
    p = run([*MEGAPRM, "compare", "--run-dir", str(tmp_path / "x"), *args])
    one_line_error(p, "megaprm compare: error:", needle)
    assert not os.path.exists(tmp_path / "x")


def test_only_finished_needs_the_stages_and_a_finished_run(tmp_path):
    """The check names what is missing: with this comparison's warm-up and PRM marked done (the
    markers the stages write) but no finished cell it still refuses; a stage of other settings
    counts as missing; one result.json lets it through. A start built by another commit's code
    is not reused by a run (its key holds the code's version) but is reported by
    --only-finished, which trains nothing, with `same_code` false."""
    ccfg = runs.CompareConfig(run_dir=str(tmp_path), methods=("grpo",), seeds=1, oracle=())
    st = tmp_path / "start0"
    code = compare.code_version()
    wcfg = compare._warmup_config(ccfg, 0)
    os.makedirs(st / "sft")
    os.makedirs(st / "prm")
    compare.mark_stage_done(str(st / "sft"), compare.warmup_digest(wcfg, code), _Rank0(),
                            settings=compare.warmup_digest(wcfg), code=code)
    compare.mark_stage_done(str(st / "prm"), "x", _Rank0(), settings="other settings")
    with pytest.raises(ValueError, match=r"has no PRM, no finished run with these settings"):
        compare.check_only_finished(ccfg)
    assert compare.recorded_start(ccfg, 0, code) is None
    other_code = {**code, "code": "0" * 16}  # the same recipe built by another commit
    compare.mark_stage_done(str(st / "prm"), compare._prm_digest(ccfg, 0, other_code), _Rank0(),
                            settings=compare._prm_digest(ccfg, 0, None), code=other_code)
    with pytest.raises(ValueError, match=r"has no finished run with these settings"):
        compare.check_only_finished(ccfg)
    os.makedirs(st / "rl" / "grpo-learned-s0")
    (st / "rl" / "grpo-learned-s0" / "result.json").write_text("{}")
    compare.check_only_finished(ccfg)
    rec = compare.recorded_start(ccfg, 0, code)
    assert rec is not None and rec["same_code"] is False and rec["settings_checked"]
    # a run would not reuse it: the PRM stage's key under this code is another
    assert compare.cached_stage(str(st / "prm"), compare._prm_digest(ccfg, 0, code)) is None
    compare.mark_stage_done(str(st / "prm"), compare._prm_digest(ccfg, 0, code), _Rank0(),
                            settings=compare._prm_digest(ccfg, 0, None), code=code)
    assert compare.recorded_start(ccfg, 0, code)["same_code"] is True


class _Rank0:
    rank, world_size = 0, 1


def test_a_second_compare_on_one_run_dir_is_refused(tmp_path, monkeypatch, capsys):
    """`megaprm compare` took no lock on its run directory: a second one there trained into the
    same warm-up, PRM and cells. It is refused in one line naming the holder, before any rank;
    the lock goes with the first."""
    from megaprm import cli
    from megaprm.parallel import launch, ray_launch
    from megaprm.trainer.run_lock import RunLock

    def no_ranks(*a, **k):
        raise AssertionError("the second compare started ranks")

    monkeypatch.setattr(launch, "relaunch", no_ranks)
    monkeypatch.setattr(ray_launch, "relaunch", no_ranks)
    monkeypatch.delenv(launch.ERROR_DIR_ENV, raising=False)
    first = RunLock(str(tmp_path)).acquire()  # a compare running there
    try:
        capsys.readouterr()
        assert cli.main(["compare", "--run-dir", str(tmp_path), "--nproc", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("megaprm compare: error:"), err
        assert str(os.getpid()) in err[0], err
    finally:
        first.release()


def test_the_long_task_runs_to_150_tokens_with_its_own_overrides():
    """The long task's solutions run to >= 150 tokens (median, char tokenizer) and every one fits
    its rollout budget; its RL runs get its task and budget as overrides, which the trainer's
    config accepts."""
    from megaprm.config import load_config
    from megaprm.tasks.arithmetic import generate_problems, reference_solution
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    lens = sorted(len(tok.encode(reference_solution(p), add_special_tokens=False)) + 1
                  for p in generate_problems(runs.TASKS["long"], 400, seed=3))
    assert lens[len(lens) // 2] >= 150 and lens[0] >= 110
    assert lens[-1] <= runs.MAX_TOKENS["long"]
    ccfg = runs.CompareConfig(task="long", methods=("grpo",), oracle=())
    ov = runs.run_overrides(runs.RunSpec("grpo", "learned", 0), ccfg, "S", "P")
    cfg = load_config(runs.RL_YAML, ov)
    assert cfg.data.arithmetic == runs.TASKS["long"] and cfg.rollout.max_tokens == 224
    assert runs.held_out_problems(5, "long") == generate_problems(
        runs.TASKS["long"], 5, seed=__import__("megaprm.trainer.rl.data", fromlist=["x"]
                                               ).HELD_OUT_SEED)
    with pytest.raises(ValueError, match="--task nosuch: unknown task"):
        runs.CompareConfig(task="nosuch")


def _prm_from_warmup(rank, world_size, run_dir):
    """start 0's PRM stage with prm_init "warmup" and no whole-model step (only the 20
    head-only steps of the recipe's stage 1), on a small warm-up policy written in run_dir."""
    from megaprm.experiments.arithmetic.start import WarmupConfig, init_policy
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer

    g = init_distributed(tp=1, pp=1)
    tok = build_char_tokenizer()
    ccfg = runs.CompareConfig(run_dir=run_dir, prm_init="warmup", prm_steps=0, prm_examples=64)
    sft = init_policy(WarmupConfig(hidden=48, layers=2), tok,
                      os.path.join(run_dir, "start0", "sft"), g.rank)
    prm_dir, rec = compare.prm_stage(ccfg, g, tok, 0, compare.code_version(), sft)
    return prm_dir, {k: v for k, v in rec.items() if k != "per_kind"}


def test_a_prm_from_the_warmup_policy_is_its_trunk_and_keyed_by_it(tmp_path):
    """prm_init "warmup" (the long task's): start k's PRM is fine-tuned from start k's warm-up
    policy, not a random-init hidden-64 trunk: after the head-only stage every trunk tensor is
    the policy's, bit for bit, and no random trunk is written; its cache key holds the
    warm-up's, which a random-init PRM's key does not."""
    from dataclasses import replace

    from safetensors import safe_open

    from tests.distributed_utils import run_distributed

    [(prm_dir, rec)] = run_distributed(_prm_from_warmup, 1, str(tmp_path), timeout=600)
    assert rec["init"] == "warmup" and "hidden 48, 2 layers" in rec["trunk"], rec
    assert not os.path.exists(tmp_path / "start0" / "prm_init")
    with safe_open(os.path.join(prm_dir, "model.safetensors"), "pt") as prm, \
            safe_open(str(tmp_path / "start0" / "sft" / "model.safetensors"), "pt") as sft:
        trunk = [k for k in sft.keys() if k.startswith("model.")]
        assert len(trunk) > 10 and set(trunk) <= set(prm.keys())
        for k in trunk:
            assert prm.get_tensor(k).equal(sft.get_tensor(k)), k
        assert set(prm.keys()) - set(sft.keys())  # its own score head

    code = compare.code_version()
    warm = runs.CompareConfig(task="long")
    assert warm.prm_init == "random"  # the dataclass's default; the CLI applies the task's
    warm = replace(warm, prm_init=runs.TASK_DEFAULTS["long"]["prm_init"])
    assert warm.prm_init == "warmup"
    other_warmup = replace(warm, warmup_steps=warm.warmup_steps + 1)
    assert compare._prm_digest(warm, 0, code) != compare._prm_digest(other_warmup, 0, code)
    assert compare._prm_digest(warm, 0, None) != compare._prm_digest(other_warmup, 0, None)
    rand = replace(warm, prm_init="random")
    assert compare._prm_digest(rand, 0, code) == compare._prm_digest(
        replace(rand, warmup_steps=rand.warmup_steps + 1), 0, code)
    assert compare._prm_digest(rand, 0, code) != compare._prm_digest(warm, 0, code)
    with pytest.raises(ValueError, match="--prm-init nosuch: choose from"):
        runs.CompareConfig(prm_init="nosuch")


def test_a_cell_of_other_settings_is_moved_aside_not_deleted(tmp_path, capsys):
    """A comparison run with other flags into a finished one's run directory used to delete
    each finished cell it re-ran (its digest differs). An interrupted cell (no result.json) is
    still removed, as it restarts from step 0; a finished one of other settings is moved to
    rl/superseded/NAME.DIGEST8 whole, and a second one of the same settings beside it."""
    rl = tmp_path / "start0" / "rl"
    cell = rl / "prime-implicit-s0"

    def finished(digest, marker):
        os.makedirs(cell)
        (cell / "result.json").write_text(json.dumps({"digest": digest}))
        (cell / "metrics.jsonl").write_text(marker)
        return compare._read_json(str(cell / "result.json"))

    compare._make_room(str(cell), None, _Rank0())  # nothing there: nothing to do
    assert not rl.exists()
    os.makedirs(cell)
    (cell / "metrics.jsonl").write_text("interrupted")
    compare._make_room(str(cell), None, _Rank0())
    assert not cell.exists() and not (rl / "superseded").exists()
    compare._make_room(str(cell), finished("0123456789abcdef", "first"), _Rank0())
    assert not cell.exists()
    assert (rl / "superseded" / "prime-implicit-s0.01234567" / "metrics.jsonl").read_text() \
        == "first"
    assert "moved to" in capsys.readouterr().out
    compare._make_room(str(cell), finished("0123456789abcdef", "second"), _Rank0())
    assert (rl / "superseded" / "prime-implicit-s0.01234567.1" / "metrics.jsonl").read_text() \
        == "second"
    assert (rl / "superseded" / "prime-implicit-s0.01234567" / "metrics.jsonl").read_text() \
        == "first"
    # the superseded runs are not cells of the run directory
    assert sorted(os.listdir(rl)) == ["superseded"]


def test_only_a_cell_of_these_rl_settings_with_its_last_checkpoint_is_re_evaluated(tmp_path):
    """A finished cell evaluated at another size is re-evaluated from the checkpoint of its
    last RL step, and only then: a cell of other RL settings, or one whose last checkpoint is
    gone (a run directory restored from a state directory), is re-run instead (`reevaluate`
    says None before touching anything). The end-to-end re-evaluation:
    test_compare_tiny_end_to_end_killed_and_resumed."""
    cell = tmp_path / "start0" / "rl" / "grpo-learned-s0"
    ov = ["trainer.seed=0", "trainer.steps=3"]

    def checkpoint(step):
        actor = cell / "checkpoints" / f"step_{step:06d}" / "actor"
        os.makedirs(actor)
        (actor / "megaprm_checkpoint.json").write_text("{}")
        return actor

    assert compare._final_checkpoint(str(cell), ov) is None
    checkpoint(1)
    assert compare._final_checkpoint(str(cell), ov) is None  # not the run's last step
    last = checkpoint(2)
    assert compare._final_checkpoint(str(cell), ov) == str(last)
    rec = {"digest": "d0", "greedy": {"problems": 32, "samples": 32},
           "sampled": {"problems": 32, "samples": 64}}
    assert compare._eval_size(rec) == (32, 2)
    assert compare._eval_size({"digest": "d0"}) == (None, None)  # no evaluation: re-run
    # the key it had at its own evaluation size is not this run's: other RL settings
    assert compare.reevaluate(None, None, _Rank0(), None, str(cell), rec, "other", "d1", ov) \
        is None
    shutil.rmtree(cell / "checkpoints")
    assert compare.reevaluate(None, None, _Rank0(), None, str(cell), rec, "d0", "d1", ov) is None
    assert os.listdir(cell) == []  # nothing written, nothing moved

"""`megaprm demo`: the table is the exact checker's count of the texts the policies generated,
the shipped start is the code's recipe and a good PRM, `--from-scratch` rebuilds a start
tensor for tensor, README's demo block is generated from the committed output, and the
"within the spread" sentence reads the full comparison's per-seed numbers."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from megaprm.digest import json_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_BIN = os.path.join(os.path.dirname(sys.executable), "megaprm")
MEGAPRM = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "megaprm.cli"]


def _run(args, timeout=900):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------- an independent exact checker (spec)

def _apply(a, op, b):
    return a + b if op == "+" else a - b if op == "-" else a * b


def reference_check(prompt: str, text: str, ends_with_eos: bool) -> tuple:
    """(final answer right, every step right), written from the task's rules
    (tasks/arithmetic.py's docstring), not from its code: step k must be "prev op_k b_k = c"
    with c the true value, prev the result the previous step stated; then one boxed step
    holding the last stated result."""
    toks = re.findall(r"\d+|[+\-*]", prompt.rstrip("="))
    operands, ops = [int(t) for t in toks[0::2]], toks[1::2]
    answer = operands[0]
    for op, b in zip(ops, operands[1:]):
        answer = _apply(answer, op, b)
    steps = text.split("\n\n")
    if not ends_with_eos and steps[-1] == "":
        steps.pop()
    prev, right = operands[0], []
    for k, step in enumerate(steps):
        eq = re.fullmatch(r"(-?\d+)([+\-*])(\d+)=(-?\d+)", step)
        box = re.fullmatch(r"\\boxed\{(-?\d+)\}", step)
        if eq:
            a, op, b, c = int(eq[1]), eq[2], int(eq[3]), int(eq[4])
            right.append(k < len(ops) and a == prev and op == ops[k] and b == operands[k + 1]
                         and c == _apply(a, op, b))
            prev = c
        elif box:
            right.append(k == len(ops) and int(box[1]) == prev)
        else:
            right.append(False)
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    try:
        final = bool(boxed) and int(boxed[-1].strip()) == answer
    except ValueError:
        final = False
    return final, bool(right) and all(right)


def recount(ev: dict) -> dict:
    checks = [reference_check(p, t, f == "stop")
              for p, t, f in zip(ev["prompts"], ev["texts"], ev["finish"])]
    correct = sum(c for c, _ in checks)
    return {"accuracy": correct / len(checks),
            "all_steps_correct": sum(c and a for c, a in checks) / len(checks),
            "correct_with_wrong_step": sum(c and not a for c, a in checks) / max(correct, 1)}


def _assert_recounted(s: dict) -> None:
    from megaprm.experiments.arithmetic.runs import held_out_problems

    problems = [p.prompt for p in held_out_problems(s["config"]["eval_problems"])]
    evs = [s["before_rl"]] + [s["runs"][m]["after_rl"] for m in s["runs"]]
    for ev in evs:
        assert ev["prompts"] == problems[:len(ev["prompts"])] and len(ev["prompts"]) == ev["samples"]
        for k, v in recount(ev).items():
            assert abs(ev[k] - v) < 1e-12, (k, ev[k], v)


# --------------------------------------------------------------------------- the demo, tiny

@pytest.mark.slow
def test_demo_tiny_budget_table_is_the_exact_checkers_count(tmp_path):
    """2 ranks, the shipped start, 1 RL step per method, 16 problems: every number of the
    printed table is the independent checker's count of the texts in demo.json, and both
    methods' runs, the PNG and the timing line are there."""
    rd = tmp_path / "demo"
    p = _run([*MEGAPRM, "demo", "--nproc", "2", "--run-dir", str(rd), "--rl-steps", "1",
              "--eval-problems", "16"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = _load(rd / "demo.json")
    assert s["start"]["source"] == "shipped" and s["start"]["prm_eval"]["auroc"] >= 0.9
    assert set(s["runs"]) == {"grpo", "pure"} and s["config"]["method"] == "pure"
    assert all(s["runs"][m]["rl_steps_run"] == 1 for m in s["runs"])
    _assert_recounted(s)
    assert 0 < s["before_rl"]["accuracy"] < 1  # the shipped warm-up policy solves some, not all
    # the printed table: label, before, GRPO after, PURE after (3 decimals)
    from megaprm.experiments.arithmetic.demo import METRICS

    for label, key, _ in METRICS:
        row = re.search(re.escape(label) + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", p.stdout)
        assert row, (label, p.stdout[-2000:])
        want = [s["before_rl"][key], s["runs"]["grpo"]["after_rl"][key],
                s["runs"]["pure"]["after_rl"][key]]
        assert [float(x) for x in row.groups()] == [round(w, 3) for w in want]
    assert "PRM held-out step AUROC" in p.stdout and "CPU-seconds of the 2 ranks" in p.stdout
    assert os.path.getsize(rd / "demo_curves.png") > 1000
    assert s["spread"]["metrics"]["correct_with_wrong_step"].get("compare_diffs")  # checkout


@pytest.mark.slow
def test_from_scratch_rebuild_is_checked_against_the_shipped_start(tmp_path):
    """The build that made the shipped files, at a tiny budget: shipped into a directory, then
    `--from-scratch`'s path (start.ensure) rebuilds it and finds every tensor identical;
    a manifest naming another tensor is reported as differing (the check can fail)."""
    from megaprm.parallel import launch

    (res,) = launch.spawn(_rebuild_rank, 1, str(tmp_path))
    assert res["shipped_source"] == "shipped"
    assert res["rebuilt"]["source"] == "built"
    assert res["rebuilt"]["check"] == {"identical_to_shipped": True, "same_code": True,
                                       "differing_tensors": {"sft": [], "prm": []}}
    assert res["tampered"]["source"] == "cached"  # the rebuilt start is reused, not retrained
    assert res["tampered"]["check"]["identical_to_shipped"] is False
    assert res["tampered"]["check"]["differing_tensors"]["sft"] == [res["tampered_name"]]
    # the sentence names the cause the manifests tell: the same start code built both here;
    # a shipped start of other code, or of none recorded, is said so
    from megaprm.experiments.arithmetic.start import rebuild_sentence

    check = res["tampered"]["check"]
    assert check["same_code"] is True and "rounds differently" in rebuild_sentence(check)
    assert "1 tensors differ" in rebuild_sentence(check)
    assert res["other_code"]["same_code"] is False
    assert "build_demo_start.py" in rebuild_sentence(res["other_code"])
    assert res["no_code"]["same_code"] is None
    assert "records no code version" in rebuild_sentence(res["no_code"])
    assert rebuild_sentence(res["rebuilt"]["check"]).startswith("every tensor is identical")


def _rebuild_rank(tmp):
    import torch

    from megaprm.experiments.arithmetic import start
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer

    torch.set_num_threads(1)  # as a demo rank (OMP_NUM_THREADS=1): no spinning on a busy box
    groups = init_distributed(tp=1, pp=1, seed=0)
    tok = build_char_tokenizer()

    def quiet(*a, **k):
        return None

    rec = start.recipe(warmup_steps=2, prm_steps=2, prm_examples=64)
    start.build(os.path.join(tmp, "a"), rec, groups, tok, quiet)
    start.SHIPPED_DIR = os.path.join(tmp, "shipped")
    start.ship(os.path.join(tmp, "a"))
    used = start.ensure(os.path.join(tmp, "run0"), rec, groups, tok, False, quiet)
    rebuilt = start.ensure(os.path.join(tmp, "run"), rec, groups, tok, True, quiet)
    man = start.read_manifest()
    name = min(man["tensors"]["sft"])
    man["tensors"]["sft"][name] = "0" * 64
    with open(os.path.join(start.SHIPPED_DIR, start.MANIFEST), "w") as f:
        json.dump(man, f)
    tampered = start.ensure(os.path.join(tmp, "run"), rec, groups, tok, True, quiet)
    checks = {}
    for case, code in (("other_code", {**man["code"], "code": "0" * 16}), ("no_code", None)):
        m = {k: v for k, v in man.items() if k != "code"}
        with open(os.path.join(start.SHIPPED_DIR, start.MANIFEST), "w") as f:
            json.dump({**m, **({"code": code} if code else {})}, f)
        checks[case] = start.ensure(os.path.join(tmp, "run"), rec, groups, tok, True,
                                    quiet)["rebuild_check"]
    destroy()
    return {"shipped_source": used["source"], "tampered_name": name,
            "rebuilt": {"source": rebuilt["source"], "check": rebuilt["rebuild_check"]},
            "tampered": {"source": tampered["source"], "check": tampered["rebuild_check"]},
            **checks}


# ----------------------------------------------------------------------- the shipped start

def test_shipped_start_is_the_codes_recipe_and_a_good_prm():
    """The shipped files are what the manifest says (tensor digests), built with the recipe the
    code has now, and the PRM, run by transformers' own class, separates good from bad steps of
    the held-out solutions with AUROC >= 0.9 (Mann-Whitney counted here, pair by pair)."""
    import numpy as np
    import torch
    import transformers as tf

    from megaprm.experiments.arithmetic import start
    from megaprm.experiments.arithmetic.runs import TASK
    from megaprm.rewards.scoring import PRMInputFormat
    from megaprm.trainer.prm_training import (
        arithmetic_examples,
        encode_examples,
        load_tokenizer,
    )

    man = start.read_manifest()
    assert man is not None, "megaprm/assets/demo/manifest.json is missing"
    assert man["digest"] == json_digest(start.recipe()), \
        "the shipped start was built with another recipe: rebuild and ship it (see start.py)"
    for m in ("sft", "prm"):
        assert start.tensor_digests(os.path.join(start.SHIPPED_DIR, m)) == \
            man["tensors"][m]
    size = sum(os.path.getsize(os.path.join(dp, f))
               for dp, _, fs in os.walk(start.SHIPPED_DIR) for f in fs)
    assert size < 6 * 2**20, size

    prm_dir = os.path.join(start.SHIPPED_DIR, "prm")
    tok = load_tokenizer(prm_dir)
    held = arithmetic_examples(TASK, 512, man["recipe"]["prm"]["seed"] + 1_000_000)
    enc, _ = encode_examples(held, tok, PRMInputFormat())
    hf = tf.AutoModelForTokenClassification.from_pretrained(prm_dir, dtype=torch.float32).eval()
    b = enc.batch
    with torch.no_grad():
        logits = hf(b.input_ids).logits  # right-padded, causal: padding never reaches a step
    good, bad = [], []
    for i in range(b.input_ids.shape[0]):
        k = int(b.step_mask[i].sum())
        z = logits[i, b.score_index[i, :k]]
        for score, label in zip((z[:, 1] - z[:, 0]).tolist(), enc.labels[i, :k].tolist()):
            (good if label else bad).append(score)
    g, x = np.array(good)[:, None], np.array(bad)[None, :]
    auroc = float(((g > x).sum() + 0.5 * (g == x).sum()) / (g.size * x.size))
    assert auroc >= 0.9 and abs(auroc - man["prm_eval"]["auroc"]) < 1e-3, auroc


# ------------------------------------------------------------------------ README and spread

def test_readme_demo_block_is_the_committed_runs_output():
    """README's demo block is readme_block(docs/demo/demo.json) to the character, and the
    committed numbers are the independent checker's count of the committed texts."""
    from megaprm.experiments.arithmetic.demo import NO_RUN_BLOCK, readme_block
    from megaprm.experiments.readme import read_block

    block = read_block(os.path.join(ROOT, "README.md"), "demo")
    path = os.path.join(ROOT, "docs", "demo", "demo.json")
    if not os.path.isfile(path):  # nothing measured is committed: README claims nothing
        assert block == NO_RUN_BLOCK, "README's demo block has numbers but no docs/demo/demo.json"
        return
    s = _load(path)
    assert block == readme_block(s), \
        "README's demo block drifted: `megaprm demo --write-readme` regenerates it"
    _assert_recounted(s)
    assert s["config"]["rl_steps"] == 40 and s["config"]["eval_problems"] == 200
    assert os.path.isfile(os.path.join(ROOT, "docs", "demo", "demo_curves.png"))


def test_summary_says_what_prime_does_at_this_scale(capsys):
    """Set against GRPO, PRIME (which reads no step-label PRM) gets the measured note."""
    from megaprm.experiments.arithmetic import demo

    ev = {"accuracy": 0.5, "all_steps_correct": 0.4, "correct_with_wrong_step": 0.2,
          "problems": 8}
    run = {"after_rl": ev, "rl_phase_times_s": {"rollout_s": 1.0}, "dir": "d"}
    s = {"config": {"baseline": "grpo", "method": "prime", "rl_steps": 1, "seed": 0,
                    "run_dir": "r"},
         "world_size": 2, "device": "cpu", "before_rl": ev,
         "start": {"prm_eval": {"auroc": 0.95}, "source": "shipped"},
         "runs": {"grpo": run, "prime": run}, "spread": {"method": "prime", "baseline": "grpo",
                                                          "metrics": {}},
         "times_s": {"start": 0.0, "eval_before_rl": 1.0, "rl_grpo": 2.0, "eval_grpo": 1.0,
                     "rl_prime": 2.0, "eval_prime": 1.0},
         "total_s": 9.0, "rank_cpu_s": 9.0, "load": {"start": [1, 1, 1], "end": [1, 1, 1]}}
    demo.print_summary(s)
    out = capsys.readouterr().out
    assert demo.PRIME_NOTE in out and "PRIME after" in out


def _summary(after_base, after_meth):
    def ev(a, f, w):
        return {"accuracy": a, "all_steps_correct": f, "correct_with_wrong_step": w}

    return {"config": {"baseline": "grpo", "method": "pure"},
            "runs": {"grpo": {"after_rl": ev(*after_base)}, "pure": {"after_rl": ev(*after_meth)}}}


def _row(method, seeds, acc, fc, ws):
    return {"method": method, "prm": "learned", "seeds": seeds,
            "greedy accuracy": {"per_seed": acc}, "greedy fully correct": {"per_seed": fc},
            "greedy correct with a wrong step": {"per_seed": ws}}


def test_spread_pairs_the_comparisons_seeds_and_says_within_or_not(capsys):
    from megaprm.experiments.arithmetic import demo
    from megaprm.experiments.arithmetic.stats import t975

    rep = {"rows": [_row("pure", [0, 1, 2], [0.6, 0.5, 0.45], [0.5, 0.45, 0.4], [0.07, 0.08, 0.075]),
                    {**_row("pure", [0, 1, 2], [0, 0, 0], [0, 0, 0], [0, 0, 0]), "prm": "oracle"},
                    _row("grpo", [2, 0, 1], [0.55, 0.6, 0.5], [0.45, 0.46, 0.44], [0.18, 0.2, 0.15])]}
    sp = demo.spread(_summary((0.58, 0.46, 0.2), (0.6, 0.56, 0.07)), rep)
    # paired by seed: pure s0 - grpo s0, ... (grpo's seeds listed out of order on purpose)
    diffs = [0.6 - 0.6, 0.5 - 0.5, 0.45 - 0.55]
    m = sp["metrics"]["accuracy"]
    assert m["compare_diffs"] == pytest.approx(diffs)
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert m["compare_sd"] == pytest.approx(sd)
    assert m["compare_ci95"] == pytest.approx(t975(2) * sd / math.sqrt(3))
    assert m["demo_diff"] == pytest.approx(0.02) and m["within"] is True  # 0.02 <= 2 sd
    w = sp["metrics"]["correct_with_wrong_step"]
    assert w["compare_diffs"] == pytest.approx([0.07 - 0.2, 0.08 - 0.15, 0.075 - 0.18])
    assert w["within"] is False  # -0.13 against 2 sd of (-0.13, -0.07, -0.105)
    text = "\n".join(demo.spread_sentences(sp))
    assert "accuracy: +0.020" in text and "within the spread" in text
    assert "larger than the spread" in text
    # the committed comparison, read as it is
    real = demo._read_compare(demo.COMPARE_JSON)
    assert real is not None and "within" in demo.spread(_summary((0, 0, 0), (0, 0, 0)), real)[
        "metrics"]["accuracy"]
    # no comparison / no row for the method: a plain sentence, no crash
    for bad in (None, {"rows": [_row("grpo", [0], [0.5], [0.5], [0.5])]}):
        sp = demo.spread(_summary((0.5, 0.5, 0.1), (0.5, 0.5, 0.1)), bad)
        assert all("within" not in v for v in sp["metrics"].values())
        assert demo.spread_sentences(sp)[0].startswith("One seed only")
    assert demo._read_compare("/nonexistent/compare.json") is None


def test_spread_pairs_by_start_and_seed_when_the_comparison_has_starts():
    """Seed s of start 0 and seed s of start 1 are different runs: each pairs with GRPO's run of
    the same start and seed (keyed by seed alone, start 1 would overwrite start 0)."""
    from megaprm.experiments.arithmetic import demo

    def row(method, acc):
        return {**_row(method, [0, 1, 0, 1], acc, acc, acc), "starts": [0, 0, 1, 1]}

    rep = {"rows": [row("grpo", [0.5, 0.4, 0.9, 0.8]), row("pure", [0.6, 0.45, 0.85, 0.9])]}
    sp = demo.spread(_summary((0.5, 0.5, 0.1), (0.55, 0.5, 0.1)), rep)
    m = sp["metrics"]["accuracy"]
    # (start, seed) order: (0,0) (0,1) (1,0) (1,1)
    assert m["compare_diffs"] == pytest.approx([0.1, 0.05, -0.05, 0.1])
    assert m["compare_starts"] == 2
    text = "\n".join(demo.spread_sentences(sp))
    assert "over its 2 starts" in text and "over 4 paired runs (2 starts)" in text
    # a one-start report (no `starts`) reads as before
    one = demo.spread(_summary((0.5, 0.5, 0.1), (0.55, 0.5, 0.1)),
                      {"rows": [_row("grpo", [0, 1], [0.5, 0.4], [0.5, 0.4], [0.1, 0.1]),
                                _row("pure", [0, 1], [0.6, 0.45], [0.6, 0.45], [0.1, 0.1])]})
    assert "over 2 seeds" in "\n".join(demo.spread_sentences(one))


def test_from_json_pairs_a_finished_demo_with_the_comparison_again(tmp_path):
    """`demo --from-json` runs nothing: it re-pairs a demo.json's differences with a comparison
    (the committed one after a rerun) and writes only the `spread` back; bad input is one line."""
    from megaprm.experiments.arithmetic import demo

    s = {"config": {"baseline": "grpo", "method": "pure"}, "before_rl": {}, "start": {},
         "runs": _summary((0.5, 0.5, 0.2), (0.6, 0.5, 0.1))["runs"], "spread": {"stale": 1}}
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(s))
    rep = {"rows": [_row("grpo", [0, 1, 2], [0.5, 0.4, 0.5], [0.4] * 3, [0.2, 0.2, 0.3]),
                    _row("pure", [0, 1, 2], [0.5, 0.5, 0.6], [0.4] * 3, [0.1, 0.2, 0.1])]}
    (tmp_path / "compare.json").write_text(json.dumps(rep))
    out = demo.respread(str(path), str(tmp_path / "compare.json"))
    back = _load(path)
    assert back == json.loads(json.dumps(out))
    assert {k: v for k, v in back.items() if k != "spread"} == \
        {k: v for k, v in s.items() if k != "spread"}
    assert back["spread"]["metrics"]["accuracy"]["compare_diffs"] == pytest.approx([0, 0.1, 0.1])
    assert not (tmp_path / "demo.json.tmp").exists()
    p = _run([*MEGAPRM, "demo", "--from-json", str(tmp_path / "nope.json")], timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--from-json" in p.stderr and "no such file" in p.stderr


def test_demo_refuses_grpo_as_the_method_in_one_line():
    p = _run([*MEGAPRM, "demo", "--method", "grpo"], timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--method=grpo" in p.stderr and "baseline" in p.stderr


def test_demo_task_long_trains_its_own_start(tmp_path):
    """`megaprm demo --task long`: the long task's recipe (its warm-up and PRM steps) is not the
    shipped start's, so the start is trained, not copied; its problems and budget are the long
    task's; --write-readme (the shipped demo's block) is refused in one line."""
    from megaprm.experiments.arithmetic import demo as demo_mod
    from megaprm.experiments.arithmetic import runs, start

    d = demo_mod.DemoConfig(task="long", **runs.TASK_DEFAULTS["long"])
    rec = start.recipe(d.warmup_steps, d.prm_steps, d.prm_examples, d.task, d.prm_init)
    shipped = start.read_manifest()
    assert rec["task"] == "long" and rec["warmup"]["task"] == repr(runs.TASKS["long"])
    assert rec["prm"]["init"] == "warmup"  # its PRM is fine-tuned from its warm-up policy
    assert json_digest(rec) != shipped["digest"]
    assert json_digest(start.recipe()) == shipped["digest"]  # the short one is still shipped
    with pytest.raises(ValueError, match="--task nosuch: unknown task"):
        demo_mod.DemoConfig(task="nosuch")
    from tests.test_megaprm_cli import one_line_error

    p = _run([*MEGAPRM, "demo", "--task", "long", "--write-readme", "--run-dir",
              str(tmp_path / "d")])
    one_line_error(p, "megaprm demo: error:", "--write-readme with --task long")
    assert not os.path.exists(tmp_path / "d")


def _build_from_warmup(rank, world_size, out_dir):
    from megaprm.experiments.arithmetic import start
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer

    g = init_distributed(tp=1, pp=1)
    rec = start.recipe(warmup_steps=1, prm_steps=0, prm_examples=64, prm_init="warmup")
    return start.build(out_dir, rec, g, build_char_tokenizer(), say=lambda *a, **k: None)


def test_a_start_whose_prm_starts_from_its_warmup_policy(tmp_path):
    """`start.build` of a recipe with the PRM's init "warmup" (`megaprm demo --task long`'s):
    the PRM's trunk is the warm-up policy's (bit for bit after the head-only stage, with no
    whole-model step), not a random-init one; the recipe names it, the short default does not."""
    from safetensors import safe_open

    from megaprm.experiments.arithmetic import start
    from tests.distributed_utils import run_distributed

    assert "init" not in start.recipe()["prm"]  # the shipped start's recipe is unchanged
    [man] = run_distributed(_build_from_warmup, 1, str(tmp_path), timeout=600)
    assert man["recipe"]["prm"]["init"] == "warmup"
    assert not os.path.exists(tmp_path / "prm_init")
    with safe_open(str(tmp_path / "prm" / "model.safetensors"), "pt") as prm, \
            safe_open(str(tmp_path / "sft" / "model.safetensors"), "pt") as sft:
        trunk = [k for k in sft.keys() if k.startswith("model.")]
        assert len(trunk) > 10
        for k in trunk:
            assert prm.get_tensor(k).equal(sft.get_tensor(k)), k

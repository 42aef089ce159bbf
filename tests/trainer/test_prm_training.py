"""PRM training: config and data errors, metrics against loops, layout independence, the HF
round trip of a trained PRM, and a tiny PRM that learns the arithmetic task's step labels."""
import json
import os
import time

import pytest
import torch

from megaprm.models.tiny import save_tiny_model
from megaprm.parallel import launch
from megaprm.trainer import prm_training as pt
from megaprm.tasks.arithmetic import CORRUPTION_KINDS, ArithmeticConfig
from megaprm.tasks.tokenizer import build_char_tokenizer


def _tiny_lm(path, seed=0, **kw):
    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", str(path), seed=seed, tokenizer=tok, vocab_size=len(tok), **kw)


# ------------------------------------------------------------------------- config and data

def test_config_errors_name_field_value_and_fix(tmp_path):
    d = _tiny_lm(tmp_path / "lm")
    cases = [(dict(head="lm"), "PRMTrainConfig.head='lm'"),
             (dict(stage1_lr=0.0), "PRMTrainConfig.stage1_lr=0.0"),
             (dict(global_batch_size=10, micro_batch_size=4), "multiple of micro_batch_size=4"),
             (dict(train_jsonl=str(tmp_path / "nope.jsonl")), "file not found"),
             (dict(stage1_steps=0, stage2_steps=0), "must be > 0"),
             (dict(eval_fraction=1.5), "PRMTrainConfig.eval_fraction=1.5")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
            pt.PRMTrainConfig(model_dir=d, **kw)
    with pytest.raises(ValueError, match="PRMTrainConfig.model_dir"):
        pt.PRMTrainConfig(model_dir=str(tmp_path / "missing"))


def test_jsonl_rows_skipped_counted_and_located(tmp_path):
    path = tmp_path / "steps.jsonl"
    good = {"prompt": "2+3=", "completions": ["2+3=5", "\\boxed{5}"], "labels": [True, True]}
    lines = [json.dumps(good),
             "{not json",
             json.dumps({"prompt": "1+1=", "completions": ["1+1=2"]}),
             json.dumps({"prompt": "1+1=", "completions": ["1+1=2"], "labels": [True, False]}),
             "",
             json.dumps({"prompt": 3, "completions": ["x"], "labels": [True]}),
             json.dumps({"prompt": "1+1=", "completions": ["1+1=2\n\n2"], "labels": [True]}),
             json.dumps({**good, "labels": [True, False]})]
    path.write_text("\n".join(lines) + "\n")
    examples, skipped = pt.read_stepwise_jsonl(str(path))
    assert [e.labels for e in examples] == [(1, 1), (1, 0)]
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:8"]
    assert examples[0].response == "2+3=5\n\n\\boxed{5}"
    assert [s.split(": ")[0] for s in skipped] == [f"{path}:{n}" for n in (2, 3, 4, 6, 7)]
    assert "missing key 'labels'" in skipped[1] and "1 completions but 2 labels" in skipped[2]
    # encoded like a rollout: one closing token per step, labels aligned with them
    enc, bad = pt.encode_examples(examples, build_char_tokenizer(), pt.scoring.PRMInputFormat())
    assert not bad and enc.labels.tolist() == [[1, 1], [1, 0]]
    ids = enc.batch.input_ids[0]
    assert ids[enc.batch.score_index[0]].tolist() == [4, 1]  # "\n\n", then <eos>


def test_arithmetic_examples_hold_every_corruption_kind():
    examples = pt.arithmetic_examples(ArithmeticConfig(), 40, seed=5)
    kinds = {e.kind for e in examples}
    assert kinds == {"reference", *CORRUPTION_KINDS}
    assert all(all(e.labels) for e in examples if e.kind == "reference")
    assert all(not all(e.labels) for e in examples if e.kind != "reference")
    assert all(e.ends_with_eos == (e.kind != "truncated") for e in examples)


@pytest.mark.parametrize("seed", range(5))
def test_auroc_matches_pairwise_loop(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (60,), generator=g).float() / 5  # many ties
    labels = (torch.rand(60, generator=g) < 0.6).long()
    pos, neg = scores[labels == 1], scores[labels == 0]
    expected = sum(float(p > n) + 0.5 * float(p == n) for p in pos for n in neg)
    assert abs(pt.step_auroc(scores, labels) - expected / (len(pos) * len(neg))) < 1e-12
    assert pt.step_auroc(scores, torch.ones(60)) != pt.step_auroc(scores, torch.ones(60))  # nan


def test_f1_of_error_detection():
    p_good = torch.tensor([0.9, 0.2, 0.4, 0.8, 0.1])
    labels = torch.tensor([1, 0, 1, 0, 0])
    m = pt.step_metrics(p_good, labels, ["a"] * 5)
    # flagged bad: 1, 2, 4; truly bad: 1, 3, 4 -> precision 2/3, recall 2/3
    assert abs(m.f1 - 2 / 3) < 1e-9 and m.num_bad == 3 and abs(m.accuracy - 0.6) < 1e-9


# ------------------------------------------------------------------ layouts and HF round trip

def _train_rank(model_dir, out_dir, tp, pp):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.prm import build_prm
    from megaprm.parallel.init import init_distributed
    from megaprm.rewards.scoring import PRMInputFormat, run_prm

    g = init_distributed(tp=tp, pp=pp)
    cfg = pt.PRMTrainConfig(model_dir=model_dir, output_dir=out_dir, num_train=64, num_eval=16,
                            stage1_steps=2, stage1_lr=1e-2, stage2_steps=2, stage2_lr=1e-3,
                            global_batch_size=8, micro_batch_size=2, log_every=0, seed=1)
    res = pt.train_prm(cfg, g, log=lambda m: None)
    # the saved PRM, reloaded through the one mapping into a fresh stage
    spec = spec_from_hf(out_dir)
    model = build_prm(spec, tp=tp, pp=pp, pp_rank=g.pp_rank)
    load_hf_weights(model, out_dir, spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp, pp_rank=g.pp_rank)
    enc, _ = pt.encode_examples(pt.arithmetic_examples(cfg.arithmetic, 8, 99),
                                pt.load_tokenizer(out_dir), PRMInputFormat())
    scores = run_prm(model, g, enc.batch, head=spec.head, micro_batch_size=2)
    return {"losses": [h["loss"] for h in res.history], "scores": scores.scores,
            "auroc": res.eval.auroc, "batch": enc.batch}


def test_layouts_train_alike_and_saved_prm_reloads_in_transformers(tmp_path):
    import transformers as tf

    d = _tiny_lm(tmp_path / "lm", seed=2, hidden_size=32, num_layers=2, intermediate_size=64)
    runs = {}
    for tp, pp, dp in [(1, 1, 1), (1, 1, 2), (1, 2, 1)]:
        out = str(tmp_path / f"prm-tp{tp}-pp{pp}-dp{dp}")
        runs[(tp, pp, dp)] = launch.spawn(_train_rank, tp * pp * dp, d, out, tp, pp)
    (single,) = runs[(1, 1, 1)]
    assert len(single["losses"]) == 4
    for layout, results in runs.items():
        for r in results:
            assert max(abs(a - b) for a, b in zip(r["losses"], single["losses"])) < 1e-5, layout
            assert (r["scores"] - single["scores"]).abs().max() < 1e-4, layout
            assert abs(r["auroc"] - single["auroc"]) < 1e-6
    # transformers' own class loads the saved directory and gives the same step scores
    out = str(tmp_path / "prm-tp1-pp1-dp1")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForTokenClassification"]
    hf = tf.AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    batch = single["batch"]
    with torch.no_grad():
        for i in range(batch.input_ids.shape[0]):
            n = int(batch.lengths[i])
            logits = hf(batch.input_ids[i: i + 1, :n]).logits[0]
            k = int(batch.step_mask[i].sum())
            p = torch.softmax(logits[batch.score_index[i, :k]], -1)
            assert torch.allclose(single["scores"][i, :k], p[:, 1] - p[:, 0], atol=1e-5)


# ------------------------------------------------------------------- learning the task (CPU)

# The arithmetic task at its small-operand setting (operands 1..9, 2-4 of "+"/"-"), a
# Qwen2-shaped trunk (hidden 64, 4 layers) from random init, dp=2. The auxiliary LM loss on
# correct solutions is what lets the trunk learn the arithmetic the head has to check; without
# it the PRM stays near AUROC 0.7 (docs/prm.md).
LEARN = dict(arithmetic=ArithmeticConfig(num_ops=(2, 4), operand_max=9, ops="+-"),
             num_train=8000, num_eval=512, stage1_steps=20, stage1_lr=1e-3, stage2_steps=1200,
             stage2_lr=4e-3, warmup_steps=50, lr_decay="cosine", lm_loss_weight=1.0,
             global_batch_size=64, micro_batch_size=32, log_every=0, seed=0)


def _learn_rank(model_dir, out_dir):
    from megaprm.parallel.init import init_distributed

    g = init_distributed()
    t0 = time.perf_counter()
    res = pt.train_prm(pt.PRMTrainConfig(model_dir=model_dir, output_dir=out_dir, **LEARN), g,
                       log=lambda m: None)
    return {"eval": res.eval, "train_s": res.train_seconds, "wall_s": time.perf_counter() - t0,
            "first_loss": res.history[0]["loss"], "last_loss": res.history[-1]["loss"]}


@pytest.mark.slow
@pytest.mark.learning
def test_tiny_prm_learns_arithmetic_step_labels(tmp_path):
    """Step-level AUROC >= 0.9 on held-out solutions of every corruption kind, within a CPU
    test budget (measured minutes and AUROC: docs/prm.md and the README)."""
    d = _tiny_lm(tmp_path / "lm", seed=0, hidden_size=64, num_layers=4, intermediate_size=192)
    results = launch.spawn(_learn_rank, 2, d, str(tmp_path / "prm"), timeout_s=1800)
    r = results[0]
    ev = r["eval"]
    print(f"\nPRM: AUROC {ev.auroc:.4f} F1(error) {ev.f1:.4f} acc {ev.accuracy:.4f} "
          f"per-kind {ev.per_kind} train {r['train_s']:.1f}s wall {r['wall_s']:.1f}s")
    assert set(ev.per_kind) == {"reference", *CORRUPTION_KINDS}  # every kind is held out
    assert results[1]["eval"] == ev  # both dp ranks computed the same metrics
    assert r["last_loss"] < r["first_loss"]
    assert ev.auroc >= 0.9, ev
    assert ev.per_kind["reference"][1] >= 0.95 and ev.per_kind["wrong_result"][1] >= 0.8


# ------------------------------------------------------------------ auxiliary LM loss

AUX = dict(num_train=64, num_eval=16, stage1_steps=1, stage1_lr=1e-2, stage2_steps=2,
           stage2_lr=1e-3, global_batch_size=8, micro_batch_size=2, log_every=0, seed=3,
           lm_loss_weight=0.5)


def _aux_rank(model_dir, tp, pp):
    from megaprm.parallel.init import init_distributed

    g = init_distributed(tp=tp, pp=pp)
    res = pt.train_prm(pt.PRMTrainConfig(model_dir=model_dir, **AUX), g, log=lambda m: None)
    return [(h["loss"], h["lm_loss"]) for h in res.history]


def test_aux_lm_loss_equals_transformers_and_is_layout_invariant(tmp_path):
    """The auxiliary next-token loss of the first step equals transformers' causal-LM loss on
    the fully-correct solutions of that batch (the LM head comes from the trunk's checkpoint),
    and every (tp, pp, dp) layout takes the same steps."""
    import transformers as tf

    from megaprm.rewards.scoring import PRMInputFormat

    d = _tiny_lm(tmp_path / "lm", seed=4, hidden_size=32, num_layers=2, intermediate_size=64)
    runs = {lay: launch.spawn(_aux_rank, lay[0] * lay[1] * lay[2], d, lay[0], lay[1])
            for lay in [(1, 1, 1), (2, 1, 1), (1, 2, 2)]}
    single = runs[(1, 1, 1)][0]
    assert len(single) == 3 and all(lm > 0 for _, lm in single)
    for lay, ranks in runs.items():
        for r in ranks:
            for (a, la), (b, lb) in zip(r, single):
                assert abs(a - b) < 1e-5 and abs(la - lb) < 1e-5, lay
    # independent reference: the same first batch through transformers' own forward
    cfg = pt.PRMTrainConfig(model_dir=d, **AUX)
    train, _ = pt.encode_examples(pt.arithmetic_examples(cfg.arithmetic, cfg.num_train, cfg.seed),
                                  pt.load_tokenizer(d), PRMInputFormat())
    rows = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    batch = train.select(rows[: cfg.global_batch_size])
    mask = pt.lm_loss_mask(batch)
    assert mask.sum() > 0
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(len(batch)):
            L = int(batch.batch.lengths[i])
            if not mask[i].any():
                continue
            logits = hf(batch.batch.input_ids[i: i + 1, :L]).logits[0, :-1]
            lp = torch.log_softmax(logits.double(), -1)
            nll -= float(lp.gather(1, batch.batch.input_ids[i, 1:L, None]).sum())
            n += L - 1
    assert abs(single[0][1] - nll / n) < 1e-4


# ------------------------------------------------------------------------ the CLI

@pytest.mark.slow
def test_train_prm_cli_runs_the_yaml_recipe_and_names_bad_keys(tmp_path):
    import subprocess
    import sys

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "prm", "tiny.yaml")
    d = _tiny_lm(tmp_path / "lm", seed=5, hidden_size=32, num_layers=2, intermediate_size=64)
    out = str(tmp_path / "prm")
    small = [f"model_dir={d}", f"output_dir={out}", "num_train=32", "num_eval=16",
             "stage1_steps=1", "stage2_steps=1", "global_batch_size=8", "micro_batch_size=4"]
    cli = [sys.executable, "-m", "megaprm.cli", "train-prm", "--config", recipe]
    bad_cases = [(["stage2_lrr=1"], "unknown PRM config key(s) ['stage2_lrr']"),
                 (["head=lm"], "PRMTrainConfig.head='lm'"),
                 (["stage2_steps"], "expected key=value")]
    # the bad-input runs (independent processes, seconds of imports each) run alongside
    bad_runs = [subprocess.Popen(cli + small + bad, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for bad, _ in bad_cases]
    try:
        p = subprocess.run(cli + small, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        report = json.loads(p.stdout.strip().splitlines()[-1])
        assert 0.0 <= report["auroc"] <= 1.0 and report["output_dir"] == out
        assert os.path.isfile(os.path.join(out, "model.safetensors"))
        for proc, (_, message) in zip(bad_runs, bad_cases):
            _, stderr = proc.communicate(timeout=600)
            err = stderr.strip().splitlines()
            assert proc.returncode == 2 and len(err) == 1 and message in err[0], stderr[-2000:]
    finally:
        for proc in bad_runs:  # none left behind when an assertion fails first
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name", ["tiny.yaml", "pure_7b.yaml"])
def test_prm_recipes_load(tmp_path, name):
    """Every shipped PRM recipe is a valid PRMTrainConfig once its paths exist."""
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "prm", name)
    d = _tiny_lm(tmp_path / "lm", hidden_size=32, num_layers=2, intermediate_size=64)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "completions": ["1+1=2"], "labels": [True]}))
    over = [f"model_dir={d}"] + ([f"train_jsonl={rows}"] if name == "pure_7b.yaml" else [])
    cfg, tp, pp = pt.load_prm_config(recipe, over)
    assert cfg.model_dir == d and tp >= 1 and pp >= 1
    assert cfg.stage1_steps > 0 and cfg.stage2_steps > 0  # the two-stage recipe


def test_prm_config_overrides_are_typed(tmp_path):
    """`train-prm stage2_lr=8e-3`: YAML 1.1 reads "8e-3" as a string; the loader makes it the
    float the field is typed as (as `megaprm train`'s config does), and a value that is no
    number is refused naming the key."""
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "prm", "tiny.yaml")
    d = _tiny_lm(tmp_path / "lm", hidden_size=32, num_layers=2, intermediate_size=64)
    cfg, _, _ = pt.load_prm_config(recipe, [f"model_dir={d}", "stage2_lr=8e-3",
                                            "stage1_lr=1e-4", "betas=[0.9, 0.99]"])
    assert isinstance(cfg.stage2_lr, float) and cfg.stage2_lr == 8e-3
    assert cfg.stage1_lr == 1e-4 and cfg.betas == (0.9, 0.99)
    with pytest.raises(ValueError, match="stage2_lr='fast' must be a number"):
        pt.load_prm_config(recipe, [f"model_dir={d}", "stage2_lr=fast"])

"""`megaprm eval-prm` end to end on tiny random models: the report's first-error F1 and step
AUROC equal ProcessBench's definition applied to the step scores transformers computes for the
same PRM (an independent forward), on arithmetic solutions with exact labels and on a
ProcessBench-format fixture; PRIME's implicit PRM with policy == reference scores every step 0;
a bad input is one line and exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "processbench_tiny.jsonl"
TASK = ["--task-config", "num_ops=1,2", "operand_max=9"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.rewards.prm_input import PRMInputFormat
    from megaprm.tasks.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("judge")
    tok = build_char_tokenizer()
    kw = dict(tokenizer=tok, vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
              num_kv_heads=2, intermediate_size=64, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    prm = save_tiny_model("qwen2", str(root / "prm"), seed=3, head="token_cls", **kw)
    cfg_path = Path(prm) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(PRMInputFormat().to_hf())  # what train-prm records: the raw layout
    cfg_path.write_text(json.dumps(cfg))
    lm = save_tiny_model("qwen2", str(root / "lm"), seed=4, **kw)
    return root, prm, lm


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "megaprm.cli", "eval-prm", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)


def _hf_p_good(prm_dir, examples):
    """P(good) at each step's closing token by transformers' forward of the raw layout: prompt
    tokens, then the steps joined by "\\n\\n" (+ EOS when complete); a step closes at the
    separator after it, the last one at its last token."""
    import torch
    from transformers import AutoModelForTokenClassification

    from megaprm.trainer.prm_training import load_tokenizer

    tok = load_tokenizer(prm_dir)
    model = AutoModelForTokenClassification.from_pretrained(prm_dir, dtype=torch.float32).eval()
    from megaprm.tasks.arithmetic import split_steps

    out = []
    for ex in examples:
        steps = split_steps(ex.response, ex.ends_with_eos)  # a cut after "\n\n" ends there
        ids, pos = tok(ex.prompt, add_special_tokens=False).input_ids, []
        for k, step in enumerate(steps):
            closed = k < len(steps) - 1 or ex.response.endswith("\n\n")
            ids += tok(step + ("\n\n" if closed else ""), add_special_tokens=False).input_ids
            if k == len(steps) - 1 and ex.ends_with_eos:
                ids.append(tok.eos_token_id)
            pos.append(len(ids) - 1)
        with torch.no_grad():
            p = model(torch.tensor([ids])).logits[0].float().softmax(-1)[:, 1]
        out.append([float(p[i]) for i in pos])
    return out


def _threshold_between(scores):
    """A threshold in the widest gap between the middle half of the scores, so that float noise
    between two forwards cannot move a step across it."""
    s = sorted(x for row in scores for x in row)
    mid = s[len(s) // 4: 3 * len(s) // 4 + 1]
    i = max(range(len(mid) - 1), key=lambda j: mid[j + 1] - mid[j])
    assert mid[i + 1] - mid[i] > 1e-5
    return (mid[i] + mid[i + 1]) / 2


def _release(scores, labels, threshold):
    """ProcessBench's definition as a loop: first step below the threshold (else -1) must equal
    the label; error acc, correct acc, F1."""
    match = []
    for row, y in zip(scores, labels):
        pred = next((k for k, s in enumerate(row) if s < threshold), -1)
        match.append((y, pred == y))
    acc1 = sum(m for y, m in match if y != -1) / sum(y != -1 for y, _ in match)
    acc2 = sum(m for y, m in match if y == -1) / sum(y == -1 for y, _ in match)
    return acc1, acc2, 2 * acc1 * acc2 / (acc1 + acc2) if acc1 + acc2 else 0.0


def test_eval_prm_on_arithmetic_and_processbench_jsonl(models):
    from megaprm.rewards.prm_eval import first_error_label, read_processbench_jsonl
    from megaprm.tasks.arithmetic import ArithmeticConfig
    from megaprm.trainer import prm_judge
    from megaprm.trainer.prm_training import StepExample, arithmetic_examples

    root, prm, _ = models
    examples = arithmetic_examples(ArithmeticConfig(num_ops=(1, 2), operand_max=9), 32, 7)
    ref = _hf_p_good(prm, examples)
    thr = _threshold_between(ref)
    out = root / "report.json"
    p = _run("--prm", prm, "--task", "arithmetic", "--num", "32", "--seed", "7", *TASK,
             "--threshold", repr(thr), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())["report"]
    labels = [first_error_label(e.labels) for e in examples]
    acc1, acc2, f1 = _release(ref, labels, thr)
    a = rep["all"]
    assert a["solutions"] == 32 and a["n_erroneous"] == sum(y != -1 for y in labels)
    assert (a["acc_erroneous"], a["acc_correct"], a["f1"]) == pytest.approx((acc1, acc2, f1))
    good = [s for row, e in zip(ref, examples) for s, ok in zip(row, e.labels) if ok]
    bad = [s for row, e in zip(ref, examples) for s, ok in zip(row, e.labels) if not ok]
    pairs = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    assert a["step_auroc"] == pytest.approx(pairs / (len(good) * len(bad)), abs=1e-3)
    assert set(rep["per_kind"]) == {"reference", "wrong_result", "flawed_but_correct",
                                    "wrong_operand", "truncated"}
    assert "wrong_operand" in p.stdout and "step AUROC" in p.stdout

    # the ProcessBench fixture: its steps joined as the PRM reads them
    rows = read_processbench_jsonl(str(FIXTURE))
    pb = [StepExample(r.problem, "\n\n".join(r.steps), (1,) * len(r.steps)) for r in rows]
    assert [e.response for e in pb] == [e.response for e in prm_judge.processbench_set(
        rows, "x")[0]]
    ref = _hf_p_good(prm, pb)
    thr = _threshold_between(ref)
    out = root / "pb.json"
    p = _run("--prm", prm, "--jsonl", str(FIXTURE), "--threshold", repr(thr), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    got = doc["report"]["per_kind"]["processbench_tiny"]
    acc1, acc2, f1 = _release(ref, [r.label for r in rows], thr)
    # row by row, as the release writes its outputs: the prediction from transformers' scores
    assert [(s["source"], s["prediction"]) for s in doc["solutions"]] == [
        (f"{FIXTURE}:{i + 1}", next((k for k, x in enumerate(row) if x < thr), -1))
        for i, row in enumerate(ref)]
    assert [s["scores"] for s in doc["solutions"]] == [
        pytest.approx(row, abs=1e-4) for row in ref]
    assert got["solutions"] == 10
    assert (got["acc_erroneous"], got["acc_correct"], got["f1"]) == pytest.approx((acc1, acc2, f1))
    assert "mean F1 over the 1 file(s)" in p.stdout


def test_implicit_prm_equal_to_its_reference_scores_every_step_zero(models):
    # policy == reference: log pi_phi - log pi_ref = 0 at every token, every step scores 0.
    # Default threshold 0 (bad = a negative reward): no step is bad, every prediction is -1, so
    # every correct solution is right (acc 1) and every erroneous one wrong (acc 0): F1 = 0;
    # every step ties: step AUROC 0.5.
    root, _, lm = models
    out = root / "implicit.json"
    p = _run("--implicit", lm, "--ref", lm, "--task", "arithmetic", "--num", "16", *TASK,
             "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    a = json.loads(out.read_text())["report"]["all"]
    assert (a["acc_erroneous"], a["acc_correct"], a["f1"]) == (0.0, 1.0, 0.0)
    assert a["step_auroc"] == 0.5 and a["n_erroneous"] > 0 and a["n_correct"] > 0


def test_bad_input_is_one_line_exit_2(models, tmp_path, capfd):
    from megaprm import cli

    _, prm, lm = models
    rc = cli.main(["eval-prm", "--prm", prm, "--implicit", lm, "--ref", lm, "--task",
                   "arithmetic"])
    err = capfd.readouterr().err.strip()
    assert rc == 2 and err == ("megaprm eval-prm: error: give one PRM: --prm DIR (a "
                               "discriminative PRM), or --implicit DIR --ref DIR (PRIME's "
                               "implicit PRM and its reference)")
    before = FIXTURE.read_bytes()
    rc = cli.main(["eval-prm", "--prm", prm, "--jsonl", str(FIXTURE), "--out", str(FIXTURE)])
    err = capfd.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--out" in err and "input" in err, err
    assert FIXTURE.read_bytes() == before
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1=", "steps": ["1+1=2"], "label": 3}\n')
    rc = cli.main(["eval-prm", "--prm", prm, "--jsonl", str(bad)])
    err = capfd.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"{bad}:1: 'label'" in err, err

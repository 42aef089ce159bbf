"""docs/your-model.md end to end: every command of the page, in order, as written, with its
placeholders replaced by a tiny random Qwen2.5-shaped policy carrying the real Qwen2.5 tokenizer
(tests/qwen25.py, offline) and a user-style JSONL prompt file; PROF-GRPO and PURE train with a
PRM trained from that policy's trunk. Checked besides each exit code: the PRM's step scores, as
transformers computes them, separate correct from wrong steps on held-out arithmetic solutions
(exact labels from the task's checker); each run trained its steps with the PRM's scores in its
metrics; the export loads in transformers.

tests/test_doc_commands.py checks the same page's command forms on every run of the suite (the
placeholders make it check flags only); this test runs them."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.qwen25 import qwen25_tokenizer
from tests.test_doc_commands import extract

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "your-model.md"

# user-style rows: the plain layouts the page documents (question/answer, problem/solution)
ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in
        ((1, 2), (3, 4), (2, 2), (4, 1), (3, 3), (1, 4))]
ROWS += [{"problem": "Compute $2 + 3$.", "solution": "It is $\\boxed{5}$."},
         {"problem": "Compute $4 + 4$.", "solution": "So $\\boxed{8}$."}]


def _tiny_qwen(out: str) -> str:
    from megaprm.models.tiny import save_tiny_model

    tok = qwen25_tokenizer()
    return save_tiny_model("qwen2", out, tokenizer=tok, vocab_size=len(tok), hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _step_auroc(prm_dir: str, seed: int = 12345, n: int = 160) -> tuple[float, int, int]:
    """Held-out step AUROC of the PRM's p(good step), by transformers' forward of the layout the
    PRM recorded (raw: prompt tokens then response tokens, step k scored at its closing token:
    the "\\n\\n" after it, the last token for the last step), on solutions of the task's own
    generator with exact local labels; AUROC by counting pairs (ties half)."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from megaprm.tasks.arithmetic import ArithmeticConfig, step_labelled_examples

    cfg = json.loads((Path(prm_dir) / "config.json").read_text())
    assert cfg["megaprm_prm_input"]["step_marker_id"] is None  # the raw layout
    tok = AutoTokenizer.from_pretrained(prm_dir)
    model = AutoModelForTokenClassification.from_pretrained(prm_dir,
                                                            torch_dtype=torch.float32).eval()
    good, bad = [], []
    task = ArithmeticConfig(num_ops=(1, 2), operand_max=4, ops="+")
    for prompt, steps, labels in step_labelled_examples(task, n, seed=seed):
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        ids, pos = list(p_ids), []
        for k, step in enumerate(steps):
            text = step + ("\n\n" if k < len(steps) - 1 else "")
            ids += tok(text, add_special_tokens=False).input_ids
            pos.append(len(ids) - 1)
        with torch.no_grad():
            p = model(torch.tensor([ids])).logits[0].softmax(-1)[:, 1]
        for k, lab in enumerate(labels):
            (good if lab else bad).append(float(p[pos[k]]))
    pairs = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return pairs / (len(good) * len(bad)), len(good), len(bad)


@pytest.mark.slow
def test_your_model_doc_runs_end_to_end(tmp_path):
    tmp = tmp_path
    policy = _tiny_qwen(str(tmp / "policy"))
    data = tmp / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    cmds = extract(DOC)
    assert sum("megaprm train " in c for c in cmds) == 2 and any("train-prm" in c for c in cmds)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    runs = iter([tmp / "run_prof_grpo", tmp / "run_pure"])
    run_dir = None
    for cmd in cmds:
        if " train " in cmd:
            run_dir = next(runs)
        subs = {"POLICY": policy, "DATA": str(data), "PRM_DIR": str(tmp / "prm"),
                "CKPT": str(tmp / "ckpt"), "RUN_DIR": str(run_dir), "HF_OUT": str(tmp / "hf"),
                # the converter's synopsis: the user's file in PROF-GRPO's released layout
                "CONFIG": "configs/prof_grpo.yaml", "--in FILE": f"--in {data}",
                "--out FILE": f"--out {tmp / 'mine_prof_grpo.parquet'}"}
        line = re.sub(r"(?<![\w/-])(" + "|".join(map(re.escape, subs)) + r")(?![\w/])",
                      lambda m: subs[m.group(1)], cmd)
        assert not re.search(r"\b[A-Z][A-Z_]{2,}\b", line.replace("PYTHONPATH", "")), line
        p = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=1500, check=False)
        assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
        out = p.stdout + p.stderr
        if "train-prm" in cmd:
            # the PRM separates correct from wrong steps it never saw (transformers' forward)
            auroc, n_good, n_bad = _step_auroc(str(tmp / "prm"))
            assert n_good > 50 and n_bad > 20 and auroc >= 0.65, (auroc, out[-2000:])
        elif " train " in cmd:
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1], rows
            assert all("prm/score_mean" in r for r in rows), rows[0].keys()
            assert "rollout.engine" not in out or "transformers engine" in out
        elif "export-hf" in cmd:
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(str(tmp / "hf"))
        elif "megaprm data" in cmd:
            assert (tmp / "mine_prof_grpo.parquet").stat().st_size > 0
        elif "megaprm eval" in cmd:
            assert "math500" in p.stdout and "avg@1" in p.stdout, p.stdout

"""scripts/prime_ablations.py: PRIME's ablations on the long task paired with the main run's GRPO
of the same start and seed, and docs/compare.md's table is the script's output on the committed
JSONs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "scripts"))
import prime_ablations as pa  # noqa: E402


def _report(rows):
    out = []
    for method, prm, seeds, starts, acc, wrong, extra in rows:
        out.append({"method": method, "prm": prm, "seeds": seeds, "starts": starts,
                    "greedy accuracy": {"per_seed": acc},
                    "greedy correct with a wrong step": {"per_seed": wrong}, **extra})
    return {"rows": out}


def test_each_seed_is_paired_with_grpo_of_the_same_start_and_seed(tmp_path):
    main = _report([
        # start 1's seed 0 must not pair with start 0's
        ("grpo", "learned", [0, 1, 2, 0], [0, 0, 0, 1], [0.20, 0.30, 0.25, 0.90],
         [0.50, 0.60, 0.55, 0.10], {}),
        ("prime", "implicit", [0, 1, 2], [0, 0, 0], [0.10, 0.15, 0.12], [0.90, 0.80, 0.85],
         {"implicit_prm_loss": {"first": 0.7, "last": 0.9}}),
    ])
    abl = _report([("prime", "implicit", [1, 0], [0, 0], [0.05, 0.25], [1.0, 0.4],
                    {"implicit_judged": {"step_auroc": 0.48, "f1": 0.0}})])
    (tmp_path / "no_filter.json").write_text(json.dumps(abl))
    (tmp_path / "main.json").write_text(json.dumps(main))
    text = pa.table(*pa.load(tmp_path / "main.json", tmp_path))
    lines = text.splitlines()
    released = next(ln for ln in lines if ln.startswith("| released"))
    ablated = next(ln for ln in lines if ln.startswith("| no accuracy filter"))
    grpo = next(ln for ln in lines if ln.startswith("| (GRPO"))
    # seeds 0, 1 (the ablation's); differences per seed against start 0's GRPO
    assert "| 0.100 / 0.150 | 0.900 / 0.800 | -0.100 / -0.150 | +0.400 / +0.200 |" in released
    assert "| 0.250 / 0.050 | 0.400 / 1.000 | +0.050 / -0.250 | -0.100 / +0.400 |" in ablated
    assert "0.700 / 0.900 (all its 3 runs, 1 start(s))" in released and "| 0.480 / 0.000 |" in ablated
    assert "| 0.200 / 0.300 | 0.500 / 0.600 |" in grpo


def test_the_doc_block_is_the_scripts_output_on_the_committed_jsons(tmp_path):
    main, ablations = pa.load(pa.MAIN,
                              ROOT / "docs/compare/long/prime_ablations")
    assert set(ablations) == set(pa.ABLATIONS)  # every ablation the doc names is committed
    text = pa.table(main, ablations)
    doc = (ROOT / "docs/compare.md").read_text(encoding="utf-8")
    assert f"{pa.BEGIN}\n{text}{pa.END}" in doc
    # and --write on a copy changes nothing else
    copy = tmp_path / "compare.md"
    copy.write_text(doc.replace(text, "stale\n"), encoding="utf-8")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/prime_ablations.py"), "--write",
                        str(copy)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert copy.read_text(encoding="utf-8") == doc and p.stdout == text


def test_a_doc_without_the_block_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "x.md").write_text("no block\n")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/prime_ablations.py"), "--write",
                        str(tmp_path / "x.md")], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "prime-ablations begin" in p.stderr and (tmp_path / "x.md").read_text() == "no block\n"


def test_an_ablation_is_refused_against_a_run_with_another_start_0():
    """The rerun at 4000 x 2 rebuilt start 0 with the same settings (another draw): pairing the
    ablations with its report would compare runs from two warm-ups, so it is one line, exit 2."""
    rerun = ROOT / "docs/compare/long/compare.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts/prime_ablations.py"), "--main",
                        str(rerun)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "its start 0 is not" in p.stderr and p.stdout == ""
    # and the committed reference is the run they copied
    pa.load(pa.MAIN, ROOT / "docs/compare/long/prime_ablations")

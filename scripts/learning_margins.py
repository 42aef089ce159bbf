"""The learning tests' outcomes under every x86 kernel path torch offers, over several seeds.

A test whose verdict is a training outcome (an AUROC, an accuracy) passes on one CPU and can
fail on another: torch picks its vector kernels for the CPU at hand (`ATEN_CPU_CAPABILITY`,
and MKL its own), the rounding differs, and a small model trained for a few hundred steps
lands elsewhere. This script reruns each learning test's recipe in a fresh process per
(kernel path, seed) and writes the outcome next to the test's threshold, so a threshold is
set with a margin measured on every path, not on the developer's CPU alone.

    python scripts/learning_margins.py --seeds 0,1,2 --out scripts/results/learning_margins.json

Cases (the tests that use them: tests/kernel_paths.py LEARNING_TESTS, docs/testing.md):
- `prm`: test_tiny_prm_learns_arithmetic_step_labels' recipe (2 ranks): held-out step AUROC,
  the reference / wrong_result per-kind accuracies, first and last loss;
- `warmup`: test_compare's warm-up (the demo's SFT at --warmup-steps, 2 ranks) and how many of
  its held-out problems (its first 16, and 32) it solves greedily, decoded by transformers and
  checked exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.kernel_paths import PATHS, available_paths, path_env  # noqa: E402


def _prm_case(seed: int, tmp: str) -> dict:
    from megaprm.parallel import launch
    from tests.trainer import test_prm_training as t

    d = t._tiny_lm(os.path.join(tmp, "lm"), seed=seed, hidden_size=64, num_layers=4,
                   intermediate_size=192)
    learn = dict(t.LEARN, seed=seed)
    (r, _) = launch.spawn(_prm_rank, 2, d, os.path.join(tmp, "prm"), learn, timeout_s=1800)
    ev = r["eval"]
    return {"auroc": ev.auroc, "reference_acc": ev.per_kind["reference"][1],
            "wrong_result_acc": ev.per_kind["wrong_result"][1],
            "first_loss": r["first_loss"], "last_loss": r["last_loss"]}


def _prm_rank(model_dir, out_dir, learn):
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer import prm_training as pt

    g = init_distributed()
    res = pt.train_prm(pt.PRMTrainConfig(model_dir=model_dir, output_dir=out_dir, **learn), g,
                       log=lambda m: None)
    return {"eval": res.eval, "first_loss": res.history[0]["loss"],
            "last_loss": res.history[-1]["loss"]}


def _warmup_rank(steps, seed, tmp):
    from megaprm.experiments.arithmetic import start
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer

    g = init_distributed()
    tok = build_char_tokenizer()
    wcfg = start.WarmupConfig(warmup_steps=steps, seed=seed)
    init_dir = start.init_policy(wcfg, tok, os.path.join(tmp, "init"), g.rank)
    return start.warmup(wcfg, g, tok, init_dir, os.path.join(tmp, "sft"))


def _warmup_case(seed: int, tmp: str, steps: int) -> dict:
    from megaprm.experiments.arithmetic.runs import held_out_problems
    from megaprm.parallel import launch
    from tests.experiments.arithmetic.test_compare import _greedy_reference

    (loss, _) = launch.spawn(_warmup_rank, 2, steps, seed, tmp, timeout_s=1800)
    # the test's held-out problems: the first 16 of these 32 are its 16
    problems = held_out_problems(32)
    ref = _greedy_reference(os.path.join(tmp, "sft"), problems)
    correct = ref["per_problem"]["correct"]
    return {"final_loss": loss, "solved_of_16": sum(correct[:16]), "solved_of_32": sum(correct),
            "first_step_correct": ref["first_step_correct"], "steps": steps}


def one(case: str, seed: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = _prm_case(seed, tmp) if case == "prm" else _warmup_case(seed, tmp, steps)
    return {**out, "capability": torch.backends.cpu.get_cpu_capability(),
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="prm,warmup")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="kernel paths (tests/kernel_paths.py); those this CPU lacks are skipped")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON written after every finished run")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "SEED", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]))), flush=True)
        return 0
    from bench_rl_step import cpu_name  # the benchmarks' machine name (scripts/ is on the path)

    paths = [p for p in a.paths.split(",") if p in available_paths()]
    runs = []
    rec = {"machine": cpu_name(), "cpu_count": os.cpu_count(),
           "load_before": os.getloadavg(), "warmup_steps": a.warmup_steps, "runs": runs}
    for case in a.cases.split(","):
        for path in paths:
            for seed in (int(s) for s in a.seeds.split(",")):
                p = subprocess.run([sys.executable, __file__, "--one", case, str(seed),
                                    str(a.warmup_steps)], cwd=ROOT, env=path_env(path),
                                   capture_output=True, text=True, check=False)
                lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not lines:
                    print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                    return 1
                r = {"case": case, "path": path, "seed": seed, **json.loads(lines[-1][7:])}
                runs.append(r)
                print(json.dumps(r), flush=True)
                if a.out:
                    rec["load_after"] = os.getloadavg()
                    with open(a.out, "w", encoding="utf-8") as f:
                        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

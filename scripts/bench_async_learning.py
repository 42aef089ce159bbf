"""Does the demo task still learn with the rollout one step ahead? (the learning check of the separate placement)

    python scripts/bench_async_learning.py [--colocated-seeds 0 1 2] [--separate-seeds 0 1 2]
                                     [--k 1] [--steps 40] [--eval-problems 200]
                                     [--out runs/bench/bench_async_learning.json]

Every run is the demo's GRPO run (`megaprm demo`'s baseline: configs/demo.yaml with
`runs.run_overrides` for that seed, from the shipped warm-up policy in megaprm/assets/demo),
launched with `megaprm train`:

* colocated: 2 ranks (dp 2), the engine on each trainer rank: the reference, one run per seed,
  whose spread is the yardstick;
* separate: 3 ranks, 2 trainer ranks (dp 2, the same trainer as colocated) + 1 rollout rank,
  `rollout.placement=separate rollout.ranks=1 rollout.max_staleness=k` (docs/rollout.md): the
  rollout rank draws block b+k while the trainer trains on block b, and the trainer corrects
  with truncated importance weights (`rollout.correction=tis`).

Same seeds -> same prompts and sampling seeds in both placements; at k = 0 the runs are equal
(tests/trainer/test_async.py), so any difference here comes from staleness. Per run: the final
held-out greedy accuracy and wrong-step share (`trainer.eval_every` = the last step,
`trainer.eval_problems` problems, exact checker), the mean outcome reward over the last 10 steps,
the largest `rollout/staleness` seen, the IS-weight statistics, wall and CPU seconds (children's
rusage), the load. The verdict per metric: is each separate run inside [min, max] of the
colocated seeds ("range"), and inside that range widened by one binomial standard error of the
measurement ("band": a spread taken from three seeds is not tighter than what one evaluation
of 200 problems, or 1,280 training responses, can tell apart); and the paired differences
(separate - colocated, same seed: same prompts and sampling seeds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaprm.experiments.arithmetic import runs  # noqa: E402
from megaprm.bench import default_out, load_average, write_result  # noqa: E402
from megaprm.trainer.metrics import read_metrics  # noqa: E402

ASSETS = ROOT / "megaprm" / "assets" / "demo"
YAML = ROOT / "megaprm" / "configs" / "demo.yaml"
LAST = 10  # steps the reward is averaged over


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _shown(path: Path) -> str:
    """A run directory as recorded: relative to the checkout when inside it."""
    return os.path.relpath(path, ROOT) if str(path).startswith(str(ROOT)) else str(path)


def run_one(placement: str, seed: int, k: int, steps: int, eval_problems: int,
            work: Path) -> dict:
    ccfg = runs.CompareConfig(rl_steps=steps, eval_problems=eval_problems, wandb="disabled")
    spec = runs.RunSpec("grpo", "learned", seed)
    run_dir = work / f"{placement}-k{k}-s{seed}" if placement == "separate" else \
        work / f"colocated-s{seed}"
    ov = runs.run_overrides(spec, ccfg, str(ASSETS / "sft"), str(ASSETS / "prm"))
    ov += [f"trainer.run_dir={run_dir}", f"trainer.eval_every={steps}",
           f"trainer.eval_problems={eval_problems}"]
    nproc = 2
    if placement == "separate":
        nproc = 3
        ov += ["rollout.placement=separate", "rollout.ranks=1", f"rollout.max_staleness={k}"]
    cmd = [sys.executable, "-m", "megaprm.cli", "train", "--config", str(YAML),
           "--nproc", str(nproc), *ov]
    print(f"[async_learning] {placement} seed {seed}" + (f" k={k}" if placement == "separate"
                                                         else ""), flush=True)
    load0, cpu0, t0 = load_average(), _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = read_metrics(str(run_dir))
    last = [r["reward/outcome_mean"] for r in rows[-LAST:]]
    final = rows[-1]
    out = {"placement": placement, "seed": seed, "k": k if placement == "separate" else 0,
           "ranks": nproc, "steps": len(rows),
           "eval_accuracy": final["eval/accuracy"],
           "eval_correct_with_wrong_step": final["eval/correct_with_wrong_step"],
           "reward_last10": statistics.fmean(last),
           "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
           "wall_s": wall, "cpu_s": cpu, "load_start": load0, "load_end": load_average(),
           "run_dir": _shown(run_dir)}
    for key in ("rollout/is_weight_mean", "rollout/is_weight_max", "rollout/is_truncated_frac"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key.split("/")[1]] = {"mean": statistics.fmean(vals), "max": max(vals)}
    print(f"[async_learning]   accuracy {out['eval_accuracy']:.3f}, wrong-step "
          f"{out['eval_correct_with_wrong_step']:.3f}, reward(last {LAST}) "
          f"{out['reward_last10']:.3f}, staleness max {out['staleness_max']:.0f}, "
          f"{wall:.0f} s wall, {cpu:.0f} CPU-s", flush=True)
    return out


def verdict(colocated: list, separate: list, problems: int, reward_samples: int) -> dict:
    """Per metric: the colocated seeds' [min, max] ("range"), the same widened by one standard
    error of the measurement ("band": binomial at the colocated mean; held-out metrics over
    `problems` problems, the wrong-step share over the correct ones, the training reward over
    the `reward_samples` responses of its last steps), whether every separate run is inside
    each, and the paired differences (separate - colocated, same seed)."""
    res = {}
    acc = statistics.fmean(r["eval_accuracy"] for r in colocated)
    n_of = {"eval_accuracy": problems, "eval_correct_with_wrong_step": max(1.0, acc * problems),
            "reward_last10": reward_samples}
    for key, n in n_of.items():
        ref = [r[key] for r in colocated]
        lo, hi = min(ref), max(ref)
        p = statistics.fmean(ref)
        se = math.sqrt(max(p * (1 - p), 1e-12) / n)
        got = [r[key] for r in separate]
        by_seed = {r["seed"]: r[key] for r in colocated}
        paired = [r[key] - by_seed[r["seed"]] for r in separate if r["seed"] in by_seed]
        res[key] = {"colocated": ref, "colocated_mean": p, "range": [lo, hi],
                    "inside_range": all(lo <= g <= hi for g in got),
                    "se": se, "band": [lo - se, hi + se],
                    "inside": all(lo - se <= g <= hi + se for g in got),
                    "separate": got, "separate_mean": statistics.fmean(got) if got else None,
                    "paired_differences": paired,
                    "paired_mean": statistics.fmean(paired) if paired else None}
    return res


def _reward_samples(steps: int) -> int:
    from megaprm.config import load_config

    cfg = load_config(str(YAML))
    return cfg.data.prompts_per_step * cfg.rollout.n * min(LAST, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--colocated-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--separate-seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--k", type=int, default=1, help="rollout.max_staleness of the separate runs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--work", default=str(ROOT / "runs" / "async_learning"))
    ap.add_argument("--out", default=default_out("bench_async_learning.json"))
    ap.add_argument("--from-json", help="recompute the verdict of an earlier --out (no runs)")
    a = ap.parse_args()
    if a.from_json:
        result = json.loads(Path(a.from_json).read_text())
        runs = result["runs"]
        result["verdict"] = verdict([r for r in runs if r["placement"] == "colocated"],
                                    [r for r in runs if r["placement"] == "separate"],
                                    result["workload"]["eval_problems"],
                                    _reward_samples(result["workload"]["steps"]))
        _report(result, a.out)
        return 0
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    colocated = [run_one("colocated", s, 0, a.steps, a.eval_problems, work)
                 for s in a.colocated_seeds]
    separate = [run_one("separate", s, a.k, a.steps, a.eval_problems, work)
                for s in a.separate_seeds]
    result = {"device": "cpu", "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                              time.gmtime()),
              "workload": {"method": "grpo", "config": "megaprm/configs/demo.yaml",
                           "start": "megaprm/assets/demo", "steps": a.steps,
                           "eval_problems": a.eval_problems, "k": a.k},
              "runs": colocated + separate,
              "verdict": verdict(colocated, separate, a.eval_problems,
                                 _reward_samples(a.steps)),
              "total_s": time.perf_counter() - t0}
    _report(result, a.out)
    return 0


def plot(result: dict, png: str) -> str | None:
    """Training reward per step (10-step moving mean), every run: colocated solid, separate
    dashed, one colour per seed. Reads each run's metrics.jsonl (None where they are gone)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for r in result["runs"]:
        d = ROOT / r["run_dir"]  # relative: under the checkout
        if not (d / "metrics.jsonl").is_file():
            continue
        ys = [row["reward/outcome_mean"] for row in read_metrics(str(d))]
        smooth = [statistics.fmean(ys[max(0, i - LAST + 1):i + 1]) for i in range(len(ys))]
        ax.plot(smooth, color=f"C{r['seed']}", ls="-" if r["placement"] == "colocated" else "--",
                label=f"{r['placement']}{'' if r['placement'] == 'colocated' else ' k=%d' % r['k']}"
                      f" seed {r['seed']}")
        drawn += 1
    if not drawn:
        return None
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"outcome reward (train batch, {LAST}-step mean)")
    ax.set_title("GRPO on the demo task: colocated vs one step off-policy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _report(result: dict, out: str) -> None:
    path = write_result(out, result)
    png = plot(result, str(Path(out).with_suffix(".png")))
    if png:
        print(f"[async_learning] wrote {png}", flush=True)
    k = result["workload"]["k"]
    for key, v in result["verdict"].items():
        print(f"[async_learning] {key}: colocated {', '.join(f'{x:.3f}' for x in v['colocated'])}"
              f" (range {v['range'][0]:.3f}..{v['range'][1]:.3f}, +- 1 SE "
              f"{v['band'][0]:.3f}..{v['band'][1]:.3f}); separate k={k} "
              f"{', '.join(f'{x:.3f}' for x in v['separate'])}: "
              f"{'inside' if v['inside_range'] else 'outside'} the range, "
              f"{'inside' if v['inside'] else 'OUTSIDE'} the band; paired mean "
              f"{v['paired_mean']:+.3f}", flush=True)
    print(f"[async_learning] wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

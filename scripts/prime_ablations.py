"""PRIME on the long task, one knob at a time: which of its parts costs the accuracy.

    .venv/bin/python scripts/prime_ablations.py [--main docs/compare/long/1000x4/compare.json]
        [--ablations docs/compare/long/prime_ablations] [--write docs/compare.md]

Each ablation is a `megaprm compare` run of PRIME alone (2 seeds) on start 0 of the long task,
with one override on top of the released settings, in a run directory of its own into which
start 0's warm-up and PRM were copied (so its seed s samples the same step-0 responses as the
main run's GRPO and PRIME of seed s); its compare.json is committed as ABLATIONS/NAME.json.
The main run they pair with is the long task's first pass (1000 problems x 4 samples, kept as
docs/compare/long/1000x4/compare.json): its start 0 is the one the ablations copied, which the
rerun at 4000 x 2 built anew (another draw), so the rerun's report cannot be their reference.
The table pairs each ablation's seed s with the main run's GRPO and PRIME of start 0, seed s,
and prints it as markdown; `--write` replaces the `<!-- megaprm:prime-ablations -->` block of
a doc with it. With two seeds there is no interval: each seed's difference is shown.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megaprm.experiments.readme import markers, replace_block

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "docs/compare/long/1000x4/compare.json"  # the run whose start 0 they copied
BLOCK = "prime-ablations"  # docs/compare.md's generated block
BEGIN, END = markers(BLOCK)
# the ablations in the table's order: file name -> what it changes from the released settings
ABLATIONS = {
    "lr_1e-5": "implicit PRM lr 1e-5 (10x lower)",
    "no_filter": "no accuracy filter",
    "no_process_reward": "process reward off (advantage.prime.process_coef=0)",
    "no_batch_norm": "process returns unscaled (advantage.prime.norm=none)",
}
COLUMNS = ("greedy accuracy", "greedy correct with a wrong step")


def _cells(row: dict, col: str, start: int = 0) -> dict:
    """{seed: value} of a report row's column on one start."""
    return {s: v for s, k, v in zip(row["seeds"], row["starts"], row[col]["per_seed"])
            if k == start}


def _row(report: dict, method: str, prm: str) -> dict:
    for r in report["rows"]:
        if r["method"] == method and r["prm"] == prm:
            return r
    raise ValueError(f"no {method}/{prm} row in the report")


def _pair(d: dict, a: str, b: str) -> str:
    return " / ".join("-" if d.get(k) is None else f"{d[k]:.3f}" for k in (a, b))


def table(main: dict, ablations: dict) -> str:
    """The markdown table: the released PRIME row (start 0) and each ablation, per seed of the
    ablations, with the paired difference from GRPO of the same start and seed."""
    grpo = _row(main, "grpo", "learned")
    released = _row(main, "prime", "implicit")
    # its loss and AUROC columns are the report's, over every run of the row (all starts)
    scope = f"all its {len(released['seeds'])} runs, {len(set(released['starts']))} start(s)"
    rows = [("released (beta 0.05, PRM lr 2x the actor's, accuracy filter, refill)",
             released, scope)]
    rows += [(ABLATIONS.get(name, name), _row(rep, "prime", "implicit"), "")
             for name, rep in ablations.items()]
    seeds = sorted(set.intersection(*[set(_cells(r, COLUMNS[0])) for _, r, _ in rows[1:]])) \
        if ablations else sorted(_cells(rows[0][1], COLUMNS[0]))
    which = ", ".join(map(str, seeds))
    head = (["PRIME variant", "seeds"] + [f"{c} (seed {which})" for c in COLUMNS]
            + [f"Δ {c} vs GRPO" for c in COLUMNS]
            + ["implicit PRM loss: first 10 / last 10 trained steps",
               "step AUROC during RL: first 10 / last 10", "final implicit PRM: step AUROC / F1"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r, scope in rows:
        vals, diffs = [], []
        for c in COLUMNS:
            mine, ref = _cells(r, c), _cells(grpo, c)
            vals.append(" / ".join(f"{mine[s]:.3f}" for s in seeds))
            diffs.append(" / ".join(f"{mine[s] - ref[s]:+.3f}" for s in seeds))
        loss, auroc, judged = (r.get("implicit_prm_loss") or {}, r.get("implicit_step_auroc")
                               or {}, r.get("implicit_judged") or {})
        note = f" ({scope})" if scope else ""
        out.append(f"| {label} | {which} | {vals[0]} | {vals[1]} | "
                   f"{diffs[0]} | {diffs[1]} | {_pair(loss, 'first', 'last')}{note} | "
                   f"{_pair(auroc, 'first', 'last')}{note} | "
                   f"{_pair(judged, 'step_auroc', 'f1')}{note} |")
    grpo_vals = [" / ".join(f"{_cells(grpo, c)[s]:.3f}" for s in seeds) for c in COLUMNS]
    out.append(f"| (GRPO, the reference) | {which} | {grpo_vals[0]} | "
               f"{grpo_vals[1]} | - | - | - | - | - |")
    return "\n".join(out) + "\n"


def load(main_path: Path, ablation_dir: Path) -> tuple[dict, dict]:
    main = json.loads(main_path.read_text(encoding="utf-8"))
    names = [n for n in ABLATIONS if (ablation_dir / f"{n}.json").is_file()]
    names += sorted(p.stem for p in ablation_dir.glob("*.json") if p.stem not in ABLATIONS)
    ablations = {n: json.loads((ablation_dir / f"{n}.json").read_text(encoding="utf-8"))
                 for n in names}
    # an ablation pairs only with the run whose start 0 it copied: the same warm-up evaluates
    # to the same baseline (a rebuilt start 0 with the same settings is another draw)
    want = _start0_baseline(main)
    for n, rep in ablations.items():
        if want is not None and _start0_baseline(rep) not in (None, want):
            raise ValueError(f"{ablation_dir / n}.json: its start 0 is not {main_path}'s "
                             "(their warm-up baselines differ); give --main the compare.json "
                             "of the run whose start 0 the ablation copied")
    return main, ablations


def _start0_baseline(report: dict):
    """Start 0's warm-up evaluation in a compare.json, or None where the report has no starts."""
    return next((s.get("baseline") for s in report.get("starts", []) if s.get("start") == 0),
                None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--main", type=Path, default=MAIN)
    ap.add_argument("--ablations", type=Path, default=ROOT / "docs/compare/long/prime_ablations")
    ap.add_argument("--write", type=Path, default=None,
                    help="a doc whose prime-ablations block gets the table")
    args = ap.parse_args(argv)
    try:
        text = table(*load(args.main, args.ablations))
        if args.write is not None:
            replace_block(str(args.write), BLOCK, text)
    except (OSError, ValueError, KeyError) as e:
        print(f"prime_ablations: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

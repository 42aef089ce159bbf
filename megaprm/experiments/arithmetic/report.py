"""The comparison's report, a pure function of compare.json: the markdown table
(`markdown`, docs/compare.md), README's block (`readme_table`, `write_docs`) and the plots
(`plot`: bars per method, curves over RL steps, the reward-hacking monitors). The columns and
the paired differences the table leads with are defined in stats.py, which computes them
(`stats.aggregate`, called by the driver, compare.py); here they are formatted.
"""
from __future__ import annotations

import math
import os

from megaprm.experiments.arithmetic.runs import TASKS
from megaprm.experiments.arithmetic.stats import COLUMNS, PAIRED, lookup
from megaprm.experiments.readme import replace_block


# monitors kept per RL step for the curves (metrics.jsonl keys)
CURVE_KEYS = ("reward/outcome_mean", "exact/correct_with_wrong_step_frac",
              "prm/outcome_agreement", "prm/score_mean", "prm/correct_with_low_prm_frac",
              "prm/loss", "prm/trained_rows", "prm/step_auroc", "prm/implicit_step_auroc",
              "response/steps_mean", "response/tokens_per_step", "response/length_mean",
              "actor/entropy")


# how compare.json's intervals are read (written into it as `intervals`)
INTERVALS = ("mean over seeds [95% percentile interval of a two-level bootstrap: seeds with "
             "replacement, then held-out problems with replacement within each drawn seed; "
             "paired rows share the draws with GRPO's run of the same seed]; per-seed Wilson "
             "95% intervals for the evaluation's binomial part; ci95: the t half-width over "
             "seeds of earlier reports")


def warmup_row(report: dict) -> tuple[str, dict]:
    """The 'before RL' row: (what its label adds, baseline). The rows are means over starts, so
    with several starts it is the mean of their warm-ups' evaluations (path by path, as
    `lookup` reads them); with one start (or a report without per-start baselines), start
    0's, and the label adds nothing."""
    bases = [st["baseline"] for st in report.get("starts") or [] if st.get("baseline")]
    if len(bases) < 2:
        return "", report["baseline"]
    mean = {}
    for _, (ev, key) in COLUMNS:
        vals = [lookup(b, (ev, key)) for b in bases]
        if ev in ("greedy", "sampled") and all(v is not None for v in vals):
            mean.setdefault(ev, {})[key] = sum(vals) / len(vals)
    return f"; mean of {len(bases)} starts", mean


def _seeds_cell(r: dict) -> str:
    """A row's cell count, with its starts where it has more than one: in a run cut short the
    rows may cover different starts, and their means are over the starts they have."""
    n_starts = len(set(r.get("starts") or [0]))
    return f"{len(r['seeds'])}" + (f" ({n_starts} starts)" if n_starts > 1 else "")


# ------------------------------------------------------------------------------ the table

def _fmt(cell: dict) -> str:
    if cell.get("mean") is None:
        return "-"
    if cell.get("lo") is not None and math.isfinite(cell["lo"]):
        return f"{cell['mean']:.3f} [{cell['lo']:.3f}, {cell['hi']:.3f}]"
    return (f"{cell['mean']:.3f}" if cell.get("ci95") is None
            else f"{cell['mean']:.3f} ± {cell['ci95']:.3f}")


def _fmt_diff(cell: dict | None) -> str:
    if not cell:
        return "-"
    star = "**" if cell["separated"] else ""
    return f"{star}{cell['mean']:+.3f}{star} [{cell['lo']:+.3f}, {cell['hi']:+.3f}]"


def _noise_cell(nz: dict | None) -> tuple[str, bool]:
    """'evaluation / seed / start' SDs of one column (`stats.noise3`), ✓ where the evaluation
    SD is below the seed SD; and whether it is."""
    if not nz:
        return "-", False

    def sd(x):
        return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"

    below = (nz.get("seed_sd") is not None and math.isfinite(nz["seed_sd"])
             and nz["eval_sd"] < nz["seed_sd"])
    return (f"{sd(nz['eval_sd'])} / {sd(nz.get('seed_sd'))} / {sd(nz.get('start_sd'))}"
            + (" ✓" if below else "")), below


def _noise_rows(rows: list, noises) -> tuple[list, int, int]:
    """A noise table's lines, one per row (`noises(row)`: its noise dicts, one per column), and
    how many of the cells have evaluation below seed noise, of how many."""
    lines, n_below, n_cells = [], 0, 0
    for r in rows:
        cells = [_noise_cell(nz) for nz in noises(r)]
        n_below, n_cells = n_below + sum(b for _, b in cells), n_cells + len(cells)
        lines.append(f"| {row_label(r)} | {r['prm']} | " + " | ".join(c for c, _ in cells)
                     + " |")
    return lines, n_below, n_cells


def _min(seconds) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def row_label(r: dict) -> str:
    if r.get("variant_of"):
        return f"{r['method']} ({r['variant_of']}, {' '.join(r['variant_overrides'])})"
    return r["method"]


def _prm_label(r: dict) -> str:
    return r["prm"] + (" (= learned run: reads no step scores)" if r["same_run_as_learned"]
                       else "")


def verdict(r: dict) -> str:
    """One plain sentence: is the row separated from GRPO (paired 95% intervals)?"""
    p = r.get("paired")
    if not p:
        return ""
    w, a = p.get("greedy correct with a wrong step"), p.get("greedy accuracy")
    sw, sa = p.get("sampled correct with a wrong step"), p.get("sampled accuracy")
    if not (w and a):
        return ""

    def say(cell, what):
        if not cell["separated"]:
            return f"not separated from GRPO in {what} ({cell['mean']:+.3f}, interval spans 0)"
        return (f"{'below' if cell['mean'] < 0 else 'above'} GRPO in {what} "
                f"({cell['mean']:+.3f} [{cell['lo']:+.3f}, {cell['hi']:+.3f}])")

    name = f"{row_label(r)} with the {r['prm']} process reward"
    seeds = (f"{len(p['seeds'])} paired seeds" if len(p["seeds"]) > 1 else
             "1 paired seed: the interval is the evaluation's alone, not the seeds'")
    sampled = ""
    if sw and sa:
        sampled = (f" Sampled: {say(sw, 'the wrong-step share')}; "
                   f"{say(sa, 'accuracy')}.")
    return (f"**{r['method']} / {r['prm']}**: {name} is {say(w, 'the greedy wrong-step share')}; "
            f"{say(a, 'greedy accuracy')} ({seeds}).{sampled}")


def _head(report: dict, title: bool) -> list:
    """The title, a partial run's note and the task's sentence."""
    lines = []
    if title:
        lines += [(f"# megaprm compare: {report['rl_steps']} RL steps, up to {report['seeds']} "
                  f"seed(s), {report['eval_problems']} held-out problems"), ""]
    if report.get("missing"):
        lines += [(f"**Partial run: {len(report['planned']) - len(report['missing'])} of "
                  f"{len(report['planned'])} planned cells finished**; not yet run: "
                  f"{', '.join(report['missing'])} (the same command resumes it)."), ""]
    starts = report.get("starts") or []
    if starts:
        rt = report.get("response_tokens") or {}
        lines += [(f"Task **{report.get('task', 'short')}** (`{report.get('task_config', '')}`; "
                   f"responses {rt.get('first5', float('nan')):.0f} tokens on average over the "
                   f"first 5 RL steps, {rt.get('last5', float('nan')):.0f} over the last 5; "
                   f"rollout.max_tokens {report.get('max_tokens')}). {len(starts)} independently "
                   "built start(s) (warm-up policy + PRM, seed k each): the outer level of the "
                   "design."), ""]
    return lines


def _main_table(report: dict) -> list:
    """The PRM's sentence and the table: the warm-up row and every row's columns."""
    cols = [c for c, _ in COLUMNS]
    (b_label, b), c = warmup_row(report), report["compute_s"]
    seeds_note = ", ".join(f"{r['method']} {len(r['seeds'])}" for r in report["rows"]
                           if r["prm"] != "oracle")
    lines = [(f"PRM (learned, start 0): held-out step AUROC "
              f"{report['prm'].get('auroc', float('nan')):.3f}"
              f" ({report['prm'].get('trunk', '')}). Cells per row: {seeds_note}. Cells: mean "
              f"over starts of the mean over seeds [95% interval of a three-level bootstrap: "
              f"starts, then seeds within a start, then the held-out problems within each run; "
              f"with one start, two levels; a row with one cell has the evaluation's interval "
              f"alone]. 'correct with a wrong step' is a share of the "
              f"correct answers; sampled: {report['sampled_n']} samples per problem at the "
              f"rollout temperature. Built on {report['device']} (load {report['load']}): "
              f"warm-up {_min(c['warmup'])}, PRM training {_min(c['prm_train'])}, RL and "
              f"evaluation of the runs {_min(c['runs'])}; this call {_min(report['total_s'])}."),
              "",
              "| method | process reward | " + " | ".join(cols) + " |",
              "|---|---|" + "---|" * len(cols),
              f"| (warm-up, before RL{b_label}) | - | " + " | ".join(
                  _fmt({"mean": lookup(b, p)}) for _, p in COLUMNS) + " |"]
    for r in report["rows"]:
        lines.append(f"| {row_label(r)} | {_prm_label(r)} | "
                     + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return lines


def _starts_table(report: dict) -> list:
    """Each start's warm-up and PRM (with several starts, or a judged PRM)."""
    starts = report.get("starts") or []
    lines = []
    if len(starts) > 1 or any(s.get("prm_judged") for s in starts):
        lines += ["", "### The starts (each built from its own seeds)", "",
                  ("| start | warm-up greedy accuracy | warm-up greedy correct with a wrong step | "
                   "PRM held-out step AUROC | PRM first-error F1 (ProcessBench) | cells |"),
                  "|---|---|---|---|---|---|"]
        for st in starts:
            g = (st.get("baseline") or {}).get("greedy") or {}
            judged = st.get("prm_judged") or {}
            lines.append(f"| {st['start']} | {_fmt({'mean': g.get('accuracy')})} | "
                         f"{_fmt({'mean': g.get('correct_with_wrong_step')})} | "
                         f"{_fmt({'mean': (st.get('prm') or {}).get('auroc')})} | "
                         f"{_fmt({'mean': judged.get('f1')})} | {st.get('cells', '-')} |")
    return lines


def _paired_tables(report: dict) -> list:
    """The paired differences from GRPO, pooled and (with several starts) start by start."""
    lines = []
    paired = [r for r in report["rows"] if r.get("paired")]
    if paired:
        lines += ["", ("### Paired difference from GRPO (same start and seed: same warm-up, "
                       "prompts and sampling seed)"), "",
                  ("Each row's run of start k, seed s minus GRPO's run of start k, seed s, "
                   "averaged over the seeds, then the starts, both have; [95% interval of the "
                   "paired three-level bootstrap (two levels with one start)]; **bold**: the "
                   "interval excludes 0."), "",
                  "| method | process reward | paired cells (starts) | " + " | ".join(
                      f"Δ {c}" for c in PAIRED) + " |",
                  "|---|---|---|" + "---|" * len(PAIRED)]
        for r in paired:
            n_starts = len(set(r["paired"].get("starts") or [0]))
            lines.append(f"| {row_label(r)} | {r['prm']} | {len(r['paired']['seeds'])} "
                         f"({n_starts}) | "
                         + " | ".join(_fmt_diff(r["paired"].get(c)) for c in PAIRED) + " |")
        lines += [""] + [f"- {verdict(r)}" for r in paired if verdict(r)]
        multi = [r for r in paired if len(set(r["paired"].get("starts") or [0])) > 1]
        if multi:
            heads = PAIRED[:2]
            lines += ["", "#### The paired differences start by start", "",
                      ("Each start's own paired difference (its seeds, then problems: a two-level "
                       "bootstrap); where the starts disagree, the finding holds for some "
                       "starts only."), "",
                      "| method | process reward | start | paired seeds | " + " | ".join(
                          f"Δ {c}" for c in heads) + " |",
                      "|---|---|---|---|" + "---|" * len(heads)]
            for r in multi:
                ks = sorted({k for c in heads for k in (r["paired"].get(c) or {}).get(
                    "by_start", {})}, key=int)
                for k in ks:
                    cells = [(r["paired"].get(c) or {}).get("by_start", {}).get(k)
                             for c in heads]
                    n = next((x["seeds"] for x in cells if x), "-")
                    lines.append(f"| {row_label(r)} | {r['prm']} | {k} | {n} | "
                                 + " | ".join(_fmt_diff(x) for x in cells) + " |")
    return lines


def _noise_table(report: dict) -> list:
    """Each row's evaluation, seed and start noise, and the evaluation size to choose next."""
    lines = []
    noisy = [r for r in report["rows"] if r.get("greedy accuracy", {}).get("noise")
             and not r["same_run_as_learned"]]
    if noisy:
        lines += ["", "### Evaluation, seed and start noise (SD of one run's value)", "",
                  ("evaluation: resampling the held-out problems (start and seed fixed); seed: "
                   "the spread of a start's runs less their own evaluation noise; start: the "
                   "spread of the starts' means less what seeds and evaluation explain (nested "
                   "random-effects moments, `stats.noise3`; '-': not estimable, e.g. one "
                   "start); ✓: evaluation below seed noise."), "",
                  ("| method | process reward | greedy accuracy: evaluation / seed / start | "
                   "greedy wrong-step share: evaluation / seed / start | sampled accuracy: "
                   "evaluation / seed / start | sampled wrong-step share: evaluation / seed / "
                   "start |"),
                  "|---|---|---|---|---|---|"]

        table, n_below, n_cells = _noise_rows(noisy, lambda r: [r[col]["noise"] for col in (
            "greedy accuracy", "greedy correct with a wrong step", "sampled accuracy",
            "sampled correct with a wrong step")])
        lines += table
        sizes = report.get("evaluation_sizes")
        if sizes and sizes["sizes"]:
            b = sizes["sizes"][0]
            lines += ["", (
                f"Evaluation below seed noise in {n_below} of {n_cells} cells at "
                f"{report['eval_problems']} problems x {report['sampled_n']} samples. The "
                "smallest evaluation that would put it below in the most columns for at most "
                f"a cell's RL cost ({sizes['max_sequences']} decoded sequences: "
                f"{sizes['rl_s']:.0f} s of RL at {1000 * sizes['seconds_per_sequence']:.1f} ms "
                f"a sequence; `stats.cheapest_evaluation`): {b['problems']} problems x "
                f"{b['k']} samples ({b['met']} of {b['met'] + b['left_out']} columns"
                + (f"; the other {b['left_out']}: seed SD 0, or a need beyond that cost)."
                   if b["left_out"] else ")."))]
    return lines


def _paired_noise_table(report: dict) -> list:
    """The same noise split for the paired differences from GRPO."""
    paired = [r for r in report["rows"] if r.get("paired")]
    lines = []
    paired_noise = [r for r in paired if any((r["paired"].get(c) or {}).get("noise")
                                             for c in PAIRED)]
    if paired_noise:  # reports before 2026-11-29 have none
        lines += ["", "### The same split for the paired differences from GRPO", "",
                  ("The noise of one run's difference from GRPO's run of the same start and "
                   "seed, the quantity the paired table rests on (`stats.noise3` of the "
                   "differences): both runs are evaluated on the same problems, so what a "
                   "problem's difficulty does to both cancels. ✓: evaluation below seed "
                   "noise."), "",
                  "| method | process reward | " + " | ".join(
                      f"Δ {c}: evaluation / seed / start" for c in PAIRED) + " |",
                  "|---|---|" + "---|" * len(PAIRED)]
        table, n_below, n_cells = _noise_rows(paired_noise, lambda r: [
            (r["paired"].get(c) or {}).get("noise") for c in PAIRED])
        lines += table
        lines += ["", f"Evaluation below seed noise in {n_below} of {n_cells} paired cells."]
    return lines


def _plateau_table(report: dict) -> list:
    """Where each row's training curves flatten."""
    lines = []
    flat = [r for r in report["rows"] if r.get("plateau", {}).get("last") is not None
            and not r["same_run_as_learned"]]
    if flat:
        lines += ["", ("### Where the training curves flatten (mean over seeds of the training "
                       "batches' monitors; 10-step windows)"), "",
                  ("| method | process reward | outcome reward: first 10 steps | last 10 | 90% of "
                   "the rise by step | slope over the last quarter (per 100 steps) | wrong-step "
                   "share: first 10 | last 10 | slope over the last quarter |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in flat:
            pl, pw = r["plateau"], r.get("plateau_wrong_step") or {}
            wrong = ("- | - | -" if pw.get("last") is None else
                     f"{pw['first']:.3f} | {pw['last']:.3f} | {pw['slope_last_quarter']:+.3f}")
            lines.append(f"| {row_label(r)} | {r['prm']} | {pl['first']:.3f} | {pl['last']:.3f} | "
                         f"{'-' if pl['step90'] is None else pl['step90']} | "
                         f"{pl['slope_last_quarter']:+.3f} | {wrong} |")
    return lines


def _prime_table(report: dict) -> list:
    """PRIME's implicit PRM: its loss and step AUROC over the run, and its final judgement."""
    lines = []
    prime = [r for r in report["rows"] if (r.get("implicit_prm_loss") or {}).get("last")
             is not None and not r["same_run_as_learned"]]
    if prime:
        # reports before 2026-11-28 hold the mean curve's windows (no "defined_steps")
        per_run = all("defined_steps" in r["implicit_prm_loss"] for r in prime)
        loss_how = ("each run's first and last 10 steps where it trained on some row, averaged "
                    "over the runs" if per_run else
                    "mean over the runs of the steps it trained on some row (10-step windows)")
        lines += ["", ("### PRIME's implicit PRM: its loss on each fresh batch (ln 2 = 0.693: "
                       "chance) and its step AUROC against the exact labels"), "",
                  (f"loss: {loss_how}; AUROC: P(a correct step's summed log-ratio > a wrong "
                   "step's) on the rows it scored, per RL step (0.5: chance), each run's first and last "
                   "10 steps where it is defined (the rows scored hold a right and a wrong "
                   "step), averaged over the runs."), "",
                  ("| method | loss: first 10 trained steps | last 10 | step AUROC: first 10 "
                   "defined steps | last 10 | final implicit PRM on the judging set: "
                   "first-error F1 | step AUROC |"), "|---|---|---|---|---|---|---|"]
        for r in prime:
            pl, au = r["implicit_prm_loss"], r.get("implicit_step_auroc") or {}
            jd = r.get("implicit_judged") or {}
            lines.append(f"| {row_label(r)} | {pl['first']:.3f} | {pl['last']:.3f} | "
                         f"{_fmt({'mean': au.get('first')})} | {_fmt({'mean': au.get('last')})} "
                         f"| {_fmt({'mean': jd.get('f1')})} | "
                         f"{_fmt({'mean': jd.get('step_auroc')})} |")
    return lines


def _hack_table(report: dict) -> list:
    """The reward-hacking run's monitors and its greedy evaluation."""
    lines = []
    h = report.get("hack")
    if h:
        te = h["train_end"]
        first = {k: (v[0] if v else None) for k, v in h["curves"].items()}
        lines += ["", "### Reward hacking: PURE on the PRM alone (no outcome reward), seed 0", "",
                  "| monitor | first step | last 5 steps |", "|---|---|---|"]
        for k in CURVE_KEYS:
            if k in te:
                lines.append(f"| {k} | {_fmt({'mean': first.get(k)})} | "
                             f"{_fmt({'mean': te.get(k)})} |")
        lines += ["", (f"after RL (greedy): accuracy {h['greedy']['accuracy']:.3f}, correct with a "
                      f"wrong step {h['greedy']['correct_with_wrong_step']:.3f}")]
    return lines


def markdown(report: dict, title: bool = True) -> str:
    """The report as markdown, a pure function of compare.json (docs and README are generated
    from the committed JSON with it): its sections in order, each a list of lines."""
    lines = [*_head(report, title), *_main_table(report), *_starts_table(report),
             *_paired_tables(report), *_noise_table(report), *_paired_noise_table(report),
             *_plateau_table(report), *_prime_table(report), *_hack_table(report)]
    return "\n".join(lines) + "\n"



def readme_table(report: dict) -> str:
    """README's comparison block: greedy accuracy and wrong-step share, absolute and paired."""
    b_label, b = warmup_row(report)
    b = b["greedy"]
    how = ("mean [95% bootstrap]" if any("lo" in r["greedy accuracy"] for r in report["rows"])
           else "mean ± 95% t-interval")
    lines = [(f"| after {report['rl_steps']} RL steps, {report['eval_problems']} held-out problems "
             f"(greedy; {how}) | seeds | accuracy | Δ accuracy vs GRPO (paired) | "
             "correct answers resting on a wrong step | Δ vs GRPO (paired) |"),
             "| --- | --- | --- | --- | --- | --- |",
             (f"| warm-up (before RL{b_label}) | - | {b['accuracy']:.3f} | - | "
             f"{b['correct_with_wrong_step']:.3f} | - |")]
    if report.get("missing"):
        lines.append(f"| (partial run: {len(report['missing'])} of {len(report['planned'])} "
                     "planned cells not yet run) | | | | | |")
    for r in report["rows"]:
        if r["same_run_as_learned"]:
            continue
        p = r.get("paired") or {}
        lines.append(f"| {row_label(r)}, {r['prm']} | {_seeds_cell(r)} | "
                     f"{_fmt(r['greedy accuracy'])} | {_fmt_diff(p.get('greedy accuracy'))} | "
                     f"{_fmt(r['greedy correct with a wrong step'])} | "
                     f"{_fmt_diff(p.get('greedy correct with a wrong step'))} |")
    return "\n".join(lines) + "\n"


def block_name(report: dict) -> str:
    """The marker name of a report's blocks: `compare` (short task), `compare-TASK` else."""
    task = report.get("task")  # reports before the long task name none (their task is short)
    return f"compare-{task}" if task in TASKS and task != "short" else "compare"


def write_docs(report: dict, readme: str | None = None, doc: str | None = None) -> list:
    """Regenerate the report's task's blocks (`block_name`) of README.md and docs/compare.md
    from a report."""
    written = []
    if readme:
        replace_block(readme, block_name(report), readme_table(report))
        written.append(readme)
    if doc:
        replace_block(doc, block_name(report), markdown(report, title=False))
        written.append(doc)
    return written


# ------------------------------------------------------------------------------ plots

SMOOTH = 5  # steps in the trailing moving average of the curves (one step is 128 samples)


def _smooth(xs: list) -> list:
    xs = [x if x is not None else float("nan") for x in xs]
    return [sum(xs[max(0, i - SMOOTH + 1):i + 1]) / len(xs[max(0, i - SMOOTH + 1):i + 1])
            for i in range(len(xs))]


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_bars(plt, report: dict, out_dir: str) -> str:
    """After RL, per row and headline column: mean over seeds with its bootstrap interval."""
    rows = report["rows"]
    labels = [f"{r['method']}\n{r['prm']}" + (" (same run)" if r["same_run_as_learned"] else "")
              for r in rows]
    panels = [c for c, p in COLUMNS if p[0] in ("greedy", "sampled")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 2, 4.2), squeeze=False)
    base = report["baseline"]
    for ax, col in zip(axes.flat, panels):
        means = [r[col]["mean"] or 0.0 for r in rows]
        errs = [[max(0.0, m - r[col].get("lo", m)) for m, r in zip(means, rows)],
                [max(0.0, r[col].get("hi", m) - m) for m, r in zip(means, rows)]]
        colors = ["tab:orange" if r["prm"] == "oracle" else "tab:blue" for r in rows]
        ax.bar(range(len(rows)), means, yerr=errs, color=colors, capsize=3)
        ref = lookup(base, dict(COLUMNS)[col])
        if ref is not None:
            ax.axhline(ref, color="gray", ls="--", lw=1, label="warm-up")
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        ax.set_title(col, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("after RL: mean over seeds, 95% bootstrap interval (seeds, then problems); "
                 "orange: oracle process reward",
                 fontsize=10)
    return _save(plt, fig, out_dir, "compare_bars.png")


def _plot_paired(plt, paired: list, out_dir: str) -> str:
    """Each row's paired difference from GRPO: interval, mean and every seed's own."""
    cols = [c for c in PAIRED if any(c in r["paired"] for r in paired)]
    fig, axes = plt.subplots(1, len(cols), figsize=(4.2 * len(cols), 0.5 * len(paired) + 1.8),
                             squeeze=False, sharey=True)
    for ax, col in zip(axes.flat, cols):
        for y, r in enumerate(paired):
            d = r["paired"].get(col)
            if not d:
                continue
            color = "tab:red" if d["separated"] else "tab:gray"
            ax.plot([d["lo"], d["hi"]], [y, y], color=color, lw=2)
            ax.plot([d["mean"]], [y], "o", color=color)
            xs = [x for x in d["per_seed"] if x is not None]  # None: no correct answer
            ax.plot(xs, [y + 0.2] * len(xs), "x", color="k", ms=4)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"Δ {col}\nvs GRPO, same seed", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes.flat[0].set_yticks(range(len(paired)),
                            [f"{r['method']} ({r['prm']}, {len(r['paired']['seeds'])} s)"
                             for r in paired], fontsize=7)
    axes.flat[0].invert_yaxis()  # the table's order, top down
    fig.suptitle("paired difference from GRPO: 95% bootstrap interval (red: excludes 0), "
                 "mean (o), each seed (x)", fontsize=9)
    return _save(plt, fig, out_dir, "compare_paired.png")


def _plot_curves(plt, results: list, out_dir: str) -> str:
    """Training curves per row, mean over seeds (the reward-hacking run aside)."""
    keys = ("reward/outcome_mean", "exact/correct_with_wrong_step_frac", "prm/outcome_agreement")
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    groups: dict = {}
    for r in results:
        if not r.get("hack"):
            groups.setdefault(f"{r['method']} ({r['prm']})", []).append(r["curves"])
    for ax, k in zip(axes.flat, keys):
        for label, cs in sorted(groups.items()):
            series = [c[k] for c in cs if k in c]
            if not series:
                continue
            steps = min(map(len, series))
            mean = [sum((s[i] or 0.0) for s in series) / len(series) for i in range(steps)]
            ax.plot(range(steps), _smooth(mean), label=label,
                    ls="--" if "oracle" in label else "-")
        ax.set_title(f"{k}\n(mean over seeds, moving average of {SMOOTH} steps)", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2)
    return _save(plt, fig, out_dir, "compare_curves.png")


def _plot_hack(plt, hack: dict, results: list, out_dir: str) -> str:
    """The reward-hacking run's monitors beside PURE's and GRPO's learned runs of its seed."""
    refs = {r["name"]: r for r in results
            if not r.get("hack") and r["seed"] == hack["seed"]
            and r["method"] in ("pure", "grpo") and r["prm"] == "learned"}
    keys = [k for k in CURVE_KEYS if k in hack["curves"] and k != "actor/entropy"]
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols,
                             figsize=(4.6 * cols, 3.2 * math.ceil(len(keys) / cols)),
                             squeeze=False)
    for ax, k in zip(axes.flat, keys):
        ax.plot(hack["curves"][k], color="tab:red", lw=0.6, alpha=0.35)
        ax.plot(_smooth(hack["curves"][k]), color="tab:red", lw=2,
                label="PURE, PRM reward only")
        for name, r in sorted(refs.items()):
            if k in r["curves"]:
                ax.plot(_smooth(r["curves"][k]), lw=1,
                        label=f"{r['method']} (outcome + PRM)" if r["method"] == "pure"
                        else f"{r['method']} (outcome reward)")
        ax.set_title(f"{k} (moving average of {SMOOTH})", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("reward-hacking monitors (metrics.jsonl)", fontsize=10)
    return _save(plt, fig, out_dir, "reward_hacking.png")


def plot(report: dict, results: list, out_dir: str) -> list[str]:
    """The comparison's PNGs (bars, paired differences, curves, reward hacking); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = [_plot_bars(plt, report, out_dir)]
    paired = [r for r in report["rows"] if r.get("paired")]
    if paired:
        written.append(_plot_paired(plt, paired, out_dir))
    written.append(_plot_curves(plt, results, out_dir))
    if report.get("hack"):
        written.append(_plot_hack(plt, report["hack"], results, out_dir))
    return written

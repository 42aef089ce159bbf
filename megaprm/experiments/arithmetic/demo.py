"""`megaprm demo`: a process reward against GRPO on the embedded arithmetic task, on CPU, in
minutes; one seed of the full comparison (`megaprm compare`, docs/compare.md).

1. start: the warm-up policy (a tiny Qwen2-shaped policy taught the task supervised, through the
   Megatron actor) and a good PRM (held-out step AUROC >= 0.9, docs/prm.md's recipe). Both ship
   in the package (`start`); `--from-scratch` rebuilds them (~6 CPU minutes on 2 ranks)
   and says whether every tensor equals the shipped one;
2. the warm-up policy is evaluated greedily on the comparison's held-out problems;
3. RL with GRPO and with the process-reward method (PURE by default: the full comparison's
   largest cut in wrong steps), the same runs `megaprm compare` makes for seed 0
   (`runs.run_overrides`);
4. both final policies are evaluated on the same problems, every step checked exactly; one table
   (accuracy, fully correct, correct with a wrong step; before and after), the PRM's AUROC, a
   PNG of both runs' curves, and whether the difference is larger than the spread of the full
   comparison's paired runs (by start and seed); time per part and CPU-seconds of the ranks.

Output: RUN_DIR/demo.json (numbers, times, load, the generated texts), RUN_DIR/demo_curves.png;
`--write-readme` copies both to docs/demo/ and regenerates README's demo block from the JSON
(`readme_block`), so README's numbers are the run's.
"""
from __future__ import annotations

import gc
import json
import math
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megaprm.algorithms.registry import METHODS
from megaprm.config import load_config
from megaprm.experiments.arithmetic import start
from megaprm.rollout.config import RolloutConfig
from megaprm.experiments.arithmetic.runs import (
    MAX_TOKENS,
    PRM_INITS,
    REPO_ROOT,
    RL_YAML,
    TASKS,
    CompareConfig,
    RunSpec,
    held_out_problems,
    run_overrides,
)
from megaprm.experiments.arithmetic.stats import t975
from megaprm.experiments.readme import replace_block
from megaprm.parallel.device import rank_device
from megaprm.parallel.groups import Groups
from megaprm.parallel.launch import seconds_since_launch
from megaprm.rollout.factory import build_engine
from megaprm.tasks.tokenizer import build_char_tokenizer
from megaprm.trainer.rl.evaluate import evaluate_arithmetic, shard
from megaprm.trainer.rl.loop import RLTrainer
from megaprm.trainer.metrics import read_metrics

# the full comparison's committed result (in a checkout; a wheel has no docs/): the spread
COMPARE_JSON = os.path.join(REPO_ROOT, "docs", "compare", "compare.json")
# what `--write-readme` writes (relative to the working directory: the repo root for `make`)
DOCS_DIR = os.path.join("docs", "demo")
BASELINE = "grpo"
# the process-reward method with the largest cut in the share of correct answers resting on a
# wrong step from the full comparison's starts that leave room for one (docs/compare.md, short
# task: -0.053 and -0.036 against GRPO from starts 0 and 1, paired intervals excluding 0; from
# start 2, whose warm-up already reasons right, it changes nothing and costs 0.029 accuracy)
DEFAULT_METHOD = "pure"

# what PRIME does at this scale, measured (docs/compare.md): said where a user meets it
PRIME_NOTE = ("prime learns its implicit PRM from outcome labels alone; at the demo's response "
              "length and step budget it does not learn (loss ~ln 2) and accuracy usually falls "
              "(docs/compare.md); the step-label PRM below is not used by it")

# the table's rows: (label, key of evaluate_arithmetic's result, the comparison's column)
METRICS = (("accuracy", "accuracy", "greedy accuracy"),
           ("fully correct (every step right)", "all_steps_correct", "greedy fully correct"),
           ("correct answers resting on a wrong step", "correct_with_wrong_step",
            "greedy correct with a wrong step"))
CURVES = (("reward/outcome_mean", "outcome reward (train batch)"),
          ("exact/correct_with_wrong_step_frac", "correct with a wrong step (train batch)"),
          ("prm/score_mean", "PRM step score (mean)"),
          ("response/length_mean", "response tokens (mean)"))


@dataclass
class DemoConfig:
    run_dir: str = "runs/demo"
    method: str = DEFAULT_METHOD
    baseline: str = BASELINE
    seed: int = 0
    warmup_steps: int = 400  # the start's other settings: start.WarmupConfig, start.recipe
    prm_steps: int = 3000
    prm_examples: int = 16000
    prm_init: str = "random"  # runs.PRM_INITS
    rl_steps: int = 40
    eval_problems: int = 200
    from_scratch: bool = False
    task: str = "short"  # a key of runs.TASKS; only the short task's start is shipped

    def __post_init__(self):

        if self.method not in METHODS:
            raise ValueError(f"--method={self.method!r}: choose one of {list(METHODS)}")
        if self.method == self.baseline:
            raise ValueError(f"--method={self.method}: that is the baseline the demo compares "
                             f"with; pick a process-reward method, e.g. --method pure")
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task}: unknown task; choose from {list(TASKS)}")
        if self.prm_init not in PRM_INITS:
            raise ValueError(f"--prm-init {self.prm_init}: choose from {list(PRM_INITS)}")
        for k in ("warmup_steps", "prm_steps", "prm_examples", "rl_steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)}: must be >= 1")
        if self.eval_problems < 2:
            raise ValueError(f"--eval-problems={self.eval_problems}: must be >= 2")


# ------------------------------------------------------------------ stage cache (also compare's)


# ------------------------------------------------------------------------------ evaluation


class _Recording:
    """An engine whose `generate` keeps what it returned (the texts behind the numbers)."""
    def __init__(self, engine):
        self.engine, self.batches = engine, []

    def generate(self, *args, **kwargs):
        out = self.engine.generate(*args, **kwargs)
        self.batches.append(out)
        return out


def evaluate_and_record(engine, tokenizer, groups: Groups, problems: list,
                        max_tokens: int = 64) -> dict:
    """Greedy evaluation with the project's `evaluate_arithmetic` (dp-sharded, exact step
    checks), plus every rank's generated texts in problem order (for an independent recount)."""

    rec = _Recording(engine)
    res = evaluate_arithmetic(rec, tokenizer, groups, problems, max_tokens=max_tokens)
    (batch,) = rec.batches
    lo, hi = shard(problems, groups)  # evaluate_arithmetic's shard of this rank
    mine = problems[lo:hi]
    local = [[mine[g].prompt, t, r] for g, t, r in zip(batch.group_index.tolist(),
                                                       batch.decode_responses(tokenizer),
                                                       batch.finish_reason)]
    if groups.dp_size > 1:
        parts = [None] * groups.dp_size
        dist.all_gather_object(parts, local, group=groups.host_dp)
        local = [x for part in parts for x in part]
    return {**res, "prompts": [x[0] for x in local], "texts": [x[1] for x in local],
            "finish": [x[2] for x in local]}


def _rank_cpu_seconds(groups: Groups) -> float:
    """CPU-seconds (user + system) of every rank so far, summed over the ranks."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    t = torch.tensor([ru.ru_utime + ru.ru_stime], dtype=torch.float64)
    if groups.world_size > 1:
        dist.all_reduce(t)
    return float(t.item())


def _load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------ the run

def run(dcfg: DemoConfig, groups: Groups) -> dict:
    """Start (shipped or rebuilt), the before-RL evaluation, RL for the baseline and the method
    (RUN_DIR/rl/<method>-s<seed>, made afresh), their evaluations; the report (rank 0 writes
    RUN_DIR/demo.json and RUN_DIR/demo_curves.png)."""

    t0 = time.perf_counter()
    load_start = _load()
    say = print if groups.rank == 0 else (lambda *a, **k: None)
    times = {}
    tok = build_char_tokenizer()
    rec = start.recipe(dcfg.warmup_steps, dcfg.prm_steps, dcfg.prm_examples, dcfg.task,
                       dcfg.prm_init)
    if dcfg.method == "prime":
        say(f"[demo] {PRIME_NOTE}", flush=True)
    begin = start.ensure(dcfg.run_dir, rec, groups, tok, dcfg.from_scratch, say)
    times["start"] = time.perf_counter() - t0
    man = begin["manifest"]

    problems = held_out_problems(dcfg.eval_problems, dcfg.task)
    max_tokens = MAX_TOKENS[dcfg.task]
    t = time.perf_counter()
    engine = build_engine(RolloutConfig(engine="hf"), begin["sft"], tok,
                          world_size=groups.world_size, tp_size=1, seed=0, device=rank_device())
    before = evaluate_and_record(engine, tok, groups, problems, max_tokens)
    del engine
    times["eval_before_rl"] = time.perf_counter() - t
    say(f"[demo] before RL: accuracy {before['accuracy']:.3f} on {before['problems']} held-out "
        f"problems ({times['eval_before_rl']:.0f}s)", flush=True)

    ccfg = CompareConfig(rl_steps=dcfg.rl_steps, eval_problems=dcfg.eval_problems,
                                 warmup_steps=dcfg.warmup_steps, prm_steps=dcfg.prm_steps,
                                 prm_examples=dcfg.prm_examples, task=dcfg.task,
                                 prm_init=dcfg.prm_init,
                                 # metrics.jsonl and the PNG are the record; wandb's offline
                                 # writer costs seconds a run and floods the demo's output
                                 wandb="disabled")
    runs = {}
    for m in (dcfg.baseline, dcfg.method):
        spec = RunSpec(m, "implicit" if m == "prime" else "learned", dcfg.seed)
        d = os.path.join(dcfg.run_dir, "rl", f"{m}-s{dcfg.seed}")
        if groups.rank == 0 and os.path.isdir(d):
            shutil.rmtree(d)
        if groups.world_size > 1:
            dist.barrier()
        overrides = run_overrides(spec, ccfg, begin["sft"], begin["prm"])
        cfg = load_config(RL_YAML, [f"trainer.run_dir={d}", *overrides])
        say(f"[demo] RL: {m}, {dcfg.rl_steps} steps of {cfg.data.prompts_per_step} prompts x "
            f"{cfg.rollout.n} samples", flush=True)
        t = time.perf_counter()
        trainer = RLTrainer(cfg, groups, tok)
        history = trainer.fit()
        rl_s = time.perf_counter() - t
        t = time.perf_counter()
        after = trainer.evaluate_with_engine(
            lambda engine: evaluate_and_record(engine, tok, groups, problems, max_tokens))
        eval_s = time.perf_counter() - t
        if groups.world_size > 1:
            dist.barrier()  # rank 0 has written every step's metrics
        rows = read_metrics(d)
        phases = {}
        for h in history:
            for k, v in h.items():
                if k.startswith("timing/") and k != "timing/step_s":
                    phases[k[7:]] = phases.get(k[7:], 0.0) + v
        runs[m] = {"method": m, "dir": d, "overrides": overrides, "after_rl": after,
                   "rl_steps_run": len(history), "rl_s": rl_s, "eval_s": eval_s,
                   "rl_phase_times_s": phases,
                   "curves": {k: [r.get(k) for r in rows] for k, _ in CURVES}}
        times[f"rl_{m}"] = rl_s
        times[f"eval_{m}"] = eval_s
        del trainer, history
        gc.collect()
        say(f"[demo] {m}: accuracy {after['accuracy']:.3f} after RL ({rl_s:.0f}s RL, "
            f"{eval_s:.0f}s evaluation)", flush=True)


    summary = {
        "config": asdict(dcfg), "world_size": groups.world_size, "device": str(rank_device()),
        "task": repr(TASKS[dcfg.task]), "held_out_seed_problems": dcfg.eval_problems,
        "start": {"source": begin["source"], "recipe_digest": man["digest"],
                  "sft_final_loss": man.get("sft_final_loss"), "prm_eval": man["prm_eval"],
                  "build_s": man.get("build"), "rebuild_check": begin.get("rebuild_check")},
        "before_rl": before, "runs": runs, "times_s": times,
        "total_s": time.perf_counter() - t0, "wall_since_launch_s": seconds_since_launch(),
        "rank_cpu_s": _rank_cpu_seconds(groups), "load": {"start": load_start, "end": _load()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    summary["spread"] = spread(summary, _read_compare(COMPARE_JSON))
    if groups.rank == 0:
        os.makedirs(dcfg.run_dir, exist_ok=True)
        with open(os.path.join(dcfg.run_dir, "demo.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=float)
        plot_curves(summary, os.path.join(dcfg.run_dir, "demo_curves.png"))
    return summary


# ------------------------------------------------------------------ the comparison's spread

def _read_compare(path: str) -> dict | None:
    """docs/compare/compare.json, or None (not in a checkout, unreadable): read defensively,
    only `rows[*].method/prm/seeds` and `rows[*][column].per_seed` are used."""
    try:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        return rep if isinstance(rep, dict) and isinstance(rep.get("rows"), list) else None
    except (OSError, ValueError):
        return None


def _row(rep: dict, method: str) -> dict | None:
    for r in rep.get("rows", []):
        if isinstance(r, dict) and r.get("method") == method and r.get("prm") != "oracle" \
                and not r.get("hack"):
            return r
    return None


def _per_seed(row: dict, column: str) -> dict:
    """{(start, seed): value} of one row's column; a one-start report's rows list no `starts`
    (start 0). Keyed by both: seed s of start 0 and seed s of start 1 are different runs."""
    cell = row.get(column)
    vals = cell.get("per_seed") if isinstance(cell, dict) else None
    seeds = row.get("seeds") or list(range(len(vals or [])))
    starts = row.get("starts") or [0] * len(seeds)
    if not isinstance(vals, list) or not len(vals) == len(seeds) == len(starts):
        return {}
    return {(k, s): float(v) for k, s, v in zip(starts, seeds, vals)
            if isinstance(v, (int, float))}


def spread(summary: dict, rep: dict | None) -> dict:
    """Per metric: the demo's difference (method - baseline, after RL) and the full comparison's
    paired differences of the same two methods (paired by start and seed). A single seed's
    difference is `within` the spread when it is no larger than 2 standard deviations of those
    paired differences (what seed-to-seed noise, and with several starts the starts' too, gives
    one run in ~95% of draws, normal approximation); the comparison's mean difference comes with
    its 95% t-interval over the paired runs."""
    base, meth = summary["config"]["baseline"], summary["config"]["method"]
    out = {"baseline": base, "method": meth, "metrics": {}}
    rb, rm = (_row(rep, base), _row(rep, meth)) if rep else (None, None)
    if rep is None:
        out["note"] = f"no full comparison found ({COMPARE_JSON})"
    elif rb is None or rm is None:
        out["note"] = (f"the full comparison has no {meth if rm is None else base} row "
                       "(`megaprm compare --methods ...` adds it)")
    for label, key, column in METRICS:
        d = summary["runs"][meth]["after_rl"][key] - summary["runs"][base]["after_rl"][key]
        m = {"label": label, "demo_diff": d}
        if rb is not None and rm is not None:
            a, b = _per_seed(rm, column), _per_seed(rb, column)
            pairs = sorted(set(a) & set(b))
            diffs = [a[k] - b[k] for k in pairs]
            if len(diffs) >= 2:
                mean = sum(diffs) / len(diffs)
                sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
                m.update(compare_diffs=diffs, compare_mean=mean, compare_sd=sd,
                         compare_ci95=t975(len(diffs) - 1) * sd / math.sqrt(len(diffs)),
                         compare_starts=len({k for k, _ in pairs}), within=abs(d) <= 2 * sd)
        out["metrics"][key] = m
    return out


def spread_sentences(sp: dict) -> list:
    """Plain sentences on whether one seed's differences mean anything."""
    meth, base = _name(sp["method"]), _name(sp["baseline"])
    if sp.get("note"):
        return [(f"One seed only, and {sp['note']}: no spread to judge this run's differences "
                "against.")]
    starts = max((m.get("compare_starts", 1) for m in sp["metrics"].values() if "within" in m),
                 default=1)
    if starts > 1:  # the spread of runs across starts and seeds: what one new run can land on
        lines = [(f"One seed's difference {meth} - {base} against the spread the full comparison "
                  f"measured over its {starts} starts and their seeds (2 standard deviations of "
                  "its paired runs' differences):")]
    else:
        lines = [(f"One seed's difference {meth} - {base} against the seed-to-seed spread the "
                  "full comparison measured (2 standard deviations of its per-seed differences):")]
    for m in sp["metrics"].values():
        if "within" not in m:
            continue
        verdict = ("within the spread: this seed alone cannot tell the two methods apart"
                   if m["within"] else "larger than the spread")
        n = len(m["compare_diffs"])
        over = (f"{n} paired runs ({m['compare_starts']} starts)"
                if m.get("compare_starts", 1) > 1 else f"{n} seeds")
        lines.append(f"- {m['label']}: {m['demo_diff']:+.3f} (spread ±{2 * m['compare_sd']:.3f})"
                     f", {verdict}; over {over} the comparison measured "
                     f"{m['compare_mean']:+.3f} ± {m['compare_ci95']:.3f} (95%).")
    return lines


# ------------------------------------------------------------------------------ the report

def _name(m: str) -> str:
    return {"prof_grpo": "PROF-GRPO", "drgrpo": "Dr. GRPO"}.get(m, m.upper())


def table_rows(s: dict) -> list:
    """[(label, before, baseline after, method after)] from a demo.json."""
    base, meth = s["config"]["baseline"], s["config"]["method"]
    return [(label, s["before_rl"][key], s["runs"][base]["after_rl"][key],
             s["runs"][meth]["after_rl"][key]) for label, key, _ in METRICS]


def _times_line(s: dict) -> str:
    t = s["times_s"]
    base, meth = s["config"]["baseline"], s["config"]["method"]
    src = s["start"]["source"]
    parts = [f"start {t['start']:.0f}s ({src})", f"evaluation before RL {t['eval_before_rl']:.0f}s"]
    for m in (base, meth):
        parts.append(f"{_name(m)} RL {t[f'rl_{m}']:.0f}s + evaluation {t[f'eval_{m}']:.0f}s")
    wall = s.get("wall_since_launch_s")
    total = (f"wall {wall:.0f}s since `megaprm demo` started (ranks and imports included)"
             if wall is not None else f"total {s['total_s']:.0f}s")
    return ("; ".join(parts) + f"; {total}; CPU-seconds of the {s['world_size']} ranks "
            f"{s['rank_cpu_s']:.0f}; 1/5/15-min load {s['load']['start']} at the start, "
            f"{s['load']['end']} at the end")


def print_summary(s: dict) -> None:
    base, meth = s["config"]["baseline"], s["config"]["method"]
    st = s["start"]
    b = s["before_rl"]
    print("\n==================== megaprm demo ====================")
    print(f"{_name(meth)} (process reward) vs {_name(base)}: {s['config']['rl_steps']} RL steps "
          f"each from the same warm-up policy, seed {s['config']['seed']}, "
          f"{s['world_size']} ranks ({s['device']})")
    print(f"PRM held-out step AUROC: {st['prm_eval']['auroc']:.3f} (start: {st['source']})"
          + (f"\n{PRIME_NOTE}" if meth == "prime" else ""))
    print(f"greedy, {b['problems']} held-out problems, every step checked exactly:")
    w = max(len(r[0]) for r in table_rows(s))
    print(f"  {'':{w}}  {'before RL':>9}  {_name(base) + ' after':>12}  "
          f"{_name(meth) + ' after':>12}")
    for label, x, y, z in table_rows(s):
        print(f"  {label:{w}}  {x:9.3f}  {y:12.3f}  {z:12.3f}")
    for line in spread_sentences(s["spread"]):
        print(line)
    rc = st.get("rebuild_check")
    if rc is not None:
        print("start rebuilt from scratch: " + start.rebuild_sentence(rc))
    print("time: " + _times_line(s))
    for m in (base, meth):
        ph = s["runs"][m]["rl_phase_times_s"]
        print(f"{_name(m)} RL phases (s): " + "  ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    rd = s["config"]["run_dir"]
    print(f"wrote: {rd}/demo.json, {rd}/demo_curves.png, RL runs "
          + ", ".join(s["runs"][m]["dir"] for m in (base, meth)))
    print("======================================================\n", flush=True)


def plot_curves(s: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, meth = s["config"]["baseline"], s["config"]["method"]
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for ax, (key, title) in zip(axes, CURVES):
        for m, style in ((base, "-"), (meth, "-")):
            ys = s["runs"][m]["curves"].get(key) or []
            pts = [(i + 1, y) for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
            if pts:
                ax.plot(*zip(*pts), style, label=_name(m), lw=1.4)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"megaprm demo: {_name(meth)} vs {_name(base)} (seed {s['config']['seed']}, "
                 f"PRM AUROC {s['start']['prm_eval']['auroc']:.3f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# README's demo block before a measured run is committed (docs/demo/demo.json absent)
NO_RUN_BLOCK = ("No measured run is committed yet: `make demo` prints the table, and "
                "`.venv/bin/megaprm demo --write-readme` writes it here with docs/demo/demo.json.")


def readme_block(s: dict, png: str = "docs/demo/demo_curves.png") -> str:
    """README's demo section, from a demo.json alone (so it is the run's numbers)."""
    base, meth = s["config"]["baseline"], s["config"]["method"]
    c = s["config"]
    lines = [(f"Measured {s['date']} with `make demo` ({_name(meth)} vs {_name(base)}, seed "
             f"{c['seed']}, {c['rl_steps']} RL steps each, {s['world_size']} torchrun ranks on "
             f"{s['device'].upper()}): greedy decoding on {s['before_rl']['problems']} held-out problems, "
             f"every step checked exactly. PRM held-out step AUROC "
             f"{s['start']['prm_eval']['auroc']:.3f}. Output: "
             "[docs/demo/demo.json](docs/demo/demo.json)."), "",
             f"| | before RL (warm-up) | {_name(base)} after RL | {_name(meth)} after RL |",
             "| --- | --- | --- | --- |"]
    for label, x, y, z in table_rows(s):
        lines.append(f"| {label} | {x:.3f} | {y:.3f} | {z:.3f} |")
    lines.append("")
    lines += spread_sentences(s["spread"])
    lines += ["", "Time: " + _times_line(s) + ".", "", f"![demo curves]({png})"]
    return "\n".join(lines)


def respread(summary_path: str, compare_json: str = COMPARE_JSON) -> dict:
    """A finished demo's demo.json with its `spread` paired again against the committed
    comparison (after the comparison is rerun, the demo's runs stay what they were); written
    back in place (temporary file, then rename) and returned."""
    with open(summary_path, encoding="utf-8") as f:
        s = json.load(f)
    for key in ("config", "runs", "before_rl", "start"):
        if key not in s:
            raise ValueError(f"{summary_path}: not a demo.json (no {key!r}); give the demo.json "
                             "a `megaprm demo` run wrote")
    s["spread"] = spread(s, _read_compare(compare_json))
    tmp = summary_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(s, f, indent=1, default=float)
    os.replace(tmp, summary_path)
    return s


def write_readme(summary_path: str, readme: str = "README.md", docs_dir: str = DOCS_DIR) -> None:
    """Copy a run's demo.json and PNG to docs/demo/ and regenerate README's demo block."""
    with open(summary_path, encoding="utf-8") as f:
        s = json.load(f)
    os.makedirs(docs_dir, exist_ok=True)
    png = os.path.join(os.path.dirname(summary_path), "demo_curves.png")
    if os.path.abspath(summary_path) != os.path.abspath(os.path.join(docs_dir, "demo.json")):
        shutil.copy(summary_path, os.path.join(docs_dir, "demo.json"))
        if os.path.isfile(png):
            shutil.copy(png, os.path.join(docs_dir, "demo_curves.png"))
    replace_block(readme, "demo", readme_block(s, os.path.join(docs_dir, "demo_curves.png")))

"""`megaprm compare`: the methods side by side on the arithmetic task, where every step of every
solution is checked exactly, so "right for the right reasons" is measured, not estimated.

One warm-up policy and one PRM are trained once (cached by their settings, shared with nothing
else), then every (method, process reward, seed) runs RL from that same start with the same
actor settings (configs/demo.yaml; only the rewards and the estimator differ, each method's own
knobs in `runs.METHOD_OVERRIDES`), and is evaluated on the same held-out problems, greedy and
sampled at the rollout temperature. Process rewards: `learned` (the PRM trained here),
`oracle` (the task's exact step labels, `prm.kind=oracle`: the best any PRM could do) and
`implicit` (PRIME's own PRM). A reward-hacking run trains PURE on the PRM alone
(`advantage.pure.reward_mode=PRM`, no outcome reward) and keeps its monitors.

Output in RUN_DIR: compare.json (every run, per seed and aggregated: mean and a 95% t-interval
over seeds), compare.md (the table), plots/*.png (bars per method, curves over RL steps, the
reward-hacking monitors). Resumable: a finished run (its result.json, same settings) is not
re-run; an interrupted one restarts from step 0.

The driver: the stages and the runs here, the shared design in runs.py, the warm-up and the PRM
in start.py, the statistics in stats.py, the table and plots in report.py.
"""
from __future__ import annotations

import functools
import gc
import json
import math
import os
import shutil
import time
from dataclasses import asdict

from megaprm.config import RolloutConfig, load_config
from megaprm.digest import json_digest
from megaprm.experiments.arithmetic import stats
from megaprm.experiments.arithmetic.report import (
    COLUMNS,
    CURVE_KEYS,
    EVAL_RATIOS,
    PAIRED,
    lookup,
    markdown,
    plot,
)
from megaprm.experiments.arithmetic.runs import (
    READS_STEP_SCORES,
    REFERENCE,
    RL_YAML,
    TASK,
    VARIANTS,
    CompareConfig,
    RunSpec,
    base_method,
    held_out_problems,
    plan,
    repo_relative,
    run_overrides,
)
from megaprm.experiments.arithmetic.start import (
    WarmupConfig,
    cached_stage,
    init_policy,
    mark_stage_done,
    prm_recipe,
    warmup,
    warmup_digest,
)
from megaprm.models.tiny import save_tiny_model
from megaprm.parallel.device import rank_device
from megaprm.parallel.groups import Groups
from megaprm.rollout.factory import build_engine
from megaprm.tasks.tokenizer import build_char_tokenizer
from megaprm.trainer.evaluate import evaluate_arithmetic
from megaprm.trainer.loop import RLTrainer
from megaprm.trainer.metrics import read_metrics
from megaprm.trainer.prm_training import PRMTrainConfig, train_prm

SAMPLED_SEED = 424_242
EVAL_FORMAT = "per-problem-v1"


# ------------------------------------------------------------------------------ stages

def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, obj, groups: Groups) -> None:
    if groups.rank == 0:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, default=float)
        os.replace(tmp, path)
    _barrier(groups)


def _barrier(groups: Groups) -> None:
    if groups.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _say(groups: Groups, msg: str) -> None:
    if groups.rank == 0:
        print(f"[compare] {msg}", flush=True)


def warmup_stage(ccfg: CompareConfig, groups: Groups, tok) -> tuple[str, dict]:
    """The demo's supervised warm-up (same code, own directory), cached by its settings."""
    wcfg = WarmupConfig(warmup_steps=ccfg.warmup_steps)
    sft_dir = os.path.join(ccfg.run_dir, "sft")
    digest = warmup_digest(wcfg)
    rec = cached_stage(sft_dir, digest)
    if rec is None:
        t = time.perf_counter()
        init_dir = init_policy(wcfg, tok, os.path.join(ccfg.run_dir, "init"), groups.rank)
        rec = {"final_loss": warmup(wcfg, groups, tok, init_dir, sft_dir),
               "seconds": time.perf_counter() - t}
        mark_stage_done(sft_dir, digest, groups, **rec)
    else:
        _say(groups, f"warm-up: reusing {sft_dir} (same settings)")
    return sft_dir, {**rec, "digest": digest}


def _prm_digest(ccfg: CompareConfig) -> str:
    recipe = prm_recipe(ccfg.prm_steps, ccfg.prm_examples)
    # the logging interval does not change the PRM (normalised so a cache survives it)
    return json_digest({"recipe": {**recipe, "log_every": 0}, "hidden": ccfg.prm_hidden,
                        "layers": ccfg.prm_layers})


def check_only_finished(ccfg: CompareConfig) -> None:
    """`--only-finished` runs nothing new, so the run directory must already hold this
    comparison's warm-up and PRM (same settings) and at least one finished cell; checked before
    any rank starts, as otherwise the stages would be trained (minutes) to report nothing."""
    missing = [name for name, d, digest in (
        ("warm-up", "sft", warmup_digest(WarmupConfig(warmup_steps=ccfg.warmup_steps))),
        ("PRM", "prm", _prm_digest(ccfg)))
        if cached_stage(os.path.join(ccfg.run_dir, d), digest) is None]
    rl = os.path.join(ccfg.run_dir, "rl")
    if not any(os.path.isfile(os.path.join(rl, name, "result.json"))
               for name in (os.listdir(rl) if os.path.isdir(rl) else ())):
        missing.append("finished run")
    if missing:
        raise ValueError(f"--only-finished: {ccfg.run_dir} has no {', no '.join(missing)} with "
                         "these settings, and the flag runs nothing new; run `megaprm compare` "
                         "without --only-finished first (or pass the --run-dir and settings of "
                         "a finished comparison)")


def prm_stage(ccfg: CompareConfig, groups: Groups, tok) -> tuple[str, dict]:
    """The comparison's PRM: docs/prm.md's recipe from a random-init trunk, cached."""
    prm_dir = os.path.join(ccfg.run_dir, "prm")
    recipe = prm_recipe(ccfg.prm_steps, ccfg.prm_examples)
    digest = _prm_digest(ccfg)
    rec = cached_stage(prm_dir, digest)
    if rec is not None:
        _say(groups, f"PRM: reusing {prm_dir} (same settings, held-out step AUROC "
                     f"{rec['auroc']:.3f})")
        return prm_dir, rec
    init_dir = os.path.join(ccfg.run_dir, "prm_init")
    if groups.rank == 0:
        save_tiny_model("qwen2", init_dir, seed=0, tokenizer=tok, vocab_size=len(tok),
                        hidden_size=ccfg.prm_hidden, num_layers=ccfg.prm_layers, num_heads=4,
                        num_kv_heads=2, intermediate_size=3 * ccfg.prm_hidden,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    _barrier(groups)
    _say(groups, f"PRM: training ({ccfg.prm_steps} steps x 64 solutions; docs/prm.md's recipe)")
    res = train_prm(PRMTrainConfig(model_dir=init_dir, output_dir=prm_dir, **recipe), groups)
    rec = {"auroc": res.eval.auroc, "f1": res.eval.f1, "train_s": res.train_seconds,
           "per_kind": res.eval.per_kind,
           "recipe": {k: (v if k != "arithmetic" else repr(v)) for k, v in recipe.items()},
           "trunk": f"qwen2 hidden {ccfg.prm_hidden}, {ccfg.prm_layers} layers, random init"}
    mark_stage_done(prm_dir, digest, groups, **rec)
    return prm_dir, {**rec, "digest": digest}


def evaluate_policy(engine, tok, groups: Groups, ccfg: CompareConfig, temperature: float) -> dict:
    probs = held_out_problems(ccfg.eval_problems)

    greedy = evaluate_arithmetic(engine, tok, groups, probs, per_problem=True)
    sampled = evaluate_arithmetic(engine, tok, groups, probs, temperature=temperature,
                                  n=ccfg.sampled_n, seed=SAMPLED_SEED, per_problem=True)
    return {"greedy": greedy, "sampled": sampled}


def baseline_stage(ccfg: CompareConfig, groups: Groups, tok, sft_dir: str, sft_digest: str,
                   temperature: float) -> dict:
    """The warm-up policy's evaluation: the common 'before RL' row."""
    path = os.path.join(ccfg.run_dir, "baseline.json")
    digest = json_digest([sft_digest, ccfg.eval_problems, ccfg.sampled_n, temperature, EVAL_FORMAT])
    rec = _read_json(path)
    if rec is not None and rec.get("digest") == digest:
        return rec
    engine = build_engine(RolloutConfig(engine="hf"), sft_dir, tok, world_size=groups.world_size,
                          tp_size=1, seed=0, device=rank_device())
    rec = {"digest": digest, **evaluate_policy(engine, tok, groups, ccfg, temperature)}
    del engine
    _write_json(path, rec, groups)
    return rec


def _curves(run_dir: str) -> dict:
    """The monitors per RL step, read back from the run's metrics.jsonl (so a finished run's
    curves are the file's, whichever keys the report asks for)."""

    rows = read_metrics(run_dir)
    return {k: [r.get(k) for r in rows] for k in CURVE_KEYS if any(k in r for r in rows)}


def _tail_mean(xs: list, n: int = 5) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs[-n:]) / len(xs[-n:]) if xs else None


def run_one(spec: RunSpec, ccfg: CompareConfig, groups: Groups, tok, sft_dir: str, prm_dir: str,
            base_digest: str, only_finished: bool = False) -> dict | None:
    """One (method, process reward, seed) cell: its finished result from disk when one with the
    same settings is there, else RL from the warm-up and the evaluation (None instead when
    `only_finished`)."""

    d = os.path.join(ccfg.run_dir, "rl", spec.name)
    overrides = run_overrides(spec, ccfg, sft_dir, prm_dir)
    # EVAL_FORMAT: a result without per-problem counts is re-run, not mixed in
    digest = json_digest([base_digest, overrides, ccfg.eval_problems, ccfg.sampled_n, EVAL_FORMAT])
    res_path = os.path.join(d, "result.json")
    rec = _read_json(res_path)
    if rec is not None and rec.get("digest") == digest:
        _say(groups, f"{spec.name}: reusing the finished run in {d}")
        rec["curves"] = _curves(d)
        rec["train_end"] = {k: _tail_mean(v) for k, v in rec["curves"].items()}
        return rec
    if only_finished:
        return None
    if groups.rank == 0 and os.path.isdir(d):  # interrupted or other settings: start over
        shutil.rmtree(d)
    _barrier(groups)
    cfg = load_config(RL_YAML, [f"trainer.run_dir={d}", *overrides])
    t = time.perf_counter()
    trainer = RLTrainer(cfg, groups, tok)
    history = trainer.fit()
    rl_s = time.perf_counter() - t
    ev = trainer.lifecycle.generate(functools.partial(
        evaluate_policy, trainer.engine, tok, groups, ccfg, cfg.rollout.temperature))
    _barrier(groups)  # rank 0 has written every step's metrics
    curves = _curves(d)
    rec = {"digest": digest, **asdict(spec), "name": spec.name, "overrides": overrides, **ev,
           "train_end": {k: _tail_mean(v) for k, v in curves.items()},
           "curves": curves, "rl_s": rl_s, "eval_s": time.perf_counter() - t - rl_s}
    del trainer, history
    gc.collect()
    _write_json(res_path, rec, groups)
    return rec


# ------------------------------------------------------------------------------ statistics

def _counts(recs: list, label: str):
    """[seeds, problems] numerator and denominator arrays of an evaluation column, or None when
    a run lacks per-problem counts."""
    import numpy as np

    ev, num, den = EVAL_RATIOS[label]
    nums, dens = [], []
    for r in recs:
        pp = lookup(r, (ev, "per_problem"))
        if not pp:
            return None
        per = r[ev]["samples"] // max(r[ev]["problems"], 1)
        nums.append(pp[num])
        dens.append(pp[den] if den != "samples" else [per] * len(pp[num]))
    return np.asarray(nums, float), np.asarray(dens, float)


def _seed_wilson(recs: list, label: str) -> list:
    """Each seed's Wilson 95% interval: the evaluation's binomial noise alone (the samples of
    one run as the trials; for the wrong-step share, the correct answers)."""
    ev, num, den = EVAL_RATIOS[label]
    out = []
    for r in recs:
        pp = r[ev]["per_problem"]
        k = sum(pp[num])
        n = r[ev]["samples"] if den == "samples" else sum(pp[den])
        out.append(list(stats.wilson(k, n)))
    return out


def _plateau(mean_curve: list, window: int = 10) -> dict:
    """Where a (seed-averaged) training curve flattens: the first step whose trailing
    `window`-step mean has made 90% of the rise from the first window to the last, and the
    slope (per 100 steps) of a least-squares line through the last quarter of the steps."""
    xs = [x for x in mean_curve if x is not None and math.isfinite(x)]
    if len(xs) < 2 * window:
        return {"steps": len(xs), "step90": None, "first": None, "last": None,
                "slope_last_quarter": None}
    trail = [sum(xs[i - window + 1:i + 1]) / window for i in range(window - 1, len(xs))]
    first, last = trail[0], trail[-1]
    rise = last - first
    step90 = (next(i + window - 1 for i, v in enumerate(trail) if v >= first + 0.9 * rise)
              if rise > 0 else None)
    q = xs[-max(len(xs) // 4, 2):]
    mx = (len(q) - 1) / 2
    my = sum(q) / len(q)
    slope = (sum((i - mx) * (y - my) for i, y in enumerate(q))
             / sum((i - mx) ** 2 for i in range(len(q))))
    return {"steps": len(xs), "step90": step90, "first": first, "last": last,
            "slope_last_quarter": 100 * slope}


def aggregate(results: list, ccfg: CompareConfig) -> list:
    """One row per (method, process reward): per-seed values, mean and intervals per column.
    An oracle row of a method that reads no step scores is its learned row (same run).

    Per evaluation column: `lo`/`hi`, the two-level bootstrap's 95% interval of the mean over
    seeds (seeds, then problems; `stats.hier_bootstrap`), `ci95` the old t half-width
    (kept for readers of earlier reports), `wilson` every seed's Wilson interval, and `noise`
    (evaluation vs seed SD of one seed's value). `paired`: per column of PAIRED, the row's
    difference from GRPO's run of the same seed, per seed, with the paired bootstrap's 95%
    interval over the seeds both rows have; `separated` when that interval excludes 0."""

    rows, by_key = [], {}
    for r in results:
        if not r.get("hack"):
            by_key.setdefault((r["method"], r["prm"]), []).append(r)
    keys = list(by_key)
    for m in ccfg.oracle:
        if m not in READS_STEP_SCORES and (m, "oracle") not in by_key:
            src = (m, "implicit" if base_method(m) == "prime" else "learned")
            if src in by_key:
                by_key[(m, "oracle")] = by_key[src]
                keys.append((m, "oracle"))
    ref = {r["seed"]: r for r in by_key.get((REFERENCE, "learned"), [])}
    for key in keys:
        recs = sorted(by_key[key], key=lambda r: r["seed"])
        row = {"method": key[0], "prm": key[1], "seeds": [r["seed"] for r in recs],
               "same_run_as_learned": key[1] == "oracle" and key[0] not in READS_STEP_SCORES,
               "variant_of": VARIANTS[key[0]][0] if key[0] in VARIANTS else None,
               "variant_overrides": VARIANTS[key[0]][1] if key[0] in VARIANTS else []}
        for label, path in COLUMNS:
            vals = [lookup(r, path) for r in recs]
            row[label] = {"per_seed": vals, **stats.mean_ci(vals)}
            cnt = _counts(recs, label) if label in EVAL_RATIOS else None
            if cnt is not None:
                boot = stats.hier_bootstrap(*cnt, reps=ccfg.bootstrap_reps)
                row[label].update(lo=boot["lo"], hi=boot["hi"], wilson=_seed_wilson(recs, label),
                                  noise=stats.noise(*cnt, reps=ccfg.bootstrap_reps))
        if (key != (REFERENCE, "learned") and not row["same_run_as_learned"]
                and any(r["seed"] in ref for r in recs)):
            both = [r for r in recs if r["seed"] in ref]
            row["paired"] = {"reference": REFERENCE, "seeds": [r["seed"] for r in both]}
            for label in PAIRED:
                mine, theirs = _counts(both, label), _counts([ref[r["seed"]] for r in both], label)
                if mine is None or theirs is None:
                    continue
                boot = stats.hier_bootstrap(*mine, *theirs, reps=ccfg.bootstrap_reps)
                path = dict(COLUMNS)[label]
                row["paired"][label] = {
                    "per_seed": [lookup(r, path) - lookup(ref[r["seed"]], path) for r in both],
                    "mean": boot["mean"], "lo": boot["lo"], "hi": boot["hi"],
                    "separated": bool(boot["lo"] > 0 or boot["hi"] < 0)}
        curve = _mean_curve([r["curves"].get("reward/outcome_mean", []) for r in recs])
        row["plateau"] = _plateau(curve)
        row["plateau_wrong_step"] = _plateau(_mean_curve(
            [r["curves"].get("exact/correct_with_wrong_step_frac", []) for r in recs]))
        if base_method(key[0]) == "prime":  # the implicit PRM's loss: ln 2 = not learning
            row["implicit_prm_loss"] = _plateau(_mean_curve(
                [r["curves"].get("prm/loss", []) for r in recs]))
        rows.append(row)
    return rows


def _mean_curve(series: list) -> list:
    series = [s for s in series if s]
    if not series:
        return []
    steps = min(map(len, series))
    return [sum((s[i] or 0.0) for s in series) / len(series) for i in range(steps)]


# ------------------------------------------------------------------------------ driver

INTERVALS = ("mean over seeds [95% percentile interval of a two-level bootstrap: seeds with "
             "replacement, then held-out problems with replacement within each drawn seed; "
             "paired rows share the draws with GRPO's run of the same seed]; per-seed Wilson "
             "95% intervals for the evaluation's binomial part; ci95: the t half-width over "
             "seeds of earlier reports")


def _no_counts(v):
    """An evaluation without its per-problem counts (they stay in each run's result.json)."""
    return {k: x for k, x in v.items() if k != "per_problem"} if isinstance(v, dict) else v


def run(ccfg: CompareConfig, groups: Groups, only_finished: bool = False) -> dict:
    """The whole comparison (resumable: finished cells are read back from disk).
    `only_finished`: run nothing new, report the cells already finished (a run cut short)."""

    t0 = time.perf_counter()
    if only_finished:  # the launcher checked it too; a direct caller must not train either
        check_only_finished(ccfg)
    os.makedirs(ccfg.run_dir, exist_ok=True)
    tok = build_char_tokenizer()
    sft_dir, sft = warmup_stage(ccfg, groups, tok)
    t_warm = time.perf_counter() - t0
    prm_dir, prm = prm_stage(ccfg, groups, tok)
    t_prm = time.perf_counter() - t0 - t_warm
    # the runs' rollout temperature (demo.yaml's, or an override): the baseline samples at it too
    temperature = load_config(RL_YAML, list(ccfg.extra)).rollout.temperature
    baseline = baseline_stage(ccfg, groups, tok, sft_dir, sft["digest"], temperature)
    base_digest = json_digest([sft["digest"], prm["digest"]])
    runs = plan(ccfg)
    results, missing = [], []
    for i, spec in enumerate(runs):
        t = time.perf_counter()
        _say(groups, f"({i + 1}/{len(runs)}) {spec.name} ...")
        rec = run_one(spec, ccfg, groups, tok, sft_dir, prm_dir, base_digest, only_finished)
        if rec is None:
            missing.append(spec.name)
            _say(groups, f"({i + 1}/{len(runs)}) {spec.name}: not finished (--only-finished)")
            continue
        results.append(rec)
        _say(groups, f"({i + 1}/{len(runs)}) {spec.name}: greedy accuracy "
                     f"{rec['greedy']['accuracy']:.3f}, correct with a wrong step "
                     f"{rec['greedy']['correct_with_wrong_step']:.3f} "
                     f"({time.perf_counter() - t:.0f} s; {(time.perf_counter() - t0) / 60:.1f} "
                     f"min so far; load {os.getloadavg()[0]:.1f})")
    if not results:
        raise ValueError(f"--only-finished: no finished run in {ccfg.run_dir}; run without the "
                         "flag first")
    hack = next((r for r in results if r.get("hack")), None)
    report = {"methods": list(ccfg.methods), "seeds": ccfg.seeds, "rl_steps": ccfg.rl_steps,
              "eval_problems": ccfg.eval_problems, "sampled_n": ccfg.sampled_n,
              # run_dir relative to the repository: compare.json is committed
              "config": {**asdict(ccfg), "run_dir": repo_relative(ccfg.run_dir)},
              "task": repr(TASK),
              "warmup": {k: v for k, v in sft.items() if k != "digest"},
              "prm": {k: v for k, v in prm.items() if k != "digest"},
              "baseline": {k: _no_counts(v) for k, v in baseline.items() if k != "digest"},
              "planned": [s.name for s in runs], "missing": missing,
              "eval_format": EVAL_FORMAT, "intervals": INTERVALS,
              "rows": aggregate(results, ccfg),
              "hack": ({k: _no_counts(hack[k])
                        for k in ("seed", "greedy", "sampled", "train_end", "curves")}
                       if hack else None),
              "times_s": {"warmup": t_warm, "prm": t_prm,
                          "runs": {r["name"]: r["rl_s"] + r["eval_s"] for r in results}},
              "total_s": time.perf_counter() - t0,
              # what the table cost when each part was built (cached parts keep their time)
              "compute_s": {"warmup": sft.get("seconds"), "prm_train": prm.get("train_s"),
                            "runs": sum(r["rl_s"] + r["eval_s"] for r in results)},
              "device": f"CPU, {groups.world_size} torchrun rank(s)",
              "load": [round(x, 2) for x in os.getloadavg()]}
    if groups.rank == 0:
        with open(os.path.join(ccfg.run_dir, "compare.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=float)
        with open(os.path.join(ccfg.run_dir, "compare.md"), "w", encoding="utf-8") as f:
            f.write(markdown(report))
        report["plots"] = plot(report, results, os.path.join(ccfg.run_dir, "plots"))
    _barrier(groups)
    return report

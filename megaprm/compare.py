"""`megaprm compare`: the methods side by side on the arithmetic task, where every step of every
solution is checked exactly, so "right for the right reasons" is measured, not estimated.

One warm-up policy and one PRM are trained once (cached by their settings, shared with nothing
else), then every (method, process reward, seed) runs RL from that same start with the same
actor settings (configs/demo.yaml; only the rewards and the estimator differ, each method's own
knobs in `demo.METHOD_OVERRIDES`), and is evaluated on the same held-out problems, greedy and
sampled at the rollout temperature. Process rewards: `learned` (the PRM trained here),
`oracle` (the task's exact step labels, `prm.kind=oracle`: the best any PRM could do) and
`implicit` (PRIME's own PRM). A reward-hacking run trains PURE on the PRM alone
(`advantage.pure.reward_mode=PRM`, no outcome reward) and keeps its monitors.

Output in RUN_DIR: compare.json (every run, per seed and aggregated: mean and a 95% t-interval
over seeds), compare.md (the table), plots/*.png (bars per method, curves over RL steps, the
reward-hacking monitors). Resumable: a finished run (its result.json, same settings) is not
re-run; an interrupted one restarts from step 0.
"""
from __future__ import annotations

import functools
import gc
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from megaprm.digest import json_digest

if TYPE_CHECKING:  # the parser imports this module: torch and the packages load in the ranks
    from megaprm.parallel.groups import Groups

# labelled variants: (the method, overrides on top of its own). `prime_scaled`: PRIME with the
# implicit PRM's beta scaled from the released 0.05 (responses of ~600+ tokens) to ~32-token
# responses; `prime_scaled_lr`: the same beta with a 10x smaller PRM learning rate, so that the
# outcome logit moves about as fast per update as with the released pair (docs/compare.md,
# "PRIME at this response length")
VARIANTS = {"prime_scaled": ("prime", ["prm.beta=1.0"]),
            "prime_scaled_lr": ("prime", ["prm.beta=1.0", "prm.optim.lr=1e-5"])}
ALL_METHODS = ("grpo", "rloo", "prof_grpo", "papo", "pure", "prime", "prime_scaled",
               "prime_scaled_lr", "blend")
REFERENCE = "grpo"  # the paired differences are taken from this method's run of the same seed
# methods whose advantages read the discriminative/oracle step scores (the others ignore them:
# their oracle row would be the same run, so it is not re-run)
READS_STEP_SCORES = ("prof_grpo", "papo", "pure", "blend")
# monitors kept per RL step for the curves (metrics.jsonl keys)
CURVE_KEYS = ("reward/outcome_mean", "exact/correct_with_wrong_step_frac",
              "prm/outcome_agreement", "prm/score_mean", "prm/correct_with_low_prm_frac",
              "prm/loss", "response/steps_mean", "response/tokens_per_step",
              "response/length_mean", "actor/entropy")
SAMPLED_SEED = 424_242
EVAL_FORMAT = "per-problem-v1"


def base_method(name: str) -> str:
    """The registry method a (possibly variant) row name runs."""
    return VARIANTS[name][0] if name in VARIANTS else name


@dataclass
class CompareConfig:
    run_dir: str = "runs/compare"
    methods: tuple = ALL_METHODS
    seeds: int = 5
    # fewer seeds for some methods (method -> seeds, at most `seeds`), e.g. {"rloo": 3}
    method_seeds: dict = field(default_factory=dict)
    oracle: tuple = ("grpo", "prof_grpo", "papo")
    rl_steps: int = 40
    hack_steps: int = 40          # the reward-hacking run (PURE on the PRM alone); 0 = none
    eval_problems: int = 1000
    sampled_n: int = 4            # samples per held-out problem at the rollout temperature
    warmup_steps: int = 400       # the demo's warm-up
    # the PRM recipe of docs/prm.md that reached held-out step AUROC 0.942 on this task in
    # 5.6 CPU minutes: random-init hidden-64 trunk, 20 head-only + N whole-model steps of 64
    # solutions, lr 2e-3 cosine, auxiliary LM loss on correct solutions
    prm_steps: int = 3000
    prm_examples: int = 16000
    prm_hidden: int = 64
    prm_layers: int = 4
    bootstrap_reps: int = 2000
    wandb: str = "offline"
    extra: list = field(default_factory=list)  # dotted overrides applied to every RL run

    def __post_init__(self):
        from megaprm.algorithms.registry import METHODS

        self.methods = tuple(self.methods)
        self.oracle = tuple(self.oracle)
        self.method_seeds = dict(self.method_seeds)
        known = list(METHODS) + list(VARIANTS)
        for name, chosen in (("--methods", self.methods), ("--oracle", self.oracle),
                             ("--method-seeds", tuple(self.method_seeds))):
            bad = [m for m in chosen if m not in known]
            if bad:
                raise ValueError(f"{name}: unknown method(s) {bad}; choose from {known}")
        if not self.methods:
            raise ValueError("--methods: give at least one method, e.g. --methods grpo,prof_grpo")
        missing = [m for m in self.oracle if m not in self.methods]
        if missing:
            raise ValueError(f"--oracle {','.join(missing)}: an oracle row is compared with the "
                             f"method's learned row; add it to --methods as well")
        if self.seeds < 1 or self.rl_steps < 1 or self.eval_problems < 2:
            raise ValueError("--seeds and --rl-steps must be >= 1 and --eval-problems >= 2")
        bad = {m: k for m, k in self.method_seeds.items() if not 1 <= k <= self.seeds}
        if bad:
            raise ValueError(f"--method-seeds {bad}: each count must be between 1 and --seeds "
                             f"({self.seeds})")

    def seeds_of(self, method: str) -> int:
        return self.method_seeds.get(method, self.seeds)


@dataclass(frozen=True)
class RunSpec:
    method: str    # a registry method or a VARIANTS label
    prm: str       # learned | oracle | implicit
    seed: int
    hack: bool = False

    @property
    def name(self) -> str:
        return (f"hack-{self.method}-prm-only-s{self.seed}" if self.hack
                else f"{self.method}-{self.prm}-s{self.seed}")


def plan(ccfg: CompareConfig) -> list[RunSpec]:
    """Every run to make, seed-major (every row's seed 0, then seed 1, ...: a run cut short
    holds complete pairs with GRPO for its first seeds), learned before oracle within a seed,
    then the reward-hacking run."""
    runs = []
    for s in range(ccfg.seeds):
        for m in ccfg.methods:
            if s < ccfg.seeds_of(m):
                runs.append(RunSpec(m, "implicit" if base_method(m) == "prime" else "learned", s))
        for m in ccfg.oracle:
            if m in READS_STEP_SCORES and s < ccfg.seeds_of(m):
                runs.append(RunSpec(m, "oracle", s))
    if ccfg.hack_steps:
        runs.append(RunSpec("pure", "learned", 0, hack=True))
    return runs


def run_overrides(spec: RunSpec, ccfg: CompareConfig, sft_dir: str, prm_dir: str) -> list[str]:
    """The run's overrides. Paired design: every row's run with seed s gets `trainer.seed=s`,
    which fixes its prompts (seed*100_003 + block), its rollout sampling seeds (per step and
    rank) and its mini-batch order, and starts from the one warm-up policy: at step 0 every
    method's run of seed s samples exactly GRPO's responses of seed s."""
    from megaprm import demo

    method = base_method(spec.method)
    ov = [f"model.path={sft_dir}", f"prm.path={prm_dir}", "prm.kind=discriminative",
          f"trainer.steps={ccfg.hack_steps if spec.hack else ccfg.rl_steps}",
          f"trainer.seed={spec.seed}", f"advantage.method={method}",
          f"trainer.wandb={ccfg.wandb}"]
    if spec.prm == "oracle":
        ov += ["prm.kind=oracle", "prm.path=null"]
    ov += demo.METHOD_OVERRIDES.get(method, [])
    ov += VARIANTS.get(spec.method, (None, []))[1]
    if spec.hack:  # PURE's "PRM" reward mode: the process reward alone, no verifiable reward
        ov += ["advantage.pure.reward_mode=PRM"]
    return ov + list(ccfg.extra)


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
    from megaprm import demo

    """The demo's supervised warm-up (same code, own directory), cached by its settings."""
    dcfg = demo.DemoConfig(run_dir=ccfg.run_dir, warmup_steps=ccfg.warmup_steps)
    sft_dir = os.path.join(ccfg.run_dir, "sft")
    digest = demo._stage_digest(dcfg, "sft")
    rec = demo._cached(sft_dir, digest)
    if rec is None:
        t = time.perf_counter()
        init_dir = demo.init_policy(dcfg, tok, os.path.join(ccfg.run_dir, "init"), groups.rank)
        rec = {"final_loss": demo.warmup(dcfg, groups, tok, init_dir, sft_dir),
               "seconds": time.perf_counter() - t}
        demo._mark_done(sft_dir, digest, groups, **rec)
    else:
        _say(groups, f"warm-up: reusing {sft_dir} (same settings)")
    return sft_dir, {**rec, "digest": digest}


def prm_recipe(ccfg: CompareConfig) -> dict:
    from megaprm import demo

    return {"arithmetic": demo.TASK, "num_train": ccfg.prm_examples, "num_eval": 512,
                "stage1_steps": 20, "stage1_lr": 1e-3, "stage2_steps": ccfg.prm_steps, "stage2_lr": 2e-3,
                "warmup_steps": min(50, ccfg.prm_steps), "lr_decay": "cosine", "lm_loss_weight": 1.0,
                "global_batch_size": 64, "micro_batch_size": 32, "log_every": 250, "seed": 0}


def prm_stage(ccfg: CompareConfig, groups: Groups, tok) -> tuple[str, dict]:
    from megaprm import demo

    """The comparison's PRM: docs/prm.md's recipe from a random-init trunk, cached."""
    from megaprm.models.tiny import save_tiny_model
    from megaprm.trainer.prm_training import PRMTrainConfig, train_prm

    prm_dir = os.path.join(ccfg.run_dir, "prm")
    recipe = prm_recipe(ccfg)
    # the logging interval does not change the PRM (normalised so a cache survives it)
    digest = json_digest({"recipe": {**recipe, "log_every": 0}, "hidden": ccfg.prm_hidden,
                      "layers": ccfg.prm_layers})
    rec = demo._cached(prm_dir, digest)
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
    demo._mark_done(prm_dir, digest, groups, **rec)
    return prm_dir, {**rec, "digest": digest}


def eval_problems(ccfg: CompareConfig) -> list:
    from megaprm import demo
    from megaprm.tasks.arithmetic import generate_problems
    from megaprm.trainer.loop import HELD_OUT_SEED

    return generate_problems(demo.TASK, ccfg.eval_problems, seed=HELD_OUT_SEED)


def evaluate_policy(engine, tok, groups: Groups, ccfg: CompareConfig, temperature: float) -> dict:
    probs = eval_problems(ccfg)
    from megaprm.trainer.evaluate import evaluate_arithmetic

    greedy = evaluate_arithmetic(engine, tok, groups, probs, per_problem=True)
    sampled = evaluate_arithmetic(engine, tok, groups, probs, temperature=temperature,
                                  n=ccfg.sampled_n, seed=SAMPLED_SEED, per_problem=True)
    return {"greedy": greedy, "sampled": sampled}


def baseline_stage(ccfg: CompareConfig, groups: Groups, tok, sft_dir: str, sft_digest: str,
                   temperature: float) -> dict:
    """The warm-up policy's evaluation: the common 'before RL' row."""
    from megaprm.config import RolloutConfig
    from megaprm.parallel.device import rank_device
    from megaprm.rollout.factory import build_engine

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
    from megaprm.trainer.metrics import read_metrics

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
    from megaprm import demo
    from megaprm.config import load_config
    from megaprm.trainer.loop import RLTrainer

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
    cfg = load_config(demo.RL_YAML, [f"trainer.run_dir={d}", *overrides])
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

# two-sided 95% Student-t quantiles t_{0.975, df} (standard tables), df = seeds - 1
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    below = max(k for k in _T975 if k <= df) if df < 30 else None
    return _T975[below] if below else 1.96 + 2.4 / df  # conservative between table rows


def mean_ci(xs: list) -> dict:
    """Mean and the half-width of a 95% t-interval over seeds (None with one seed)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "n": len(xs)}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return {"mean": m, "ci95": t975(len(xs) - 1) * sd / math.sqrt(len(xs)), "n": len(xs)}


# (label, path into a result) of every column of the table
COLUMNS = (("greedy accuracy", ("greedy", "accuracy")),
           ("greedy fully correct", ("greedy", "all_steps_correct")),
           ("greedy correct with a wrong step", ("greedy", "correct_with_wrong_step")),
           ("sampled accuracy", ("sampled", "accuracy")),
           ("sampled correct with a wrong step", ("sampled", "correct_with_wrong_step")),
           ("train reward (last 5 steps)", ("train_end", "reward/outcome_mean")),
           ("PRM/outcome agreement (last 5)", ("train_end", "prm/outcome_agreement")))
# the evaluation columns as ratios of per-problem counts: label -> (evaluation, numerator,
# denominator); "samples" is the samples per problem (1 greedy, sampled_n sampled)
EVAL_RATIOS = {"greedy accuracy": ("greedy", "correct", "samples"),
               "greedy fully correct": ("greedy", "clean", "samples"),
               "greedy correct with a wrong step": ("greedy", "wrong_step", "correct"),
               "sampled accuracy": ("sampled", "correct", "samples"),
               "sampled correct with a wrong step": ("sampled", "wrong_step", "correct")}
# the paired differences the report leads with
PAIRED = ("greedy correct with a wrong step", "greedy accuracy",
          "sampled correct with a wrong step", "sampled accuracy")


def _get(rec: dict, path: tuple):
    for k in path:
        rec = rec.get(k) if isinstance(rec, dict) else None
    return rec


def _counts(recs: list, label: str):
    """[seeds, problems] numerator and denominator arrays of an evaluation column, or None when
    a run lacks per-problem counts."""
    import numpy as np

    ev, num, den = EVAL_RATIOS[label]
    nums, dens = [], []
    for r in recs:
        pp = _get(r, (ev, "per_problem"))
        if not pp:
            return None
        per = r[ev]["samples"] // max(r[ev]["problems"], 1)
        nums.append(pp[num])
        dens.append(pp[den] if den != "samples" else [per] * len(pp[num]))
    return np.asarray(nums, float), np.asarray(dens, float)


def _seed_wilson(recs: list, label: str) -> list:
    """Each seed's Wilson 95% interval: the evaluation's binomial noise alone (the samples of
    one run as the trials; for the wrong-step share, the correct answers)."""
    from megaprm import stats

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
    seeds (seeds, then problems; `megaprm.stats.hier_bootstrap`), `ci95` the old t half-width
    (kept for readers of earlier reports), `wilson` every seed's Wilson interval, and `noise`
    (evaluation vs seed SD of one seed's value). `paired`: per column of PAIRED, the row's
    difference from GRPO's run of the same seed, per seed, with the paired bootstrap's 95%
    interval over the seeds both rows have; `separated` when that interval excludes 0."""
    from megaprm import stats

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
            vals = [_get(r, path) for r in recs]
            row[label] = {"per_seed": vals, **mean_ci(vals)}
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
                    "per_seed": [_get(r, path) - _get(ref[r["seed"]], path) for r in both],
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


def markdown(report: dict, title: bool = True) -> str:
    """The report as markdown, a pure function of compare.json (docs and README are generated
    from the committed JSON with it)."""
    cols = [c for c, _ in COLUMNS]
    b, c = report["baseline"], report["compute_s"]
    seeds_note = ", ".join(f"{r['method']} {len(r['seeds'])}" for r in report["rows"]
                           if r["prm"] != "oracle")
    lines = []
    if title:
        lines += [(f"# megaprm compare: {report['rl_steps']} RL steps, up to {report['seeds']} "
                  f"seed(s), {report['eval_problems']} held-out problems"), ""]
    if report.get("missing"):
        lines += [(f"**Partial run: {len(report['planned']) - len(report['missing'])} of "
                  f"{len(report['planned'])} planned cells finished**; not yet run: "
                  f"{', '.join(report['missing'])} (the same command resumes it)."), ""]
    lines += [(f"PRM (learned): held-out step AUROC {report['prm'].get('auroc', float('nan')):.3f}"
              f" ({report['prm'].get('trunk', '')}). Seeds per row: {seeds_note}. Cells: mean "
              f"over seeds [95% interval of a two-level bootstrap: seeds, then the held-out "
              f"problems within each seed; a row with one seed has the evaluation's interval "
              f"alone]. 'correct with a wrong step' is a share of the "
              f"correct answers; sampled: {report['sampled_n']} samples per problem at the "
              f"rollout temperature. Built on {report['device']} (load {report['load']}): "
              f"warm-up {_min(c['warmup'])}, PRM training {_min(c['prm_train'])}, RL and "
              f"evaluation of the runs {_min(c['runs'])}; this call {_min(report['total_s'])}."),
              "",
              "| method | process reward | " + " | ".join(cols) + " |",
              "|---|---|" + "---|" * len(cols),
              "| (warm-up, before RL) | - | " + " | ".join(
                  _fmt({"mean": _get(b, p)}) for _, p in COLUMNS) + " |"]
    for r in report["rows"]:
        lines.append(f"| {row_label(r)} | {_prm_label(r)} | "
                     + " | ".join(_fmt(r[c]) for c in cols) + " |")
    paired = [r for r in report["rows"] if r.get("paired")]
    if paired:
        lines += ["", ("### Paired difference from GRPO (same seed: same warm-up, prompts and "
                      "sampling seed)"), "",
                  ("Each row's run of seed s minus GRPO's run of seed s, averaged over the seeds "
                  "both have; [95% interval of the paired two-level bootstrap]; **bold**: the "
                  "interval excludes 0."), "",
                  "| method | process reward | paired seeds | " + " | ".join(
                      f"Δ {c}" for c in PAIRED) + " |",
                  "|---|---|---|" + "---|" * len(PAIRED)]
        for r in paired:
            lines.append(f"| {row_label(r)} | {r['prm']} | {len(r['paired']['seeds'])} | "
                         + " | ".join(_fmt_diff(r["paired"].get(c)) for c in PAIRED) + " |")
        lines += [""] + [f"- {verdict(r)}" for r in paired if verdict(r)]
    noisy = [r for r in report["rows"] if r.get("greedy accuracy", {}).get("noise")
             and not r["same_run_as_learned"]]
    if noisy:
        lines += ["", "### Evaluation noise vs seed noise (SD of one seed's value)", "",
                  ("evaluation: the bootstrap over the held-out problems (seed fixed); seed: the "
                  "spread across seeds less what the evaluation explains."), "",
                  ("| method | process reward | greedy accuracy: evaluation / seed | greedy wrong-"
                  "step share: evaluation / seed | sampled wrong-step share: evaluation / seed |"),
                  "|---|---|---|---|---|"]
        for r in noisy:
            cells = []
            for col in ("greedy accuracy", "greedy correct with a wrong step",
                        "sampled correct with a wrong step"):
                nz = r[col]["noise"]
                cells.append(f"{nz['eval_sd']:.3f} / " + ("-" if nz["seed_sd"] is None
                                                          or not math.isfinite(nz["seed_sd"])
                                                          else f"{nz['seed_sd']:.3f}"))
            lines.append(f"| {row_label(r)} | {r['prm']} | " + " | ".join(cells) + " |")
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
    prime = [r for r in report["rows"] if (r.get("implicit_prm_loss") or {}).get("last")
             is not None and not r["same_run_as_learned"]]
    if prime:
        lines += ["", "### PRIME's implicit PRM: its loss on each fresh batch (ln 2 = 0.693: chance)",
                  "", "| method | first 10 steps | last 10 steps |", "|---|---|---|"]
        for r in prime:
            pl = r["implicit_prm_loss"]
            lines.append(f"| {row_label(r)} | {pl['first']:.3f} | {pl['last']:.3f} |")
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
    return "\n".join(lines) + "\n"


def readme_table(report: dict) -> str:
    """README's comparison block: greedy accuracy and wrong-step share, absolute and paired."""
    b = report["baseline"]["greedy"]
    how = ("mean [95% bootstrap]" if any("lo" in r["greedy accuracy"] for r in report["rows"])
           else "mean ± 95% t-interval")
    lines = [(f"| after {report['rl_steps']} RL steps, {report['eval_problems']} held-out problems "
             f"(greedy; {how}) | seeds | accuracy | Δ accuracy vs GRPO (paired) | "
             "correct answers resting on a wrong step | Δ vs GRPO (paired) |"),
             "| --- | --- | --- | --- | --- | --- |",
             (f"| warm-up (before RL) | - | {b['accuracy']:.3f} | - | "
             f"{b['correct_with_wrong_step']:.3f} | - |")]
    if report.get("missing"):
        lines.append(f"| (partial run: {len(report['missing'])} of {len(report['planned'])} "
                     "planned cells not yet run) | | | | | |")
    for r in report["rows"]:
        if r["same_run_as_learned"]:
            continue
        p = r.get("paired") or {}
        lines.append(f"| {row_label(r)}, {r['prm']} | {len(r['seeds'])} | "
                     f"{_fmt(r['greedy accuracy'])} | {_fmt_diff(p.get('greedy accuracy'))} | "
                     f"{_fmt(r['greedy correct with a wrong step'])} | "
                     f"{_fmt_diff(p.get('greedy correct with a wrong step'))} |")
    return "\n".join(lines) + "\n"


def write_docs(report: dict, readme: str | None = None, doc: str | None = None) -> list:
    """Regenerate the `compare` blocks of README.md and docs/compare.md from a report."""
    from megaprm.readme import replace_block

    written = []
    if readme:
        replace_block(readme, "compare", readme_table(report))
        written.append(readme)
    if doc:
        replace_block(doc, "compare", markdown(report, title=False))
        written.append(doc)
    return written


# ------------------------------------------------------------------------------ plots

SMOOTH = 5  # steps in the trailing moving average of the curves (one step is 128 samples)


def _smooth(xs: list) -> list:
    xs = [x if x is not None else float("nan") for x in xs]
    return [sum(xs[max(0, i - SMOOTH + 1):i + 1]) / len(xs[max(0, i - SMOOTH + 1):i + 1])
            for i in range(len(xs))]


def plot(report: dict, results: list, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
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
        ref = _get(base, dict(COLUMNS)[col])
        if ref is not None:
            ax.axhline(ref, color="gray", ls="--", lw=1, label="warm-up")
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        ax.set_title(col, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("after RL: mean over seeds, 95% bootstrap interval (seeds, then problems); "
                 "orange: oracle process reward",
                 fontsize=10)
    fig.tight_layout()
    p = os.path.join(out_dir, "compare_bars.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    paired = [r for r in rows if r.get("paired")]
    if paired:  # each row's paired difference from GRPO: interval, mean and every seed's own
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
                ax.plot(d["per_seed"], [y + 0.2] * len(d["per_seed"]), "x", color="k", ms=4)
            ax.axvline(0, color="k", lw=0.8)
            ax.set_title(f"Δ {col}\nvs GRPO, same seed", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
        axes.flat[0].set_yticks(range(len(paired)),
                                [f"{r['method']} ({r['prm']}, {len(r['paired']['seeds'])} s)"
                                 for r in paired], fontsize=7)
        axes.flat[0].invert_yaxis()  # the table's order, top down
        fig.suptitle("paired difference from GRPO: 95% bootstrap interval (red: excludes 0), "
                     "mean (o), each seed (x)", fontsize=9)
        fig.tight_layout()
        p = os.path.join(out_dir, "compare_paired.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

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
    fig.tight_layout()
    p = os.path.join(out_dir, "compare_curves.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    hack = report.get("hack")
    if hack:
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
        fig.tight_layout()
        p = os.path.join(out_dir, "reward_hacking.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


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
    from megaprm import demo
    from megaprm.config import load_config
    from megaprm.tasks.tokenizer import build_char_tokenizer

    t0 = time.perf_counter()
    os.makedirs(ccfg.run_dir, exist_ok=True)
    tok = build_char_tokenizer()
    sft_dir, sft = warmup_stage(ccfg, groups, tok)
    t_warm = time.perf_counter() - t0
    prm_dir, prm = prm_stage(ccfg, groups, tok)
    t_prm = time.perf_counter() - t0 - t_warm
    # the runs' rollout temperature (demo.yaml's, or an override): the baseline samples at it too
    temperature = load_config(demo.RL_YAML, list(ccfg.extra)).rollout.temperature
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
              "config": asdict(ccfg), "task": repr(demo.TASK),
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

"""`megaprm compare`: the methods side by side on the arithmetic task, where every step of every
solution is checked exactly, so "right for the right reasons" is measured, not estimated.

Per start (`--starts N`: the design's outer level, RUN_DIR/startK) a warm-up policy and a PRM are
trained once, cached by their settings, the version of the code that builds them and torch's
(`start.code_version`), and the PRM is judged by ProcessBench's first-error F1; then every
(start, method, process reward, seed) runs RL from its start with the same actor settings
(configs/demo.yaml; only the rewards and the estimator differ, each method's own knobs in
`runs.METHOD_OVERRIDES`), and is evaluated on the same held-out problems of its task (`--task
short | long`), greedy and sampled at the rollout temperature. Process rewards: `learned` (the
start's PRM), `oracle` (the task's exact step labels, `prm.kind=oracle`: the best any PRM could
do) and `implicit` (PRIME's own PRM, saved and judged at the end of its run). A reward-hacking
run trains PURE on the PRM alone (`advantage.pure.reward_mode=PRM`, no outcome reward) and keeps
its monitors.

Output in RUN_DIR: compare.json (every row over starts and seeds: the three-level bootstrap's
intervals, the noise split, the paired differences pooled and per start, the provenance),
compare.md (the tables), plots/*.png (bars per method, paired differences, curves over RL steps,
the reward-hacking monitors). Resumable: a finished cell (its result.json, same settings) is not
re-run; an interrupted one restarts from step 0.

The driver: the stages and the runs here, the shared design in runs.py, the warm-up and the PRM
in start.py, the statistics in stats.py, the table and plots in report.py.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from dataclasses import asdict

from checkpoint_tools.convert import export_hf_in_process
from checkpoint_tools.layout import ConversionError
from megaprm.config import load_config
from megaprm.digest import json_digest, source_digest
from megaprm.experiments.arithmetic import run_state, stats
from megaprm.rollout.config import RolloutConfig
from megaprm.experiments.arithmetic.report import CURVE_KEYS, INTERVALS, markdown, plot
from megaprm.experiments.arithmetic.runs import (
    MAX_TOKENS,
    REPO_ROOT,
    RL_YAML,
    CompareConfig,
    RunSpec,
    held_out_problems,
    plan,
    repo_relative,
    run_overrides,
)
from megaprm.experiments.arithmetic.start import (
    WarmupConfig,
    cached_stage,
    code_version,
    init_policy,
    mark_stage_done,
    prm_recipe,
    prm_trunk,
    warmup,
    warmup_digest,
)
from megaprm.parallel.device import rank_device
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree
from megaprm.rollout.factory import build_engine
from megaprm.tasks.tokenizer import build_char_tokenizer
from megaprm.rewards.prm_eval import judge
from megaprm.trainer.rl.evaluate import evaluate_arithmetic
from megaprm.trainer.rl.loop import RLTrainer
from megaprm.trainer.metrics import read_metrics
from megaprm.trainer.prm_judge import arithmetic_set, judged, score_discriminative, score_implicit
from megaprm.trainer.prm_training import PRMTrainConfig, train_prm
from megaprm.trainer.run_lock import RunLock

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


def _warmup_config(ccfg: CompareConfig, start: int) -> WarmupConfig:
    """Start k's warm-up: the demo's recipe with seed k (its init and its data stream)."""
    return WarmupConfig(warmup_steps=ccfg.warmup_steps, seed=start, task=ccfg.task)


def warmup_stage(ccfg: CompareConfig, groups: Groups, tok, start: int,
                 code: dict) -> tuple[str, dict]:
    """Start k's supervised warm-up (the demo's code, own directory), cached by its settings,
    the code that builds it and torch's version (`code`: start.code_version())."""
    wcfg = _warmup_config(ccfg, start)
    sft_dir = os.path.join(ccfg.start_dir(start), "sft")
    digest = warmup_digest(wcfg, code)
    rec = cached_stage(sft_dir, digest)
    if rec is None:
        t = time.perf_counter()
        _say(groups, f"start {start}: warm-up ({ccfg.warmup_steps} supervised steps, seed "
                     f"{start}, task {ccfg.task})")
        init_dir = init_policy(wcfg, tok, os.path.join(ccfg.start_dir(start), "init"),
                               groups.rank)
        rec = {"final_loss": warmup(wcfg, groups, tok, init_dir, sft_dir),
               "seconds": time.perf_counter() - t,
               # the key's parts: the settings alone (`--only-finished` checks them) and the
               # code that built it
               "settings": warmup_digest(wcfg), "code": code}
        mark_stage_done(sft_dir, digest, groups, **rec)
    else:
        _say(groups, f"warm-up: reusing {sft_dir} (same settings)")
    return sft_dir, {**rec, "digest": digest}


def _prm_recipe(ccfg: CompareConfig, start: int) -> dict:
    """Start k's PRM: docs/prm.md's recipe with seed k (its data, shuffles and init)."""
    return prm_recipe(ccfg.prm_steps, ccfg.prm_examples, ccfg.task, seed=start)


def _prm_digest(ccfg: CompareConfig, start: int, code: dict) -> str:
    recipe = _prm_recipe(ccfg, start)
    # the logging interval does not change the PRM (normalised so a cache survives it)
    blob = {"recipe": {**recipe, "log_every": 0}, "hidden": ccfg.prm_hidden,
            "layers": ccfg.prm_layers, "init_seed": start, "code": code}
    if ccfg.prm_init == "warmup":  # its trunk is start k's warm-up policy: keyed by that too
        blob["init"] = {"warmup": warmup_digest(_warmup_config(ccfg, start), code)}
    return json_digest(blob)


def recorded_start(ccfg: CompareConfig, k: int, code: dict) -> dict | None:
    """`--only-finished`: start k's warm-up and PRM records as they are on disk, when their
    settings are this comparison's, whatever code built them (it reports finished work and
    trains nothing, so a start of another commit is reported, with `same_code` saying so,
    never trained on); None when a stage is missing or of other settings. A record written
    before the settings were recorded apart is taken as it is (`settings_checked` false)."""
    want = {"sft": warmup_digest(_warmup_config(ccfg, k)), "prm": _prm_digest(ccfg, k, None)}
    recs = {d: _read_json(os.path.join(ccfg.start_dir(k), d, "demo_stage.json"))
            for d in ("sft", "prm")}
    if any(r is None or r.get("settings", want[d]) != want[d] for d, r in recs.items()):
        return None
    same = (recs["sft"]["digest"] == warmup_digest(_warmup_config(ccfg, k), code)
            and recs["prm"]["digest"] == _prm_digest(ccfg, k, code))
    return {**recs, "same_code": same,
            "settings_checked": all("settings" in r for r in recs.values())}


def check_only_finished(ccfg: CompareConfig) -> None:
    """`--only-finished` runs nothing new, so the run directory must already hold this
    comparison's warm-up and PRM (same settings; `recorded_start`) and at least one finished
    cell; checked before any rank starts, as otherwise the stages would be trained (minutes) to
    report nothing."""
    want = {"sft": warmup_digest(_warmup_config(ccfg, 0)), "prm": _prm_digest(ccfg, 0, None)}
    missing = []
    for name, d in (("warm-up", "sft"), ("PRM", "prm")):
        r = _read_json(os.path.join(ccfg.start_dir(0), d, "demo_stage.json"))
        if r is None or r.get("settings", want[d]) != want[d]:
            missing.append(name)
    rl = os.path.join(ccfg.start_dir(0), "rl")
    if not any(os.path.isfile(os.path.join(rl, name, "result.json"))
               for name in (os.listdir(rl) if os.path.isdir(rl) else ())):
        missing.append("finished run")
    if missing:
        raise ValueError(f"--only-finished: {ccfg.start_dir(0)} has no {', no '.join(missing)} "
                         "with these settings, and the flag runs nothing new; run "
                         "`megaprm compare` "
                         "without --only-finished first (or pass the --run-dir and settings of "
                         "a finished comparison)")


def claim_run_dir(ccfg: CompareConfig, state_dir: str, only_finished: bool) -> RunLock:
    """The launcher's lock on `ccfg.run_dir`, held while the ranks run: one comparison per run
    directory, as one run per trainer run directory (a second compare there would train into
    the same warm-up, PRM and cells). Under the lock, `state_dir`'s copy is restored into the
    run directory (before the ranks: they find the restored run directory) and
    `--only-finished` checked. A refusal releases the lock and removes the run directory when
    it made it and left it empty."""
    existed = os.path.isdir(ccfg.run_dir)
    lock = RunLock(ccfg.run_dir).acquire()
    try:
        if state_dir:
            copied, kept = run_state.restore(state_dir, ccfg.run_dir)
            print(f"[compare] --state-dir {state_dir}: restored {copied} unit(s) (a "
                  f"start's stage, a cell, a file) into {ccfg.run_dir}, kept {kept} "
                  "already there", flush=True)
        if only_finished:
            check_only_finished(ccfg)
    except BaseException:
        lock.release()
        if not existed and not os.listdir(ccfg.run_dir):
            os.rmdir(ccfg.run_dir)  # refused: nothing left behind
        raise
    return lock

def _trunk_of(model_dir: str, what: str) -> str:
    """`what (qwen2 hidden H, L layers)`, read from the model's config.json."""
    cfg = _read_json(os.path.join(model_dir, "config.json")) or {}
    return (f"{what} ({cfg.get('model_type')} hidden {cfg.get('hidden_size')}, "
            f"{cfg.get('num_hidden_layers')} layers)")


def prm_stage(ccfg: CompareConfig, groups: Groups, tok, start: int, code: dict,
              sft_dir: str) -> tuple[str, dict]:
    """Start k's PRM: docs/prm.md's recipe (data and shuffles of seed k) from a random-init
    trunk (seed k) or, with `prm_init` "warmup", from start k's warm-up policy in sft_dir;
    cached by its settings, the code that builds it and torch's version."""
    prm_dir = os.path.join(ccfg.start_dir(start), "prm")
    recipe = _prm_recipe(ccfg, start)
    digest = _prm_digest(ccfg, start, code)
    rec = cached_stage(prm_dir, digest)
    if rec is not None:
        _say(groups, f"start {start}: PRM: reusing {prm_dir} (same settings and code, held-out "
                     f"step AUROC {rec['auroc']:.3f})")
        return prm_dir, {**rec, "digest": digest}
    init_dir = prm_trunk(ccfg.prm_init, os.path.join(ccfg.start_dir(start), "prm_init"),
                         sft_dir, tok, start, ccfg.prm_hidden, ccfg.prm_layers, groups.rank)
    _say(groups, f"start {start}: PRM: training ({ccfg.prm_steps} steps x 64 solutions from "
                 + ("the warm-up policy" if ccfg.prm_init == "warmup" else "a random-init trunk")
                 + "; docs/prm.md's recipe)")
    res = train_prm(PRMTrainConfig(model_dir=init_dir, output_dir=prm_dir, **recipe), groups)
    rec = {"auroc": res.eval.auroc, "f1": res.eval.f1, "train_s": res.train_seconds,
           "per_kind": res.eval.per_kind,
           "recipe": {k: (v if k != "arithmetic" else repr(v)) for k, v in recipe.items()},
           "trunk": (f"qwen2 hidden {ccfg.prm_hidden}, {ccfg.prm_layers} layers, random init"
                     if ccfg.prm_init == "random" else
                     _trunk_of(sft_dir, f"start {start}'s warm-up policy")),
           "init": ccfg.prm_init,
           "settings": _prm_digest(ccfg, start, None), "code": code}
    mark_stage_done(prm_dir, digest, groups, **rec)
    return prm_dir, {**rec, "digest": digest}


# the labelled solutions every PRM of a comparison is judged on (`prm_judge.arithmetic_set`:
# half reference, half corrupted, every corruption kind): one set for every start, drawn apart
# from the PRMs' training (seeds 0..starts-1) and held-out (1_000_000 + seed) sets
JUDGE_SEED, JUDGE_SOLUTIONS = 3_000_017, 512


def _judged(scores: list, examples, labels, step_labels, threshold: float, what: str) -> dict:
    """ProcessBench's first-error F1 and the step AUROC (all, per error kind) of the scores."""
    j = judged(examples, labels, step_labels, scores, threshold, what)
    rep = judge(j.solutions, threshold)
    return {**rep["all"], "threshold": threshold, "score": what, "skipped": len(j.skipped),
            "per_kind": rep["per_kind"]}


def judge_set(ccfg: CompareConfig):
    return arithmetic_set(ccfg.arithmetic, JUDGE_SOLUTIONS, JUDGE_SEED)


def prm_judge_stage(ccfg: CompareConfig, groups: Groups, start: int, prm_dir: str,
                    prm_digest: str) -> dict:
    """Start k's PRM judged as the field judges PRMs (`megaprm eval-prm`'s metrics): first-error
    F1 (ProcessBench: a step is called wrong below P(good) 0.5) and step AUROC against the
    exact labels, per error kind, on the comparison's judging set; cached beside the PRM."""
    path = os.path.join(ccfg.start_dir(start), "prm_judged.json")
    digest = json_digest([prm_digest, JUDGE_SEED, JUDGE_SOLUTIONS])
    rec = _read_json(path)
    if rec is not None and rec.get("digest") == digest:
        return rec
    ex, labels, step_labels = judge_set(ccfg)
    scores = score_discriminative(prm_dir, ex, groups)
    rec = {"digest": digest, **_judged(scores, ex, labels, step_labels, 0.5, "P(good)")}
    _write_json(path, rec, groups)
    return rec


def judge_implicit(ccfg: CompareConfig, groups: Groups, trainer: RLTrainer, run_dir: str,
                   sft_dir: str) -> dict:
    """PRIME's implicit PRM at the end of its run, saved (RUN/implicit_prm) and judged like a
    discriminative PRM: a step's score is beta * sum of its tokens' log pi_prm - log pi_ref
    (the reference: the warm-up policy, the implicit PRM's start), called wrong below 0."""
    out = trainer.export_implicit_prm(os.path.join(run_dir, "implicit_prm"),
                                      side_files_from=sft_dir)
    _barrier(groups)
    ex, labels, step_labels = judge_set(ccfg)
    beta = trainer.cfg.prm.beta
    scores = score_implicit(out, sft_dir, ex, groups, beta=beta)
    return _judged(scores, ex, labels, step_labels, 0.0, f"{beta} * sum log-ratio")


def evaluate_policy(engine, tok, groups: Groups, ccfg: CompareConfig, temperature: float) -> dict:
    probs = held_out_problems(ccfg.eval_problems, ccfg.task)
    mt = MAX_TOKENS[ccfg.task]
    greedy = evaluate_arithmetic(engine, tok, groups, probs, max_tokens=mt, per_problem=True)
    sampled = evaluate_arithmetic(engine, tok, groups, probs, max_tokens=mt,
                                  temperature=temperature, n=ccfg.sampled_n, seed=SAMPLED_SEED,
                                  per_problem=True)
    return {"greedy": greedy, "sampled": sampled}


def evaluate_dir(policy_dir: str, tok, groups: Groups, ccfg: CompareConfig,
                 temperature: float) -> dict:
    """`evaluate_policy` of an HF checkpoint on disk, in an HF engine of its own (freed on
    return): the warm-up policy's baseline and a re-evaluated cell's final policy."""
    engine = build_engine(RolloutConfig(engine="hf"), policy_dir, tok,
                          world_size=groups.world_size, tp_size=1, seed=0, device=rank_device())
    return evaluate_policy(engine, tok, groups, ccfg, temperature)


def baseline_stage(ccfg: CompareConfig, groups: Groups, tok, sft_dir: str, sft_digest: str,
                   temperature: float, start: int) -> dict:
    """Start k's warm-up policy's evaluation: its 'before RL' row."""
    path = os.path.join(ccfg.start_dir(start), "baseline.json")
    digest = json_digest([sft_digest, ccfg.eval_problems, ccfg.sampled_n, temperature, EVAL_FORMAT])
    rec = _read_json(path)
    if rec is not None and rec.get("digest") == digest:
        return rec
    rec = {"digest": digest, **evaluate_dir(sft_dir, tok, groups, ccfg, temperature)}
    _write_json(path, rec, groups)
    return rec


def _curves(run_dir: str) -> dict:
    """The monitors per RL step, read back from the run's metrics.jsonl (so a finished run's
    curves are the file's, whichever keys the report asks for)."""

    rows = read_metrics(run_dir)
    return {k: [r.get(k) for r in rows] for k in CURVE_KEYS if any(k in r for r in rows)}


def _relative_override(o: str) -> str:
    """A path override as a path relative to the repository (a committed result)."""
    k, _, v = o.partition("=")
    return f"{k}={repo_relative(v)}" if k in ("model.path", "prm.path", "trainer.run_dir") \
        and v not in ("null", "") else o


def _make_room(d: str, rec: dict | None, groups: Groups) -> None:
    """Clear a cell's directory `d` for a new run, losing nothing finished: an interrupted run
    (no result.json: `rec` None) is removed, as it restarts from step 0; a finished run of
    other settings (`rec`: its result, with another digest: other overrides, evaluation or
    start) is moved to RL_DIR/superseded/NAME.DIGEST8 and said so, so a comparison run with
    other flags into a finished one's run directory cannot delete hours of its cells."""
    if groups.rank == 0 and os.path.isdir(d):
        if rec is None:
            shutil.rmtree(d)
        else:
            rl, name = os.path.split(d)
            base = os.path.join(rl, "superseded", f"{name}.{str(rec.get('digest'))[:8]}")
            dest, i = base, 1
            while os.path.exists(dest):  # those settings superseded before: keep both
                dest, i = f"{base}.{i}", i + 1
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(d, dest)
            _say(groups, f"{d} held a finished run of other settings (another digest): moved "
                         f"to {dest}, not deleted")
    _barrier(groups)


def _cell_digest(base_digest: str, trained: list, problems: int, sampled_n: int) -> str:
    """A cell's cache key: its start, its RL overrides (less the start's paths) and the size
    of its evaluation. EVAL_FORMAT: a result without per-problem counts is re-run, not mixed in.
    base_digest holds the start's code version and torch's; the RL code's version is recorded
    in the result (`rl_code`) and reported per cell, not a key (docs/compare.md, "Resumable")."""
    return json_digest([base_digest, trained, problems, sampled_n, EVAL_FORMAT])


def _eval_size(rec: dict) -> tuple:
    """(held-out problems, samples per problem) a finished cell was evaluated with."""
    g, s = rec.get("greedy") or {}, rec.get("sampled") or {}
    if not g.get("problems") or not s.get("problems"):
        return (None, None)
    return g["problems"], s["samples"] // s["problems"]


def _final_checkpoint(d: str, overrides: list) -> str | None:
    """The actor of a finished cell's last RL step (RUN/checkpoints/step_N/actor), or None
    where it is gone (a run directory restored from a state directory keeps no checkpoint)."""
    steps = next(int(o.split("=", 1)[1]) for o in overrides if o.startswith("trainer.steps="))
    path = os.path.join(d, "checkpoints", f"step_{steps - 1:06d}", "actor")
    return path if os.path.isfile(os.path.join(path, "megaprm_checkpoint.json")) else None


def reevaluate(spec: RunSpec, ccfg: CompareConfig, groups: Groups, tok, d: str, rec: dict,
               trained_digest: str, digest: str, overrides: list) -> dict | None:
    """A finished cell trained with this run's settings but evaluated at another size
    (another --eval-problems or --sampled-n): its final policy is exported from its last
    checkpoint and evaluated again; RL is not re-run. None (the caller re-runs the cell) where
    the result is of other RL settings (`trained_digest`: the key it had with its own
    evaluation size) or the checkpoint is gone.

    The held-out problems are one seeded stream, so the first ones are the earlier
    evaluation's: greedy decoding must give each of them the same per-problem outcome, or the
    checkpoint is not the policy that was evaluated and the cell is re-run. The earlier result
    is kept beside the new one (RUN/result.DIGEST8.json)."""
    ckpt = _final_checkpoint(d, overrides)
    if rec.get("digest") != trained_digest or ckpt is None:
        return None
    was = _eval_size(rec)
    _say(groups, f"start {spec.start}: {spec.name}: trained with these settings, evaluated on "
                 f"{was[0]} problems x {was[1]} samples; re-evaluating its final policy "
                 f"({repo_relative(ckpt)}) on {ccfg.eval_problems} x {ccfg.sampled_n}")
    t = time.perf_counter()
    # beside the runs, not in one (an export never writes into a training run's directory)
    policy = os.path.join(ccfg.start_dir(spec.start), "reevaluated", spec.name)
    fault = None
    if groups.rank == 0:
        try:
            if os.path.isdir(policy):
                shutil.rmtree(policy)  # a re-evaluation cut short: exported again
            os.makedirs(os.path.dirname(policy), exist_ok=True)
            export_hf_in_process(ckpt, policy)
        except (ConversionError, OSError) as e:
            fault = str(e)
    fault = agree(fault, groups)  # every rank falls back together
    if fault is not None:
        _say(groups, f"start {spec.start}: {spec.name}: its final checkpoint could not be "
                     f"exported ({fault}); re-running the cell")
        return None
    # the cell's own rollout temperature, as its own evaluation sampled at
    temperature = load_config(RL_YAML, overrides).rollout.temperature
    ev = evaluate_dir(policy, tok, groups, ccfg, temperature)
    old, new = rec["greedy"]["per_problem"], ev["greedy"]["per_problem"]
    n = min(len(old["correct"]), len(new["correct"]))
    same = all(old[k][:n] == new[k][:n] for k in old if k in new)
    if not same:
        _say(groups, f"start {spec.start}: {spec.name}: its final checkpoint's greedy outcomes "
                     f"differ from its own evaluation on the first {n} problems: not the "
                     "evaluated policy; re-running the cell")
        _barrier(groups)
        return None
    if groups.rank == 0:
        shutil.copyfile(os.path.join(d, "result.json"),
                        os.path.join(d, f"result.{str(rec['digest'])[:8]}.json"))
        shutil.rmtree(policy)
        with contextlib.suppress(OSError):  # the last one's: the folder goes too
            os.rmdir(os.path.dirname(policy))
    new_rec = {**rec, **ev, "digest": digest, "eval_s": time.perf_counter() - t,
               "reevaluated": {"checkpoint": repo_relative(ckpt), "problems_before": was[0],
                               "sampled_n_before": was[1], "greedy_prefix_agrees": n}}
    _write_json(os.path.join(d, "result.json"), new_rec, groups)
    _say(groups, f"start {spec.start}: {spec.name}: re-evaluated in "
                 f"{time.perf_counter() - t:.0f} s (greedy outcomes of its first {n} problems "
                 "as before)")
    return new_rec


def run_one(spec: RunSpec, ccfg: CompareConfig, groups: Groups, tok, sft_dir: str, prm_dir: str,
            base_digest: str, only_finished: bool = False,
            rl_code: dict | None = None) -> dict | None:
    """One (method, process reward, seed) cell: its finished result from disk when one with the
    same settings is there, else RL from the warm-up and the evaluation (None instead when
    `only_finished`)."""

    d = os.path.join(ccfg.start_dir(spec.start), "rl", spec.name)
    overrides = run_overrides(spec, ccfg, sft_dir, prm_dir)
    trained = [o for o in overrides if not o.startswith(("model.path=", "prm.path="))]
    digest = _cell_digest(base_digest, trained, ccfg.eval_problems, ccfg.sampled_n)
    res_path = os.path.join(d, "result.json")
    rec = _read_json(res_path)
    done = None  # a finished result of these settings: read back, or just re-evaluated
    if rec is not None and rec.get("digest") == digest:
        _say(groups, f"start {spec.start}: {spec.name}: reusing the finished run in {d}")
        done = rec
    elif rec is not None and not only_finished:
        done = reevaluate(spec, ccfg, groups, tok, d, rec,
                          _cell_digest(base_digest, trained, *_eval_size(rec)), digest, overrides)
    if done is not None:
        done["curves"] = _curves(d)
        done["train_end"] = {k: stats.tail_mean(v) for k, v in done["curves"].items()}
        return done
    if only_finished:
        return None
    _make_room(d, rec, groups)
    cfg = load_config(RL_YAML, [f"trainer.run_dir={d}", *overrides])
    t = time.perf_counter()
    trainer = RLTrainer(cfg, groups, tok)
    history = trainer.fit()
    rl_s = time.perf_counter() - t
    ev = trainer.evaluate_with_engine(lambda engine: evaluate_policy(
        engine, tok, groups, ccfg, cfg.rollout.temperature))
    if cfg.prm.kind == "implicit":
        ev["implicit_judged"] = judge_implicit(ccfg, groups, trainer, d, sft_dir)
    _barrier(groups)  # rank 0 has written every step's metrics
    curves = _curves(d)
    rec = {"digest": digest, **asdict(spec), "name": spec.name,
           "overrides": [_relative_override(o) for o in overrides], **ev, "rl_code": rl_code,
           "cpu": _cpu(),  # one pass may span machines (resumed elsewhere): each cell's own
           "train_end": {k: stats.tail_mean(v) for k, v in curves.items()},
           "curves": curves, "rl_s": rl_s, "eval_s": time.perf_counter() - t - rl_s}
    del trainer, history
    gc.collect()
    _write_json(res_path, rec, groups)
    return rec


# ------------------------------------------------------------------------------ driver

# the modules whose source makes an RL cell's result (with everything they import): recorded
# per cell (`rl_code`) and counted in compare.json's provenance
RL_CODE = ("megaprm.trainer.rl.loop", "megaprm.trainer.rl.evaluate", "megaprm.rollout.factory",
           "megaprm.experiments.arithmetic.runs")


def _hours_or_min(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _git_commit() -> dict:
    """The checkout's commit and whether its tracked files differ from it (None outside git)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                              timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu() -> dict:
    """What decides the last bits of a CPU run: the model, ATen's kernel level, the flags."""
    import platform

    import torch

    model, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = sorted(f for f in have if f.startswith(("avx", "fma", "amx", "sse4")))
                    break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": flags,
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "torch_threads": torch.get_num_threads()}


def provenance(code: dict, rl_code: dict, results: list) -> dict:
    """What a reader needs to rebuild the table: the commit, the code versions (the start's,
    part of its cache key; the RL cells', recorded per cell), torch, the CPU (this one's; the
    cells', counted by model and ATen kernel level: a resumed pass may span machines)."""
    import platform

    import torch

    versions: dict = {}
    cpus: dict = {}
    for r in results:
        v = (r.get("rl_code") or {}).get("code", "unrecorded")
        versions[v] = versions.get(v, 0) + 1
        c = r.get("cpu")
        c = f"{c['model']} (ATen {c['aten_capability']})" if c else "unrecorded"
        cpus[c] = cpus.get(c, 0) + 1
    return {**_git_commit(), "start_code": code, "rl_code": rl_code,
            "cells_by_rl_code": versions, "cells_by_cpu": cpus, "torch": torch.__version__,
            "python": platform.python_version(), "cpu": _cpu()}

def _no_counts(v):
    """An evaluation without its per-problem counts (they stay in each run's result.json)."""
    return {k: x for k, x in v.items() if k != "per_problem"} if isinstance(v, dict) else v


def _recorded_stages(ccfg: CompareConfig, groups: Groups, tok, k: int, code: dict,
                     temperature: float) -> dict | None:
    """`--only-finished`: start k's stages as they are on disk, built by whichever code (said
    in the report); None where it was never built (its cells are missing). Nothing trains."""
    rec = recorded_start(ccfg, k, code)
    if rec is None:
        return None
    sft_dir, prm_dir = (os.path.join(ccfg.start_dir(k), d) for d in ("sft", "prm"))
    sft, prm = rec["sft"], rec["prm"]
    st = {"sft_dir": sft_dir, "prm_dir": prm_dir, "sft": sft, "prm": prm,
          "baseline": baseline_stage(ccfg, groups, tok, sft_dir, sft["digest"], temperature, k),
          "prm_judged": prm_judge_stage(ccfg, groups, k, prm_dir, prm["digest"]),
          "base_digest": json_digest([sft["digest"], prm["digest"]]),
          "same_code": rec["same_code"], "settings_checked": rec["settings_checked"],
          "t_warm": 0.0, "t_prm": 0.0}
    if not rec["same_code"]:
        _say(groups, f"start {k}: reporting its warm-up and PRM as built by other code than this "
                     "checkout's (compare.json: starts[].same_code)")
    return st


def _built_stages(ccfg: CompareConfig, groups: Groups, tok, k: int, code: dict,
                  temperature: float) -> dict:
    """Start k's stages (warm-up, PRM, its judgement, the baseline), built or read back from
    their caches, with the seconds the warm-up and the PRM took."""
    t = time.perf_counter()
    sft_dir, sft = warmup_stage(ccfg, groups, tok, k, code)
    t_warm = time.perf_counter() - t
    prm_dir, prm = prm_stage(ccfg, groups, tok, k, code, sft_dir)
    judged = prm_judge_stage(ccfg, groups, k, prm_dir, prm["digest"])
    baseline = baseline_stage(ccfg, groups, tok, sft_dir, sft["digest"], temperature, k)
    return {"sft_dir": sft_dir, "prm_dir": prm_dir, "sft": sft, "prm": prm,
            "baseline": baseline, "prm_judged": judged,
            "base_digest": json_digest([sft["digest"], prm["digest"]]),
            "t_warm": t_warm, "t_prm": time.perf_counter() - t - t_warm}


def _per_start(built: dict, results: list) -> list:
    """compare.json's `starts`: each built start's stage records (less their cache keys and
    per-problem counts) and how many of its cells are reported."""
    return [{"start": k,
             "warmup": {x: y for x, y in v["sft"].items() if x != "digest"},
             "prm": {x: y for x, y in v["prm"].items() if x != "digest"},
             "baseline": {x: _no_counts(y) for x, y in v["baseline"].items() if x != "digest"},
             "prm_judged": {x: y for x, y in v["prm_judged"].items() if x != "digest"},
             # built by this checkout's code (False: reported by --only-finished from an
             # earlier commit's start; the provenance's start_code is this checkout's)
             "same_code": v.get("same_code", True),
             "settings_checked": v.get("settings_checked", True),
             "cells": sum(r["start"] == k for r in results)}
            for k, v in built.items()]


def build_report(ccfg: CompareConfig, groups: Groups, runs: list, results: list, missing: list,
                 starts: dict, code: dict, rl_code: dict, t0: float) -> dict:
    """compare.json: the design, the starts, the rows and their statistics (`stats.aggregate`),
    the reward-hacking run, times, load and provenance."""
    hack = next((r for r in results if r.get("hack")), None)
    built = {k: v for k, v in sorted(starts.items()) if v is not None}
    first = next(iter(built.values()))
    per_start = _per_start(built, results)
    return {"methods": list(ccfg.methods), "seeds": ccfg.seeds, "rl_steps": ccfg.rl_steps,
            "eval_problems": ccfg.eval_problems, "sampled_n": ccfg.sampled_n,
            # run_dir relative to the repository: compare.json is committed
            "config": {**asdict(ccfg), "run_dir": repo_relative(ccfg.run_dir)},
            "task": ccfg.task, "task_config": repr(ccfg.arithmetic),
            "max_tokens": MAX_TOKENS[ccfg.task],
            "response_tokens": stats.response_tokens(results),
            "starts": per_start,
            # start 0's (the first built) stages: the single-start report's fields
            "warmup": per_start[0]["warmup"], "prm": per_start[0]["prm"],
            "baseline": per_start[0]["baseline"],
            "planned": [f"start{s.start}/{s.name}" for s in runs], "missing": missing,
            "eval_format": EVAL_FORMAT, "intervals": INTERVALS,
            "rows": (rows := stats.aggregate(results, ccfg)),
            "evaluation_sizes": stats.evaluation_sizes(rows, results),
            "hack": ({k: _no_counts(hack[k])
                      for k in ("seed", "greedy", "sampled", "train_end", "curves")}
                     if hack else None),
            "times_s": {"warmup": first["t_warm"], "prm": first["t_prm"],
                        "runs": {f"start{r['start']}/{r['name']}": r["rl_s"] + r["eval_s"]
                                 for r in results}},
            "total_s": time.perf_counter() - t0,
            # what the table cost when each part was built (cached parts keep their time)
            "compute_s": {"warmup": sum(v["sft"].get("seconds") or 0 for v in built.values()),
                          "prm_train": sum(v["prm"].get("train_s") or 0
                                           for v in built.values()),
                          "runs": sum(r["rl_s"] + r["eval_s"] for r in results)},
            "device": f"CPU, {groups.world_size} torchrun rank(s)",
            "load": [round(x, 2) for x in os.getloadavg()],
            "provenance": provenance(code, rl_code, results)}


def _progress(i: int, runs: list, key: str, rec: dict, results: list, t: float,
              t0: float) -> str:
    """The line said after cell i finished: its headline numbers, time and the time to go."""
    to_go = stats.cells_to_go_s(results, runs[i + 1:])
    return (f"({i + 1}/{len(runs)}) {key}: greedy accuracy "
            f"{rec['greedy']['accuracy']:.3f}, correct with a wrong step "
            f"{rec['greedy']['correct_with_wrong_step']:.3f} "
            f"({time.perf_counter() - t:.0f} s; {(time.perf_counter() - t0) / 60:.1f} "
            f"min so far" + ("" if not to_go else f", the {len(runs) - i - 1} cell(s) "
                             f"to go ~{_hours_or_min(to_go)} at the finished ones' cost")
            + f"; load {os.getloadavg()[0]:.1f})")


def run(ccfg: CompareConfig, groups: Groups, only_finished: bool = False,
        state_dir: str | None = None) -> dict:
    """The whole comparison (resumable: finished cells are read back from disk).
    `only_finished`: run nothing new, report the cells already finished (a run cut short).
    `state_dir`: after each start is built and each cell finishes, rank 0 saves what a resumed
    run reads back there too (`run_state.save`; the launcher restored it before the ranks)."""

    t0 = time.perf_counter()
    if only_finished:  # the launcher checked it too; a direct caller must not train either
        check_only_finished(ccfg)
    os.makedirs(ccfg.run_dir, exist_ok=True)
    tok = build_char_tokenizer()
    code, rl_code = code_version(), source_digest(RL_CODE)
    # the runs' rollout temperature (demo.yaml's, or an override): the baseline samples at it too
    temperature = load_config(RL_YAML, list(ccfg.extra)).rollout.temperature
    starts: dict = {}  # k -> its stages, built (or read back) when its first cell comes

    def keep_state() -> None:
        if state_dir and groups.rank == 0 and not only_finished:
            n = run_state.save(ccfg.run_dir, state_dir)
            if n:
                print(f"[compare] state: {n} file(s) saved to {state_dir}", flush=True)

    runs = plan(ccfg)
    results, missing = [], []
    for i, spec in enumerate(runs):
        t = time.perf_counter()
        key = f"start{spec.start}/{spec.name}"
        if spec.start not in starts:  # --only-finished: as recorded, None if never built
            starts[spec.start] = (_recorded_stages if only_finished else _built_stages)(
                ccfg, groups, tok, spec.start, code, temperature)
        st = starts[spec.start]
        keep_state()  # a start just built is kept before its first cell's minutes
        _say(groups, f"({i + 1}/{len(runs)}) {key} ...")
        rec = (None if st is None else
               run_one(spec, ccfg, groups, tok, st["sft_dir"], st["prm_dir"], st["base_digest"],
                       only_finished, rl_code))
        if rec is None:
            missing.append(key)
            _say(groups, f"({i + 1}/{len(runs)}) {key}: not finished (--only-finished)")
            continue
        rec.setdefault("start", spec.start)  # results written before starts were a level
        results.append(rec)
        keep_state()
        _say(groups, _progress(i, runs, key, rec, results, t, t0))
    if not results:
        raise ValueError(f"--only-finished: no finished run in {ccfg.run_dir}; run without the "
                         "flag first")
    report = build_report(ccfg, groups, runs, results, missing, starts, code, rl_code, t0)
    if groups.rank == 0:
        with open(os.path.join(ccfg.run_dir, "compare.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=float)
        with open(os.path.join(ccfg.run_dir, "compare.md"), "w", encoding="utf-8") as f:
            f.write(markdown(report))
        report["plots"] = plot(report, results, os.path.join(ccfg.run_dir, "plots"))
    _barrier(groups)
    return report

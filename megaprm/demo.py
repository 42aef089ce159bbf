"""`megaprm demo`: the whole method on the embedded arithmetic task, on CPU, in minutes.

1. warm-up: a tiny Qwen2-shaped policy (char tokenizer) learns the task supervised, through the
   Megatron actor (dp over the torchrun ranks);
2. PRM: a tiny discriminative PRM (Megatron trunk + 2-class head) trained on exact step labels;
3. RL with the chosen estimator (PROF-GRPO by default), rollouts from the transformers engine
   fed by weight sync;
4. a summary: greedy accuracy before/after RL on held-out problems, the share of correct
   answers that rest on a wrong step (checked exactly), per-phase time.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megaprm.config import load_config
from megaprm.parallel import pipeline
from megaprm.parallel.groups import Groups
from megaprm.parallel.launch import seconds_since_launch
from megaprm.tasks.arithmetic import ArithmeticConfig, generate_problems
from megaprm.trainer.export import save_hf


@dataclass
class DemoConfig:
    run_dir: str = "runs/demo"
    method: str = "prof_grpo"
    seed: int = 0
    warmup_steps: int = 400
    warmup_batch: int = 64
    warmup_lr: float = 2e-3
    prm_examples: int = 3000
    prm_stage1_steps: int = 60
    prm_stage2_steps: int = 120
    prm_lm_loss_weight: float = 0.0  # 1.0 measured no better at this short PRM schedule (0.696)
    rl_steps: int = 40
    eval_problems: int = 200
    hidden: int = 128
    layers: int = 4

    def __post_init__(self):
        from megaprm.algorithms.registry import METHODS

        if self.method not in METHODS:
            raise ValueError(f"--method={self.method!r}: choose one of {list(METHODS)}")


TASK = ArithmeticConfig(num_ops=(2, 4), operand_max=20, ops="+-", seed=0)
# the RL settings every demo / compare run starts from (model, PRM, run dir come as overrides)
RL_YAML = os.path.join(os.path.dirname(__file__), "configs", "demo.yaml")

# what PRIME does at this scale, measured (docs/compare.md): said where a user meets it
PRIME_NOTE = ("prime learns its implicit PRM from outcome labels alone; at the demo's response "
              "length and step budget it does not learn (loss ~ln 2) and accuracy usually falls "
              "(docs/compare.md); no step-label PRM is trained for it")

# Each method's own knobs on the demo task; the actor, batch and schedule (configs/demo.yaml)
# are shared, so methods differ only in their rewards and estimator. PRIME: the implicit PRM
# starts from the policy with twice the actor's lr (released: PRM 1e-6 / actor 5e-7,
# configs/prime.yaml), refilling the accuracy-filtered batch (ray_trainer.py, cap 4 as
# configs/prime_tiny.yaml). PURE: the released PRM's step reward is 2p - 1 (token-classification
# head), the megaprm PRM gives p.
METHOD_OVERRIDES = {
    "prime": ["prm.kind=implicit", "prm.path=null", "prm.optim.lr=1e-4",
              "rollout.refill=accuracy", "rollout.max_refill_rounds=4"],
    "pure": ["advantage.pure.step_scores_are_probs=true"],
}


def init_policy(dcfg: DemoConfig, tokenizer, out_dir: str, rank: int) -> str:
    from megaprm.models.tiny import save_tiny_model

    if rank == 0:
        save_tiny_model("qwen2", out_dir, seed=dcfg.seed, tokenizer=tokenizer,
                        vocab_size=len(tokenizer), hidden_size=dcfg.hidden,
                        num_layers=dcfg.layers, num_heads=4, num_kv_heads=2,
                        intermediate_size=3 * dcfg.hidden, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def sft_batch(tokenizer, problems):
    """prompt + reference solution + EOS, right-padded; loss on the solution and EOS."""
    from megaprm.tasks.arithmetic import reference_solution

    rows, masks = [], []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        sol = tokenizer.encode(reference_solution(p), add_special_tokens=False)
        ids = prompt + sol + [tokenizer.eos_token_id]
        rows.append(ids)
        masks.append([0.0] * (len(prompt) - 1) + [1.0] * (len(sol) + 1) + [0.0])
    L = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (L - len(r)) for r in rows])
    mask = torch.tensor([m + [0.0] * (L - len(m)) for m in masks])
    return ids, mask


def warmup(dcfg: DemoConfig, groups: Groups, tokenizer, init_dir: str, out_dir: str) -> float:
    """Supervised warm-up of the Megatron actor; writes the result as an HF directory."""
    from tqdm import tqdm

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.trainer.sft import sft_step

    spec = spec_from_hf(init_dir)
    model = pipeline.build_stage(spec, groups)
    load_hf_weights(model, init_dir, spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                    pp=groups.pp_size, pp_rank=groups.pp_rank)
    ddp = pipeline.wrap_ddp(model, groups)
    opt = pipeline.Optimizer(ddp, pipeline.OptimConfig(lr=dcfg.warmup_lr, clip_grad=1.0,
                                                       weight_decay=0.0), groups)
    per = dcfg.warmup_batch // groups.dp_size
    loss = float("nan")
    bar = tqdm(range(dcfg.warmup_steps), desc="warm-up (SFT)", disable=groups.rank != 0)
    for step in bar:
        probs = generate_problems(TASK, dcfg.warmup_batch, seed=10_000 + step)
        ids, mask = sft_batch(tokenizer, probs[groups.dp_rank * per:(groups.dp_rank + 1) * per])
        lr = dcfg.warmup_lr * min(1.0, (step + 1) / 20)  # short linear warm-up
        opt.set_lr(lr)
        res = sft_step(ddp, opt, groups, ids, mask, micro_batch_size=per,
                       vocab_size=spec.vocab_size)
        loss = res.loss
        bar.set_postfix(loss=f"{loss:.3f}")
    save_hf(ddp, groups, out_dir, hf_config=spec.hf_config, tokenizer=tokenizer)
    return loss


def evaluate(engine, tokenizer, groups: Groups, n: int, seed: int = 99) -> dict:
    """Greedy accuracy on held-out problems (dp-sharded) + exact step checks."""
    from megaprm.trainer.evaluate import evaluate_arithmetic

    return evaluate_arithmetic(engine, tokenizer, groups, generate_problems(TASK, n, seed=seed))


def _stage_digest(dcfg: DemoConfig, stage: str) -> str:
    """What a cached warm-up / PRM depends on: its own settings and everything before it."""
    keys = ["seed", "warmup_steps", "warmup_batch", "warmup_lr", "hidden", "layers"]
    if stage == "prm":
        keys += ["prm_examples", "prm_stage1_steps", "prm_stage2_steps", "prm_lm_loss_weight"]
    blob = {k: getattr(dcfg, k) for k in keys}
    blob["task"] = repr(TASK)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _cached(out_dir: str, digest: str) -> dict | None:
    """The record of a finished stage with this digest, or None (then it is (re)built)."""
    path = os.path.join(out_dir, "demo_stage.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    return rec if rec.get("digest") == digest else None


def _mark_done(out_dir: str, digest: str, groups: Groups, **info) -> None:
    if groups.rank == 0:
        with open(os.path.join(out_dir, "demo_stage.json"), "w", encoding="utf-8") as f:
            json.dump({"digest": digest, **info}, f, indent=2, default=float)
    if groups.world_size > 1:
        dist.barrier()


def run(dcfg: DemoConfig, groups: Groups) -> dict:
    """Warm-up and PRM are cached in RUN_DIR/sft and RUN_DIR/prm (reused when their settings
    match, so another method costs only its RL); RL goes to RUN_DIR/rl/<method>."""
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.loop import RLTrainer
    from megaprm.trainer.prm_training import PRMTrainConfig, train_prm

    t0 = time.perf_counter()
    times = {}
    rd = dcfg.run_dir
    tok = build_char_tokenizer()
    sft_dir, prm_dir = os.path.join(rd, "sft"), os.path.join(rd, "prm")
    rl_dir = os.path.join(rd, "rl", dcfg.method)
    say = print if groups.rank == 0 else (lambda *a, **k: None)

    t = time.perf_counter()
    sft_digest = _stage_digest(dcfg, "sft")
    sft = _cached(sft_dir, sft_digest)
    if sft is None:
        init_dir = init_policy(dcfg, tok, os.path.join(rd, "init"), groups.rank)
        sft = {"final_loss": warmup(dcfg, groups, tok, init_dir, sft_dir)}
        _mark_done(sft_dir, sft_digest, groups, **sft)
    else:
        say(f"[demo] warm-up: reusing {sft_dir} (same settings)", flush=True)
    times["warmup_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prm_digest = _stage_digest(dcfg, "prm")
    prm_report = _cached(prm_dir, prm_digest)
    if dcfg.method == "prime":  # its implicit PRM is the policy's copy, trained during RL
        say(f"[demo] {PRIME_NOTE}", flush=True)
        prm_report = None
    elif prm_report is None:
        prm_cfg = PRMTrainConfig(model_dir=sft_dir, output_dir=prm_dir, arithmetic=TASK,
                                 num_train=dcfg.prm_examples, num_eval=512, seed=dcfg.seed,
                                 stage1_steps=dcfg.prm_stage1_steps, stage1_lr=1e-3,
                                 stage2_steps=dcfg.prm_stage2_steps, stage2_lr=1e-3,
                                 global_batch_size=32, micro_batch_size=16, weight_decay=0.0,
                                 lm_loss_weight=dcfg.prm_lm_loss_weight)
        prm_result = train_prm(prm_cfg, groups)
        prm_report = {"auroc": prm_result.eval.auroc, "f1": prm_result.eval.f1,
                      "train_s": prm_result.train_seconds}
        _mark_done(prm_dir, prm_digest, groups, **prm_report)
    else:
        say(f"[demo] PRM: reusing {prm_dir} (same settings)", flush=True)
    times["prm_s"] = time.perf_counter() - t

    overrides = [f"trainer.run_dir={rl_dir}", f"model.path={sft_dir}",
                 f"prm.path={prm_dir if prm_report is not None else 'null'}",
                 f"trainer.steps={dcfg.rl_steps}",
                 f"trainer.seed={dcfg.seed}", f"advantage.method={dcfg.method}"]
    overrides += METHOD_OVERRIDES.get(dcfg.method, [])
    cfg = load_config(RL_YAML, overrides)
    trainer = RLTrainer(cfg, groups, tok)
    # through the lifecycle: the engine sleeps between phases (its KV cache too) and the
    # trainer's state leaves the device while it generates where *.offload says so
    before = trainer.lifecycle.generate(
        lambda: evaluate(trainer.engine, tok, groups, dcfg.eval_problems))
    t = time.perf_counter()
    history = trainer.fit()
    times["rl_s"] = time.perf_counter() - t
    after = trainer.lifecycle.generate(
        lambda: evaluate(trainer.engine, tok, groups, dcfg.eval_problems))
    phases = {}
    for h in history:
        for k, v in h.items():
            if k.startswith("timing/") and k != "timing/step_s":
                phases[k[7:]] = phases.get(k[7:], 0.0) + v
    summary = {"method": dcfg.method, "world_size": groups.world_size,
               "sft_final_loss": sft.get("final_loss"), "prm": prm_report,
               "before_rl": before, "after_rl": after, "times_s": times,
               "rl_steps_run": len(history), "rl_phase_times_s": phases,
               "total_s": time.perf_counter() - t0,
               "dirs": {"warmup": sft_dir, "prm": prm_dir, "rl": rl_dir}}
    if groups.rank == 0:
        with open(os.path.join(rl_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
    return summary


def print_summary(s: dict) -> None:
    b, a = s["before_rl"], s["after_rl"]
    print("\n================ megaprm demo summary ================")
    print(f"method                       : {s['method']}  ({s['world_size']} torchrun ranks, CPU)")
    if s["prm"] is not None:  # PRIME uses no discriminative PRM: its AUROC does not apply
        print(f"PRM step AUROC (held-out)    : {s['prm'].get('auroc', float('nan')):.3f}")
    else:
        print(f"PRM                          : {PRIME_NOTE}")
    print(f"greedy accuracy  before RL   : {b['accuracy']:.3f}   after RL: {a['accuracy']:.3f}"
          f"   ({b['problems']} held-out problems)")
    print(f"correct answers with a wrong step (exact): before {b['correct_with_wrong_step']:.3f}"
          f"   after {a['correct_with_wrong_step']:.3f}")
    print(f"fully correct solutions      : before {b['all_steps_correct']:.3f}   after "
          f"{a['all_steps_correct']:.3f}")
    t = s["times_s"]
    wall = seconds_since_launch()
    print(f"time: warm-up {t['warmup_s']:.0f}s  PRM {t['prm_s']:.0f}s  RL {t['rl_s']:.0f}s  "
          f"(RL steps run now: {s['rl_steps_run']}); "
          + (f"wall {wall:.0f}s since `megaprm demo` started (ranks, imports and evaluation "
             "included)" if wall is not None else f"total {s['total_s']:.0f}s"))
    print("RL phases (s): " + "  ".join(f"{k} {v:.1f}" for k, v in s["rl_phase_times_s"].items()))
    d = s["dirs"]
    prm = (f"PRM {d['prm']}" if s["prm"] is not None
           else "the implicit PRM in the RL run's checkpoints/step_N/prm")
    print(f"wrote: warm-up policy {d['warmup']}, {prm}, RL run {d['rl']} "
          f"(metrics.jsonl, samples.jsonl, checkpoints/, summary.json; plots: "
          f"megaprm plot {d['rl']})")
    print("=======================================================\n")

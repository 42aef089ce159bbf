"""The starting point of every arithmetic run: the warm-up policy and the PRM, how they are
trained, cached and shipped inside the package (rebuildable with `megaprm demo --from-scratch`).

* warm-up policy: `warmup` (tiny Qwen2-shaped policy, hidden 128, 4 layers, 400 supervised
  steps of 64 reference solutions through the Megatron actor);
* PRM: `prm_recipe` (docs/prm.md): a random-init hidden-64 trunk, 20 head-only + 3000
  whole-model steps of 64 solutions, auxiliary LM loss; held-out step AUROC >= 0.9.

A stage that ran writes its digest next to its output (`mark_stage_done`), and a later run with
the same settings reuses it (`cached_stage`): the comparison caches its own warm-up and PRM so.

Together they take ~6 CPU minutes on 2 ranks, most of a 10-minute budget, so the results ship
in `megaprm/assets/demo/` (~4 MB, fp32) with `manifest.json`: the recipe's digest, the sha256 of
every tensor, the PRM's held-out metrics and how the files were built. A shipped start is used
only when its recipe digest equals the code's (else the demo rebuilds it, saying why).
`--from-scratch` rebuilds both with the same function that built the shipped files and reports
whether every tensor is identical to the shipped one (the training is seeded and deterministic
on one machine; another CPU or torch build may differ in the last bits).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from tqdm import tqdm

from megaprm.digest import json_digest, source_digest
from megaprm.experiments.arithmetic.runs import PRM_INITS, TASKS, CompareConfig
from megaprm.models.actor import build_stage
from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.mapping import load_hf_weights
from megaprm.models.tiny import save_tiny_model
from megaprm.parallel import pipeline
from megaprm.parallel.groups import Groups
from megaprm.parallel.optimizer import OptimConfig, Optimizer
from megaprm.tasks.arithmetic import generate_problems, reference_solution
from megaprm.trainer.export import save_hf
from megaprm.trainer.prm_training import PRMTrainConfig, train_prm
from megaprm.trainer.sft import sft_step

# megaprm/assets/demo
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                           "assets", "demo")
MANIFEST = "manifest.json"
# files a start directory needs (model weights, config, the char tokenizer)
START_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


@dataclass
class WarmupConfig:
    """What the warm-up policy depends on (the digest of a cached warm-up is over these fields).
    `seed`: the random init and the supervised data stream (seed 0 is the shipped start's)."""
    seed: int = 0
    warmup_steps: int = 400
    warmup_batch: int = 64
    warmup_lr: float = 2e-3
    hidden: int = 128
    layers: int = 4
    task: str = "short"   # a key of runs.TASKS


def tiny_qwen2(out_dir: str, tokenizer, seed: int, hidden: int, layers: int) -> None:
    """A random-init tiny Qwen2 over the char tokenizer, written to out_dir: every start's policy
    before its warm-up, and the short task's PRM trunk (4 heads, 2 of them key/value, an MLP
    3x the hidden size; the caller's rank 0 writes it). The one place these shapes are set, so
    the start's code version (`code_version`) changes with them."""
    save_tiny_model("qwen2", out_dir, seed=seed, tokenizer=tokenizer, vocab_size=len(tokenizer),
                    hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                    intermediate_size=3 * hidden, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def init_policy(wcfg: WarmupConfig, tokenizer, out_dir: str, rank: int) -> str:
    """The random-init tiny Qwen2 policy the warm-up starts from (rank 0 writes it)."""
    if rank == 0:
        tiny_qwen2(out_dir, tokenizer, wcfg.seed, wcfg.hidden, wcfg.layers)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def prm_trunk(init: str, out_dir: str, sft_dir: str, tokenizer, seed: int, hidden: int,
              layers: int, rank: int) -> str:
    """The model a start's PRM is trained from (`runs.PRM_INITS`): the warm-up policy in sft_dir
    ("warmup"), or a random-init trunk of `hidden` x `layers` drawn with `seed` and written to
    out_dir ("random"). Every rank returns its directory once it exists."""
    if init not in PRM_INITS:
        raise ValueError(f"PRM init {init!r}: valid inits are {list(PRM_INITS)}")
    if init == "random" and rank == 0:
        tiny_qwen2(out_dir, tokenizer, seed, hidden, layers)
    if dist.is_initialized():
        dist.barrier()
    return sft_dir if init == "warmup" else out_dir


def sft_batch(tokenizer, problems):
    """prompt + reference solution + EOS, right-padded; loss on the solution and EOS."""
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


def warmup(wcfg: WarmupConfig, groups: Groups, tokenizer, init_dir: str, out_dir: str) -> float:
    """Supervised warm-up of the Megatron actor; writes the result as an HF directory."""

    spec = spec_from_hf(init_dir)
    model = build_stage(spec, groups)
    load_hf_weights(model, init_dir, spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                    pp=groups.pp_size, pp_rank=groups.pp_rank)
    ddp = pipeline.wrap_ddp(model, groups)
    opt = Optimizer(ddp, OptimConfig(lr=wcfg.warmup_lr, clip_grad=1.0,
                                                       weight_decay=0.0), groups)
    per = wcfg.warmup_batch // groups.dp_size
    loss = float("nan")
    bar = tqdm(range(wcfg.warmup_steps), desc="warm-up (SFT)", disable=groups.rank != 0)
    for step in bar:
        # seed k > 0 draws its own stream (seed 0 keeps the shipped start's)
        probs = generate_problems(TASKS[wcfg.task], wcfg.warmup_batch,
                                  seed=10_000 + step + 1_000_003 * wcfg.seed)
        ids, mask = sft_batch(tokenizer, probs[groups.dp_rank * per:(groups.dp_rank + 1) * per])
        lr = wcfg.warmup_lr * min(1.0, (step + 1) / 20)  # short linear warm-up
        opt.set_lr(lr)
        res = sft_step(ddp, opt, groups, ids, mask, micro_batch_size=per,
                       vocab_size=spec.vocab_size)
        loss = res.loss
        bar.set_postfix(loss=f"{loss:.3f}")
    save_hf(ddp, groups, out_dir, hf_config=spec.hf_config, tokenizer=tokenizer)
    return loss


# ------------------------------------------------------------------ stage cache (also compare's)

# the modules whose source builds a start (with everything they import): a cached start is
# keyed by their version and torch's (`digest.source_digest`), so a commit that changes how a
# start is built never reuses another commit's start
START_CODE = ("megaprm.experiments.arithmetic.start", "megaprm.tasks.tokenizer")
# runs.py: the design's defaults and knobs; what of it builds a start (the task) is in the
# digests by value, so changing a default there does not rebuild the starts
# (and rewards.prm_eval: the PRM's metrics, which score a start and never change its weights;
# the RL estimators, losses and filters, which config.py's AdvantageConfig import reaches but no
# warm-up or PRM step runs: a fix to an estimator re-runs the RL cells, not the starts)
START_CODE_EXCLUDE = ("megaprm.experiments.arithmetic.runs", "megaprm.rewards.prm_eval",
                      "megaprm.algorithms.advantages", "megaprm.algorithms.losses",
                      "megaprm.algorithms.filters")


def code_version() -> dict:
    """{"code", "files", "torch"}: the version of the code that builds a start."""
    return source_digest(START_CODE, exclude=START_CODE_EXCLUDE)


def warmup_digest(wcfg: WarmupConfig, code: dict | None = None) -> str:
    """What a cached warm-up depends on (`megaprm compare` caches its warm-up with it; `code`:
    `code_version()`, which the comparison's cache adds; the shipped demo start is keyed by its
    recipe alone and checked tensor by tensor instead)."""
    keys = ["seed", "warmup_steps", "warmup_batch", "warmup_lr", "hidden", "layers"]
    blob = {k: getattr(wcfg, k) for k in keys}
    blob["task"] = repr(TASKS[wcfg.task])
    if code is not None:
        blob["code"] = code
    return json_digest(blob)


def cached_stage(out_dir: str, digest: str) -> dict | None:
    """The record of a finished stage with this digest, or None (then it is (re)built)."""
    path = os.path.join(out_dir, "demo_stage.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    return rec if rec.get("digest") == digest else None


def mark_stage_done(out_dir: str, digest: str, groups: Groups, **info) -> None:
    """Record a finished stage (rank 0 writes out_dir/demo_stage.json; every rank waits)."""
    if groups.rank == 0:
        with open(os.path.join(out_dir, "demo_stage.json"), "w", encoding="utf-8") as f:
            json.dump({"digest": digest, **info}, f, indent=2, default=float)
    if groups.world_size > 1:
        dist.barrier()


def prm_recipe(steps: int, examples: int, task: str = "short", seed: int = 0) -> dict:
    """PRMTrainConfig's settings of docs/prm.md's recipe: `steps` whole-model steps on
    `examples` training solutions of `task`; `seed`: its data and shuffles (the trunk's init
    seed is the caller's)."""
    return {"arithmetic": TASKS[task], "num_train": examples, "num_eval": 512,
            "stage1_steps": 20, "stage1_lr": 1e-3, "stage2_steps": steps, "stage2_lr": 2e-3,
            "warmup_steps": min(50, steps), "lr_decay": "cosine", "lm_loss_weight": 1.0,
            "global_batch_size": 64, "micro_batch_size": 32, "log_every": 250, "seed": seed}


def recipe(warmup_steps: int = 400, prm_steps: int = 3000, prm_examples: int = 16000,
           task: str = "short", prm_init: str = "random") -> dict:
    """Everything the warm-up policy and the PRM depend on (JSON-able). `prm_init`: the PRM's
    trunk, random-init or the warm-up policy (`runs.PRM_INITS`; named in the recipe only when
    not random, so the shipped start's digest is unchanged)."""
    d = WarmupConfig(warmup_steps=warmup_steps, task=task)
    c = CompareConfig(prm_steps=prm_steps, prm_examples=prm_examples, task=task)
    prm = prm_recipe(c.prm_steps, c.prm_examples, task)
    prm = {k: (repr(v) if k == "arithmetic" else v) for k, v in prm.items() if k != "log_every"}
    return {"warmup": {"seed": d.seed, "steps": d.warmup_steps, "batch": d.warmup_batch,
                       "lr": d.warmup_lr, "hidden": d.hidden, "layers": d.layers,
                       "task": repr(TASKS[d.task])},
            "prm": {**prm, "hidden": c.prm_hidden, "layers": c.prm_layers, "init_seed": 0,
                    **({"init": prm_init} if prm_init != "random" else {})},
            **({"task": task} if task != "short" else {})}


def tensor_digests(model_dir: str) -> dict:
    """sha256 of every tensor's bytes (name -> hex), independent of the file's layout/metadata."""
    out = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            out[name] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return out


def read_manifest(start_dir: str | None = None) -> dict | None:
    """A start directory's manifest (default: the shipped one), or None."""
    path = os.path.join(start_dir or SHIPPED_DIR, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build(out_dir: str, rec: dict, groups, tok, say=print) -> dict:
    """Train the warm-up policy and the PRM of `rec` into out_dir/{sft,prm} (every rank calls
    it); returns the manifest record (rank 0 writes it)."""

    w, p = rec["warmup"], rec["prm"]
    sft_dir, prm_dir = os.path.join(out_dir, "sft"), os.path.join(out_dir, "prm")
    times = {}
    t = time.perf_counter()
    task = rec.get("task", "short")
    wcfg = WarmupConfig(warmup_steps=w["steps"], task=task)
    init_dir = init_policy(wcfg, tok, os.path.join(out_dir, "init"), groups.rank)
    say(f"[demo] warm-up: {w['steps']} supervised steps of {w['batch']} solutions", flush=True)
    sft_loss = warmup(wcfg, groups, tok, init_dir, sft_dir)
    times["warmup_s"] = time.perf_counter() - t

    t = time.perf_counter()
    from_warmup = p.get("init", "random") == "warmup"
    prm_init = prm_trunk(p.get("init", "random"), os.path.join(out_dir, "prm_init"), sft_dir, tok,
                         p["init_seed"], p["hidden"], p["layers"], groups.rank)
    say(f"[demo] PRM: {p['stage1_steps']} head-only + {p['stage2_steps']} whole-model steps of "
        f"{p['global_batch_size']} solutions from "
        f"{'the warm-up policy' if from_warmup else 'a random-init trunk'} (docs/prm.md's "
        "recipe)", flush=True)
    res = train_prm(PRMTrainConfig(model_dir=prm_init, output_dir=prm_dir,
                                   **prm_recipe(p["stage2_steps"], p["num_train"], task)),
                    groups)
    times["prm_s"] = time.perf_counter() - t
    man = {"recipe": rec, "digest": json_digest(rec), "origin": "built",
           "code": code_version(),  # which code built it: a rebuild's check names a change
           "sft_final_loss": sft_loss,
           "prm_eval": {"auroc": res.eval.auroc, "f1": res.eval.f1,
                        "per_kind": res.eval.per_kind},
           "build": {**times, "world_size": groups.world_size, "torch": _torch_version()}}
    if groups.rank == 0:
        man["tensors"] = {"sft": tensor_digests(sft_dir), "prm": tensor_digests(prm_dir)}
        with open(os.path.join(out_dir, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(man, f, indent=1, default=float)
    if dist.is_initialized():
        dist.barrier()
    return read_manifest(out_dir)


def _torch_version() -> str:
    return torch.__version__


def compare_tensors(a: dict, b: dict) -> dict:
    """Which tensors of two manifests' `tensors` differ (per model)."""
    out = {}
    for m in ("sft", "prm"):
        ta, tb = a.get(m, {}), b.get(m, {})
        out[m] = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
    return out


def _copy_start(src: str, dest: str, man: dict) -> None:
    """The start files of src/{sft,prm} and a manifest (origin "shipped") into dest."""
    for m in ("sft", "prm"):
        tmp = os.path.join(dest, m + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for f in START_FILES:
            if os.path.isfile(os.path.join(src, m, f)):
                shutil.copy(os.path.join(src, m, f), os.path.join(tmp, f))
        shutil.rmtree(os.path.join(dest, m), ignore_errors=True)
        os.replace(tmp, os.path.join(dest, m))
    with open(os.path.join(dest, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({**man, "origin": "shipped"}, f, indent=1)


def ensure(run_dir: str, rec: dict, groups, tok, from_scratch: bool, say=print) -> dict:
    """Put the start in RUN_DIR/sft and RUN_DIR/prm (where the *_tiny.yaml recipes look) and
    return {"sft", "prm", "source", "manifest", "seconds", ["rebuild_check"]}: the shipped
    start (copied) when its digest equals rec's and not from_scratch; else trained there, and
    reused by a later run with the same recipe ("cached")."""
    digest = json_digest(rec)
    shipped = read_manifest()
    here = read_manifest(run_dir)
    have = here is not None and here.get("digest") == digest and all(
        os.path.isfile(os.path.join(run_dir, m, "model.safetensors")) for m in ("sft", "prm"))
    if dist.is_initialized():  # every rank has read the state before rank 0 changes it, so
        dist.barrier()         # all take the same branch (and the same collectives) below
    t = time.perf_counter()
    res = {"sft": os.path.join(run_dir, "sft"), "prm": os.path.join(run_dir, "prm")}
    if not from_scratch and shipped is not None and shipped.get("digest") == digest:
        if not (have and here.get("tensors") == shipped.get("tensors")):
            if groups.rank == 0:
                os.makedirs(run_dir, exist_ok=True)
                _copy_start(SHIPPED_DIR, run_dir, shipped)
            if dist.is_initialized():
                dist.barrier()
        say(f"[demo] start: the shipped warm-up policy and PRM (megaprm/assets/demo, held-out "
            f"step AUROC {shipped['prm_eval']['auroc']:.3f}; `--from-scratch` trains them "
            "instead, ~6 minutes on a quiet 2-core box)", flush=True)
        return {**res, "source": "shipped", "manifest": shipped,
                "seconds": time.perf_counter() - t}
    if not from_scratch:
        why = ("no shipped start" if shipped is None else
               "the shipped start was built with other settings")
        say(f"[demo] start: {why}; training the warm-up policy and the PRM", flush=True)
    if have and here.get("origin") == "built":
        say(f"[demo] start: reusing the one trained in {run_dir} (same recipe; held-out step "
            f"AUROC {here['prm_eval']['auroc']:.3f})", flush=True)
        man, source = here, "cached"
    else:
        man, source = build(run_dir, rec, groups, tok, say), "built"
    res.update(source=source, manifest=man, seconds=time.perf_counter() - t)
    if shipped is not None and shipped.get("digest") == digest:
        diff = compare_tensors(man.get("tensors", {}), shipped.get("tensors", {}))
        check = {"identical_to_shipped": not any(diff.values()), "differing_tensors": diff,
                 "same_code": _same_code(shipped, man)}
        res["rebuild_check"] = check
        say("[demo] start trained from scratch: " + rebuild_sentence(check), flush=True)
    return res


def _same_code(shipped: dict, built: dict) -> bool | None:
    """Whether the shipped start and a rebuild were built by the same start code (versions from
    their manifests; None when the shipped one predates recording it)."""
    a, b = shipped.get("code"), built.get("code")
    return None if a is None or b is None else a.get("code") == b.get("code")


def rebuild_sentence(check: dict) -> str:
    """What a `--from-scratch` rebuild's check says, naming why tensors differ where the
    manifests tell: a change to the code that builds a start, or the machine's rounding."""
    if check["identical_to_shipped"]:
        return "every tensor is identical to the shipped start's"
    n = sum(map(len, check["differing_tensors"].values()))
    why = {True: "the same start code built both, so this machine or torch build rounds "
                 "differently (docs/testing.md)",
           False: "the code that builds a start has changed since the shipped one was built; "
                  "rebuild and ship it with scripts/build_demo_start.py",
           None: "the shipped start records no code version, so a code change since it was "
                 "built (docs/testing.md) and this machine's rounding are both possible"}
    return (f"NOT identical to the shipped one ({n} tensors differ): "
            f"{why[check.get('same_code')]}")


def ship(start_dir: str, dest: str | None = None) -> dict:
    """Copy a built start (a directory `build` wrote) into the package (or `dest`)."""
    dest = dest or SHIPPED_DIR
    man = read_manifest(start_dir)
    if man is None:
        raise FileNotFoundError(f"{start_dir}/{MANIFEST} not found: run `megaprm demo "
                                "--from-scratch` first")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    for m in ("sft", "prm"):
        os.makedirs(os.path.join(dest, m))
        for f in START_FILES:
            src = os.path.join(start_dir, m, f)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(dest, m, f))
        if tensor_digests(os.path.join(dest, m)) != man["tensors"][m]:
            raise RuntimeError(f"{dest}/{m}: copied tensors differ from the manifest")
    with open(os.path.join(dest, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(man, f, indent=1)
    return man

"""The demo's starting point: the warm-up policy and the PRM every demo (and comparison) run
starts from, shipped inside the package and rebuildable with `megaprm demo --from-scratch`.

* warm-up policy: `demo.warmup` (tiny Qwen2-shaped policy, hidden 128, 4 layers, 400 supervised
  steps of 64 reference solutions through the Megatron actor);
* PRM: the comparison's recipe (`compare.prm_recipe`, docs/prm.md): a random-init hidden-64
  trunk, 20 head-only + 3000 whole-model steps of 64 solutions, auxiliary LM loss; held-out
  step AUROC >= 0.9.

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
import time

from megaprm.digest import json_digest

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "assets", "demo")
MANIFEST = "manifest.json"
# files a start directory needs (model weights, config, the char tokenizer)
START_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def recipe(warmup_steps: int = 400, prm_steps: int = 3000, prm_examples: int = 16000) -> dict:
    """Everything the warm-up policy and the PRM depend on (JSON-able)."""
    from megaprm import compare, demo

    d = demo.DemoConfig(warmup_steps=warmup_steps)
    c = compare.CompareConfig(prm_steps=prm_steps, prm_examples=prm_examples)
    prm = compare.prm_recipe(c)
    prm = {k: (repr(v) if k == "arithmetic" else v) for k, v in prm.items() if k != "log_every"}
    return {"warmup": {"seed": d.seed, "steps": d.warmup_steps, "batch": d.warmup_batch,
                       "lr": d.warmup_lr, "hidden": d.hidden, "layers": d.layers,
                       "task": repr(demo.TASK)},
            "prm": {**prm, "hidden": c.prm_hidden, "layers": c.prm_layers, "init_seed": 0}}


def tensor_digests(model_dir: str) -> dict:
    """sha256 of every tensor's bytes (name -> hex), independent of the file's layout/metadata."""
    from safetensors import safe_open

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
    import torch.distributed as dist

    from megaprm import compare, demo
    from megaprm.models.tiny import save_tiny_model
    from megaprm.trainer.prm_training import PRMTrainConfig, train_prm

    w, p = rec["warmup"], rec["prm"]
    sft_dir, prm_dir = os.path.join(out_dir, "sft"), os.path.join(out_dir, "prm")
    times = {}
    t = time.perf_counter()
    dcfg = demo.DemoConfig(run_dir=out_dir, warmup_steps=w["steps"])
    init_dir = demo.init_policy(dcfg, tok, os.path.join(out_dir, "init"), groups.rank)
    say(f"[demo] warm-up: {w['steps']} supervised steps of {w['batch']} solutions", flush=True)
    sft_loss = demo.warmup(dcfg, groups, tok, init_dir, sft_dir)
    times["warmup_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prm_init = os.path.join(out_dir, "prm_init")
    if groups.rank == 0:
        save_tiny_model("qwen2", prm_init, seed=p["init_seed"], tokenizer=tok,
                        vocab_size=len(tok), hidden_size=p["hidden"], num_layers=p["layers"],
                        num_heads=4, num_kv_heads=2, intermediate_size=3 * p["hidden"],
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    if dist.is_initialized():
        dist.barrier()
    ccfg = compare.CompareConfig(prm_steps=p["stage2_steps"], prm_examples=p["num_train"])
    say(f"[demo] PRM: {p['stage1_steps']} head-only + {p['stage2_steps']} whole-model steps of "
        f"{p['global_batch_size']} solutions (docs/prm.md's recipe)", flush=True)
    res = train_prm(PRMTrainConfig(model_dir=prm_init, output_dir=prm_dir,
                                   **compare.prm_recipe(ccfg)), groups)
    times["prm_s"] = time.perf_counter() - t
    man = {"recipe": rec, "digest": json_digest(rec), "origin": "built",
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
    import torch

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
    import shutil

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
    import torch.distributed as dist

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
        res["rebuild_check"] = {"identical_to_shipped": not any(diff.values()),
                                "differing_tensors": diff}
        say("[demo] start trained from scratch: every tensor is "
            + ("identical to the shipped start's" if not any(diff.values()) else
               f"NOT identical to the shipped one ({sum(map(len, diff.values()))} tensors "
               "differ: another machine or torch build rounds differently)"), flush=True)
    return res


def ship(start_dir: str, dest: str | None = None) -> dict:
    """Copy a built start (a directory `build` wrote) into the package (or `dest`)."""
    import shutil

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

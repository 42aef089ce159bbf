"""One RL step through megaprm (1 rank, 2 ranks) and Hugging Face TRL's GRPOTrainer, same CPU work.

    python scripts/bench_peer_trl.py [--steps 3] [--warmup 1] [--ranks 1 2] [--pack TOKENS ...]
                                     [--rounds 1] [--skip-trl] [--trl-venv DIR]
                                     [--out runs/bench/bench_peer_trl.json]

Workload (the same for every row): the tiny Qwen2-shaped policy of `bench_rl_step.py` (char
tokenizer, built offline), arithmetic prompts, 8 prompts x 8 samples per step, at most 48 new
tokens, temperature 1, GRPO advantages, token-mean loss, no KL, one optimiser step per batch,
fp32, one torch thread per process. `--pack TOKENS` adds megaprm rows whose update packs the
sequences into rows of at most TOKENS tokens (`actor.max_tokens_per_micro_batch`, verl's
dynamic batch size; TRL 1.16's GRPOTrainer has no packing): the same samples, loss and
gradient, without the padding's arithmetic. Measured: CPU seconds per step (`time.process_time` of each
process around its step, summed over the ranks: what the step costs the machine, the figure
to compare on a shared box), wall seconds, the 1-minute load before and after. Also the rollout
engine alone at 64 and 32 rows: decode steps through transformers' forward and through the
compact step, with and without the CUDA->CPU function mode (`generation_alone`).

TRL (1.16.0) is never a megaprm dependency: the script makes its own venv (default
runs/bench/trl-venv) whose `.pth` file puts the project's site-packages after its own, so
torch and transformers are reused (no second torch download), and pip installs only trl and
what it adds (accelerate, datasets, ...). `--skip-trl` measures megaprm alone.

Cross-check on one fixed batch (prompts + completions + advantages, sampled once): TRL's
`compute_loss` and its gradient against megaprm's actor (Megatron GPTModel from the same HF
weights, `models.logprobs.next_token_logprobs`, `algorithms.losses.actor_loss` token-mean,
old log-probs = detached new ones: one on-policy update); gradients compared per HF tensor
after megaprm's are mapped back to HF names (`weight_sync.iter_hf_weights` over the grads).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TRL_VERSION = "1.16.0"
PROMPTS, SAMPLES, MAX_TOKENS, TEMPERATURE, LR = 8, 8, 48, 1.0, 1e-4


def _cpu_s() -> float:
    return time.process_time()


# ----------------------------------------------------------------------------------- megaprm

def megaprm_rank(model_dir: str, run_dir: str, steps: int, warmup: int,
                 overrides: tuple = ()) -> dict:
    """One rank of the megaprm run: build the trainer, warmup + steps RL steps."""
    import torch

    torch.set_num_threads(1)
    from megaprm.config import load_config
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    c0 = _cpu_s()
    groups = init_distributed(tp=1, pp=1, seed=0)
    world = groups.world_size
    cfg = load_config(str(ROOT / "megaprm" / "configs" / "demo.yaml"), [
        f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "parallel.tp=1",
        "parallel.pp=1", "prm.kind=none", "advantage.method=grpo", "trainer.wandb=disabled",
        "trainer.progress=false", f"trainer.steps={steps + warmup}", "model.dtype=fp32",
        f"data.prompts_per_step={PROMPTS}", f"rollout.n={SAMPLES}",
        f"rollout.max_tokens={MAX_TOKENS}", f"rollout.temperature={TEMPERATURE}",
        "actor.loss_agg=token-mean", "actor.kl_coef=0.0", "actor.mini_batches=1",
        f"actor.micro_batch_size={PROMPTS * SAMPLES // world}", f"actor.optim.lr={LR}",
        *overrides])
    trainer = RLTrainer(cfg, groups, build_char_tokenizer())
    build_cpu = _cpu_s() - c0
    rows = []
    for s in range(warmup + steps):
        c, w = _cpu_s(), time.perf_counter()
        m = trainer.step(s)
        if s >= warmup:
            rows.append({"cpu_s": _cpu_s() - c, "wall_s": time.perf_counter() - w,
                         **{k: v for k, v in m.items() if k.startswith("timing/")}})
    destroy()
    return {"build_cpu_s": build_cpu, "steps": rows,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_megaprm(model_dir: str, world: int, steps: int, warmup: int,
                overrides: tuple = ()) -> dict:
    from megaprm.parallel.launch import spawn

    with tempfile.TemporaryDirectory(prefix="bench-peer-trl-") as run_dir:
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.perf_counter()
        # fresh interpreters: process_cpu_s_total counts each rank's imports, as TRL's does
        ranks = spawn(megaprm_rank, world, model_dir, run_dir, steps, warmup, tuple(overrides),
                      start_method="spawn")
        wall = time.perf_counter() - w0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    per_step_cpu = [sum(r["steps"][i]["cpu_s"] for r in ranks) for i in range(steps)]
    per_step_wall = [max(r["steps"][i]["wall_s"] for r in ranks) for i in range(steps)]
    return {"ranks": world, "cpu_s_per_step": statistics.median(per_step_cpu),
            "cpu_s_per_step_runs": per_step_cpu,
            "wall_s_per_step": statistics.median(per_step_wall),
            "build_cpu_s_ranks": [r["build_cpu_s"] for r in ranks],
            "process_cpu_s_total": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "process_wall_s": wall,
            "peak_rss_mb_ranks": [r["peak_rss_mb"] for r in ranks],
            "phase_s_rank0": {k: statistics.median(s[k] for s in ranks[0]["steps"])
                              for k in ranks[0]["steps"][0] if k.startswith("timing/")}}


def megaprm_loss_and_grads(batch_path: str, model_dir: str, out_path: str) -> None:
    """megaprm's actor loss and gradient on the fixed batch (one process, world of one)."""
    import torch

    torch.set_num_threads(1)
    from megaprm.algorithms.losses import actor_loss
    from megaprm.models.actor import build_gpt
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.logprobs import next_token_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.parallel.pipeline import TokenBatch, gpt_forward
    from megaprm.parallel.ports import free_port
    from megaprm.rollout.weight_sync import iter_hf_weights

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    g = init_distributed(tp=1, pp=1, seed=0)
    b = torch.load(batch_path)
    spec = spec_from_hf(model_dir)
    model = build_gpt(spec, tp=1, pp=1, pp_rank=0, dtype=torch.float32)
    load_hf_weights(model, model_dir, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    # one row = prompt (left-padded) + completion (right-padded), as TRL concatenates them
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    # left padding: shift every row so that its real tokens start at 0 (megaprm's layout)
    rows, masks, p = [], [], b["prompt_ids"].shape[1]
    for i in range(ids.shape[0]):
        keep = attn[i].bool()
        r = ids[i][keep]
        rows.append(r)
        m = torch.zeros(len(r))
        n_prompt = int(b["prompt_mask"][i].sum())
        m[n_prompt - 1:n_prompt - 1 + int(b["completion_mask"][i].sum())] = 1
        masks.append(m)
    width = max(len(r) for r in rows)
    input_ids = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    loss_mask = torch.stack([torch.nn.functional.pad(m, (0, width - len(m))) for m in masks])
    logits = gpt_forward(model, TokenBatch(input_ids=input_ids, loss_mask=loss_mask))
    logits = logits[..., :spec.vocab_size] if logits.shape[-1] > spec.vocab_size else logits
    logp = next_token_logprobs(logits.float() / TEMPERATURE, input_ids)
    mask = loss_mask[:, :-1]
    adv = b["advantages"][:, None].expand_as(logp)
    loss, _ = actor_loss(logp, logp.detach(), adv, mask, agg="token-mean")
    loss.backward()
    for prm in model.parameters():  # the gradients, mapped to HF names as the weights are
        grad = prm.main_grad if getattr(prm, "main_grad", None) is not None else prm.grad
        prm.data = grad.detach().clone() if grad is not None else torch.zeros_like(prm)
    grads = {k: v.clone() for k, v in iter_hf_weights(model, g, spec)}
    torch.save({"loss": float(loss), "grads": grads, "tokens": float(mask.sum())}, out_path)
    destroy()
    del p


def generation_phase(model_dir: str, reps: int = 3) -> dict:
    """The rollout engine alone (`HFEngine.generate`, 8 prompts, 48 tokens, T=1, one thread)
    at 64 and 32 rows: each decode step through transformers' forward (`compact_decode=False`)
    and through the compact step (the default on the CPU), both with the CUDA->CPU function
    mode paused around the decode loop (as the engine does), and the compact step with the mode
    in force (as before `cpu.paused`); min CPU-s over `reps` interleaved calls, and how many
    torch calls the mode intercepted per call."""
    import torch

    torch.set_num_threads(1)
    from megaprm.parallel import cpu
    from megaprm.rollout.engine import SamplingParams
    from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    engines = {c: HFEngine.from_pretrained(model_dir, HFEngineConfig(
        pad_token_id=tok.pad_token_id, eos_token_ids=(tok.eos_token_id,), compact_decode=c))
        for c in (False, True)}
    cpu.install()  # as in a training process
    prompts = [tok.encode(p.prompt) for p in _problems(PROMPTS, seed=0)]
    calls, mode = [0], cpu._CudaToCpuMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return mode(self, func, types, args, kwargs)

    cpu._CudaToCpuMode.__torch_function__ = counting
    variants = {"transformers_step": engines[False].generate,
                "compact_step": engines[True].generate,
                "compact_step_mode_in_force": engines[True]._generate}
    out = {}
    for rows in (PROMPTS * SAMPLES, PROMPTS * SAMPLES // 2):
        params = SamplingParams(n=rows // PROMPTS, max_tokens=MAX_TOKENS,
                                temperature=TEMPERATURE, seed=3)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(reps):
            for name, fn in variants.items():
                calls[0] = 0
                c = _cpu_s()
                batch = fn(prompts, params)
                best[name] = min(best[name], _cpu_s() - c)
                out[f"{rows}_rows_{name}"] = {"intercepted_calls": calls[0],
                                              "tokens": int(batch.response_mask.sum())}
        for name in variants:
            out[f"{rows}_rows_{name}"]["cpu_s"] = best[name]
    cpu._CudaToCpuMode.__torch_function__ = mode
    return out


def run_generation(model_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-W", "ignore", __file__, "--phase", "generation",
                        "--model", model_dir], cwd=ROOT, capture_output=True, text=True,
                       check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        raise RuntimeError(f"generation phase failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------- TRL

def trl_python(venv: str) -> str:
    """The venv's python with trl==TRL_VERSION, made if absent (see the module doc)."""
    py = os.path.join(venv, "bin", "python")
    probe = [py, "-c", f"import trl, sys; sys.exit(trl.__version__ != {TRL_VERSION!r})"]
    if os.path.exists(py) and subprocess.run(probe, capture_output=True, check=False).returncode \
            == 0:
        return py
    print(f"making {venv} with trl=={TRL_VERSION} (the project's torch/transformers reused)",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import sysconfig

    with open(os.path.join(site, "_megaprm_base.pth"), "w", encoding="utf-8") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # after the venv's own packages
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q",
                    f"trl=={TRL_VERSION}"], check=True)
    subprocess.run(probe, check=True)
    return py


def _problems(n: int, seed: int) -> list:
    from megaprm.tasks.arithmetic import ArithmeticConfig, generate_problems

    # the task as megaprm's demo.yaml configures it (data.arithmetic)
    return generate_problems(ArithmeticConfig(num_ops=(2, 4), operand_max=20, ops="+-"), n,
                             seed=seed)


def trl_phase(model_dir: str, steps: int, warmup: int, batch_path: str) -> dict:
    """Runs inside the TRL venv: timed GRPOTrainer steps, then the fixed-batch cross-check
    (TRL's compute_loss and gradient; the batch is saved for megaprm's side)."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megaprm.tasks.arithmetic import extract_boxed_int

    c0 = _cpu_s()
    problems = _problems(PROMPTS * (steps + warmup + 1), seed=0)
    answers = {p.prompt: p.answer for p in problems}
    data = Dataset.from_list([{"prompt": p.prompt} for p in problems])

    def reward(prompts, completions, **kw):
        return [float(extract_boxed_int(c) == answers[p]) for p, c in zip(prompts, completions)]

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.c, self.w = _cpu_s(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append({"cpu_s": _cpu_s() - self.c, "wall_s": time.perf_counter() - self.w})

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True,
                     per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                     max_completion_length=MAX_TOKENS, temperature=TEMPERATURE, beta=0.0,
                     loss_type="dapo", learning_rate=LR, max_steps=steps + warmup,
                     report_to="none", save_strategy="no", logging_steps=1, seed=0,
                     bf16=False, fp16=False, shuffle_dataset=False, disable_tqdm=True,
                     dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    build_cpu = _cpu_s() - c0

    # the fixed batch first, on the weights as loaded (megaprm's side loads the same HF
    # directory): TRL's own generation and scoring of the last prompts, then its loss
    model.train()
    inputs = [{"prompt": p.prompt} for p in problems[-PROMPTS:] for _ in range(SAMPLES)]
    torch.manual_seed(1)
    batch = trainer._generate_and_score_completions(inputs)
    # fixed advantages: the untrained policy's rewards are all 0 (GRPO advantages 0, a loss
    # and gradient of 0 would check nothing)
    batch["advantages"] = torch.randn(len(inputs), generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by train() for each step
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad()
    keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    torch.save({k: batch[k].detach().cpu() for k in keep}, batch_path)
    torch.save({"loss": float(loss), "grads": grads}, batch_path + ".trl")

    trainer.train()
    timed = times[warmup:]
    import trl

    return {"trl": trl.__version__, "torch": torch.__version__,
            "cpu_s_per_step": statistics.median(t["cpu_s"] for t in timed),
            "cpu_s_per_step_runs": [t["cpu_s"] for t in timed],
            "wall_s_per_step": statistics.median(t["wall_s"] for t in timed),
            "build_cpu_s": build_cpu,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "config": {"loss_type": cfg.loss_type, "beta": cfg.beta,
                       "scale_rewards": str(getattr(cfg, "scale_rewards", None)),
                       "num_iterations": cfg.num_iterations}}


def run_trl(py: str, model_dir: str, steps: int, warmup: int, batch_path: str) -> dict:
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    r = subprocess.run([py, "-W", "ignore", __file__, "--phase", "trl", "--model", model_dir,
                        "--steps", str(steps), "--warmup", str(warmup), "--batch", batch_path],
                       cwd=ROOT, capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
                            "OMP_NUM_THREADS": "1"})
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise RuntimeError(f"TRL phase failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_cpu_s_total"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    out["process_wall_s"] = time.perf_counter() - w0
    return out


def _over_rounds(results: list) -> dict:
    """One row from its rounds: the last round's record, with the per-step CPU and wall
    figures replaced by their median over the rounds (each round's value kept)."""
    out = dict(results[-1])
    if len(results) > 1:
        for key in ("cpu_s_per_step", "wall_s_per_step"):
            out[key] = statistics.median(r[key] for r in results)
            out[f"{key}_rounds"] = [r[key] for r in results]
    return out


def _paired(runs: dict, num: str, den: str, name: str) -> dict:
    """`num` over `den` CPU-s per step within each round (rows of one round run minutes apart,
    so the box's drift between rounds cancels), and their median: `<name>_rounds`,
    `<name>_paired_median`. Empty with one round."""
    if len(runs[num]) < 2:
        return {}
    per = [a["cpu_s_per_step"] / b["cpu_s_per_step"] for a, b in zip(runs[num], runs[den])]
    return {f"{name}_rounds": per, f"{name}_paired_median": statistics.median(per)}


def cross_check(batch_path: str, model_dir: str) -> dict:
    import torch

    out = batch_path + ".megaprm"
    r = subprocess.run([sys.executable, "-W", "ignore", __file__, "--phase", "megaprm-loss",
                        "--model", model_dir, "--batch", batch_path], cwd=ROOT,
                       capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        raise RuntimeError(f"megaprm loss phase failed:\n{r.stderr[-4000:]}")
    m, t = torch.load(out), torch.load(batch_path + ".trl")
    names = sorted(set(t["grads"]) & set(m["grads"]))
    tg = torch.cat([t["grads"][n].double().flatten() for n in names])
    mg = torch.cat([m["grads"][n].double().flatten() for n in names])
    # transformers' embedding has padding_idx = pad_token_id: that row gets no gradient from the
    # input side; Megatron's embedding has no such row. The untrained policy samples the pad
    # token as a real token now and then, so the row is compared apart.
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        pad = json.load(f).get("pad_token_id")
    emb = "model.embed_tokens.weight"
    rest_t, rest_m = dict(t["grads"]), dict(m["grads"])
    pad_row = None
    if pad is not None and emb in rest_t:
        keep = torch.arange(rest_t[emb].shape[0]) != pad
        pad_row = {"trl_norm": float(rest_t[emb][pad].norm()),
                   "megaprm_norm": float(rest_m[emb][pad].norm())}
        rest_t[emb], rest_m[emb] = rest_t[emb][keep], rest_m[emb][keep]
    rt = torch.cat([rest_t[n].double().flatten() for n in names])
    rm = torch.cat([rest_m[n].double().flatten() for n in names])
    return {"trl_loss": t["loss"], "megaprm_loss": m["loss"],
            "loss_rel_diff": abs(t["loss"] - m["loss"]) / max(abs(t["loss"]), 1e-12),
            "grad_rel_diff": float((tg - mg).norm() / tg.norm().clamp_min(1e-30)),
            "grad_rel_diff_without_pad_embedding_row": float((rt - rm).norm()
                                                             / rt.norm().clamp_min(1e-30)),
            "pad_embedding_row_grad": pad_row,
            "grad_norm_trl": float(tg.norm()), "grad_norm_megaprm": float(mg.norm()),
            "tensors_compared": len(names),
            "tensors_only_trl": sorted(set(t["grads"]) - set(m["grads"]))[:5],
            "completion_tokens": m["tokens"]}


# -------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    from megaprm.bench import default_out

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--pack", type=int, nargs="*", default=[], metavar="TOKENS",
                    help="also run megaprm with the update's sequences packed into rows of at "
                         "most TOKENS tokens (actor.max_tokens_per_micro_batch)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every row this many times, interleaved (the shared box drifts "
                         "by +-15%% between minutes); a row's figure is the median over rounds")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-venv", default=str(ROOT / "runs" / "bench" / "trl-venv"))
    ap.add_argument("--out", default=default_out("bench_peer_trl.json"))
    ap.add_argument("--phase", choices=["trl", "megaprm-loss", "generation"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase == "trl":
        print(json.dumps(trl_phase(a.model, a.steps, a.warmup, a.batch)))
        return 0
    if a.phase == "generation":
        print(json.dumps(generation_phase(a.model)))
        return 0
    if a.phase == "megaprm-loss":
        megaprm_loss_and_grads(a.batch, a.model, a.batch + ".megaprm")
        return 0

    from bench_rl_step import MODEL, cpu_name, make_model

    load0 = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-peer-trl-model-") as tmp:
        model_dir = make_model(os.path.join(tmp, "policy"))
        batch = os.path.join(tmp, "batch.pt")
        print("generation alone ...", file=sys.stderr, flush=True)
        generation = run_generation(model_dir)
        runs = {}  # row -> one result per round; the rows run interleaved, round by round
        py = None if a.skip_trl else trl_python(a.trl_venv)
        for rnd in range(a.rounds):
            for world in a.ranks:
                for budget in [None, *a.pack]:
                    name = f"megaprm_{world}_rank" + (f"_packed_{budget}" if budget else "")
                    print(f"round {rnd + 1}/{a.rounds}: {name} ...", file=sys.stderr, flush=True)
                    over = [f"actor.max_tokens_per_micro_batch={budget}"] if budget else []
                    runs.setdefault(name, []).append(
                        run_megaprm(model_dir, world, a.steps, a.warmup, over))
            if py:
                print(f"round {rnd + 1}/{a.rounds}: TRL GRPOTrainer ...", file=sys.stderr,
                      flush=True)
                runs.setdefault("trl", []).append(run_trl(py, model_dir, a.steps, a.warmup, batch))
        rows = {name: _over_rounds(results) for name, results in runs.items()}
        check = None
        if py:
            try:
                check = cross_check(batch, model_dir)
            except RuntimeError as e:  # the timings stand; the report says what failed
                check = {"error": str(e)[-2000:]}
    one = rows.get("megaprm_1_rank")
    ratios = {}
    if one and "trl" in rows:
        ratios["megaprm_1_rank_cpu_over_trl"] = one["cpu_s_per_step"] / rows["trl"]["cpu_s_per_step"]
        ratios.update(_paired(runs, "megaprm_1_rank", "trl", "megaprm_1_rank_cpu_over_trl"))
    if one and "megaprm_2_rank" in rows:
        two = rows["megaprm_2_rank"]
        ratios["two_rank_cpu_over_one"] = two["cpu_s_per_step"] / one["cpu_s_per_step"]
        ratios["two_rank_throughput_over_one_wall"] = one["wall_s_per_step"] / two["wall_s_per_step"]
        ratios.update(_paired(runs, "megaprm_2_rank", "megaprm_1_rank", "two_rank_cpu_over_one"))
    out = {"benchmark": "one RL step, megaprm vs TRL GRPOTrainer, same CPU workload",
           "baseline": "TRL GRPOTrainer (same run), megaprm 1 rank for the 2-rank row",
           "device": {"kind": "cpu", "cpu": cpu_name(), "cores": os.cpu_count(),
                      "python": platform.python_version()},
           "load": {"before_1_5_15m": [round(x, 2) for x in load0],
                    "after_1_5_15m": [round(x, 2) for x in os.getloadavg()]},
           "model": MODEL,
           "workload": {"prompts": PROMPTS, "samples": SAMPLES, "max_tokens": MAX_TOKENS,
                        "temperature": TEMPERATURE, "loss": "token-mean", "kl": 0.0,
                        "dtype": "fp32", "threads_per_process": 1, "steps": a.steps,
                        "warmup": a.warmup, "rounds": a.rounds},
           "rows": rows, "ratios": ratios, "cross_check": check,
           "generation_alone": generation}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"ratios": ratios, "cross_check": check,
                      "cpu_s_per_step": {k: v["cpu_s_per_step"] for k, v in rows.items()}},
                     indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

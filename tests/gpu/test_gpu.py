"""The GPU tier (`pytest -m gpu`): the whole path on CUDA, one GPU, against the same references
as the CPU tests. Skipped, with the reason, where CUDA is absent (`make test` on CPU).

One rank per test runs on cuda:0 (parallel.launch.spawn keeps the GPU visible when the world
fits the GPUs); multi-rank layouts stay in the CPU tier.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megaprm.algorithms.registry import METHODS
from megaprm.parallel import launch
from tests.rl_setup import rl_config, tiny_policy_and_prm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA on this machine: the GPU tier did not run")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# fp32: the checks below compare the trainer with the engine and transformers at 1e-4 (CUDA's
# default, model.dtype auto, is bf16; test_actor_logprobs_equal_transformers_on_cuda covers it)
GPU = ["rollout.max_tokens=16", "actor.micro_batch_size=8", "actor.mini_batches=1",
       "model.dtype=fp32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_policy_and_prm(tmp_path_factory.mktemp("gpu"), hidden=64)


def _config(run_dir, policy, prm, method, extra=()):
    return rl_config(run_dir, policy, prm, method, [*GPU, *extra])


def _full_fp32() -> None:
    """init_distributed turns TF32 on for CUDA's fp32 matmuls (device.configure_cuda_math);
    the fp32 checks here compare with fp32 references at 1e-4, so a rank that runs them turns
    it off again (with TF32 on, an H200 gave engine-vs-trainer log-probs 1.2e-4 apart)."""
    torch.set_float32_matmul_precision("highest")


# ------------------------------------------------------------------ actor vs transformers

def _actor_vs_transformers(policy, dtype_name):
    from transformers import AutoModelForCausalLM

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.parallel.init import init_distributed
    from checkpoint_tools import model_source
    from megaprm.trainer.rl.policy import Policy

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = init_distributed()
    _full_fp32()
    src = model_source.resolve(policy)
    spec = spec_from_hf(src.hf_dir)
    pol = Policy(spec, g, src, trainable=False, dtype=dtype)
    ids = torch.randint(0, spec.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    ours = pol.logprobs(ids)
    hf = AutoModelForCausalLM.from_pretrained(policy, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = hf(ids.cuda()).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].cuda()[..., None])[..., 0]
    diff = (ours.float() - ref.cpu()).abs()
    return {"device": str(next(pol.model.parameters()).device), "max": float(diff.max()),
            "mean": float(diff.mean())}


def test_actor_logprobs_equal_transformers_on_cuda(models):
    policy, _ = models
    fp32 = launch.spawn(_actor_vs_transformers, 1, policy, "fp32")[0]
    assert fp32["device"].startswith("cuda")
    assert fp32["max"] <= 1e-4, fp32
    bf16 = launch.spawn(_actor_vs_transformers, 1, policy, "bf16")[0]
    print(f"bf16 log-prob |diff| vs transformers: mean {bf16['mean']:.3g} max {bf16['max']:.3g}")
    assert bf16["mean"] <= 2e-2, bf16  # bf16 rounding of two different kernels


# ------------------------------------------------------------------ optimizer: CPU vs CUDA

def _one_adam_step(policy):
    import megatron.core.distributed as mcore_distributed

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.sft import sft_step
    from checkpoint_tools import model_source

    g = init_distributed()
    _full_fp32()
    src = model_source.resolve(policy)
    spec = spec_from_hf(src.hf_dir)
    model = build_stage(spec, g, dtype=torch.float32)  # compared with the CPU's fp32
    model_source.load_weights(model, src, spec, g)
    ddp = pipeline.wrap_ddp(model, g)
    cfg = OptimConfig(lr=1e-3, clip_grad=1.0)
    opt = Optimizer(ddp, cfg, g)
    named = list(ddp.module.named_parameters())
    before = {n: p.detach().double().cpu() for n, p in named}
    grads, finalize = {}, mcore_distributed.finalize_model_grads

    def finalize_then_copy(models, *a, **k):  # the reduced grads before either path clips
        out = finalize(models, *a, **k)
        grads.update({n: p.main_grad.detach().double().cpu() for n, p in named})
        return out

    # Optimizer.step imports it from this module at each call, first thing on both paths
    mcore_distributed.finalize_model_grads = finalize_then_copy
    ids = torch.randint(0, spec.vocab_size, (4, 24), generator=torch.Generator().manual_seed(3))
    res = sft_step(ddp, opt, g, ids, torch.ones(4, 24), micro_batch_size=2,
                   vocab_size=spec.vocab_size)
    return {"megatron_optimizer": opt.megatron, "loss": res.loss, "grad_norm": res.grad_norm,
            "before": before, "grads": grads, "cfg": cfg,
            "params": {n: p.detach().double().cpu() for n, p in named}}


def _adamw_first_step(run):
    """torch.optim.AdamW's first step written out (float64) on a run's own grads: clip by
    max_norm / (norm + 1e-6) when below 1 (megatron-core's clip_grad_by_total_norm_fp32), then
    m_hat = g and v_hat = g^2, so p <- p * (1 - lr * wd) - lr * g / (|g| + eps)."""
    cfg, grads = run["cfg"], run["grads"]
    norm = float(sum(gr.pow(2).sum() for gr in grads.values()).sqrt())
    coef = min(1.0, cfg.clip_grad / (norm + 1e-6))
    return {n: p * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * (coef * grads[n])
            / ((coef * grads[n]).abs() + cfg.eps) for n, p in run["before"].items()}


def test_megatron_optimizer_on_cuda_steps_like_the_cpu_adamw(models):
    """Megatron's optimizer on CUDA and the CPU path's torch AdamW each take exactly AdamW's
    step from their own grads, and the two devices' grads agree. (Parameters are not compared
    across devices: a first Adam step moves each weight by about lr * sign(g), so a gradient
    element within rounding of zero may step either way on either device.)"""
    policy, _ = models
    gpu = launch.spawn(_one_adam_step, 1, policy)[0]
    with launch.hidden_gpus(True):
        cpu = launch.spawn(_one_adam_step, 1, policy)[0]
    assert gpu["megatron_optimizer"] and not cpu["megatron_optimizer"]
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-4)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-4)
    assert sorted(gpu["grads"]) == sorted(cpu["grads"]) == sorted(cpu["params"])
    for name, gr in cpu["grads"].items():
        assert float((gpu["grads"][name] - gr).norm()) <= 1e-4 * float(gr.norm()) + 1e-9, name
    for run in (gpu, cpu):
        ref = _adamw_first_step(run)
        for name, p in run["params"].items():
            assert torch.allclose(p, ref[name], rtol=0, atol=1e-6), name
    moved = [n for n, p in gpu["before"].items() if float((gpu["params"][n] - p).abs().max()) > 0]
    assert len(moved) == len(gpu["before"])  # every parameter took a step


# ------------------------------------------------------------------ RL, PRM, sync, checkpoints

def _rl_every_method(run_root, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    _full_fp32()
    out = {}
    for method in METHODS:
        tr = RLTrainer(_config(os.path.join(run_root, method), policy, prm, method,
                               ["trainer.steps=1"]), g, build_char_tokenizer())
        hist = tr.fit()
        out[method] = {"device": str(next(tr.actor.model.parameters()).device),
                       "engine": str(next(tr.engine.model.parameters()).device), **hist[0]}
    return out


def test_one_rl_step_of_every_method_on_one_gpu(models, tmp_path):
    policy, prm = models
    res = launch.spawn(_rl_every_method, 1, str(tmp_path), policy, prm)[0]
    for method, m in res.items():
        assert m["device"].startswith("cuda") and m["guard/skipped_total"] == 0, (method, m)
        assert m["rollout/logprob_diff_max"] <= 1e-4, (method, m)  # engine == trainer (fp32)
        assert all(v == v for k, v in m.items() if not isinstance(v, str)), method


def _sync_logits(policy):
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop
    from megaprm.trainer.rl.policy import fixed_micro_batches

    g = init_distributed()
    _full_fp32()
    cfg = _config("/tmp/megaprm-gpu-sync", policy, policy, "grpo", ["trainer.steps=0"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    with torch.no_grad():  # move the actor off its HF init so the sync has something to carry
        for p in tr.actor.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tr.sync_weights()
    ids = torch.randint(0, tr.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = pipeline.run(tr.actor.model, fixed_micro_batches(ids, torch.ones(2, 16), None, 2, 1),
                            groups=g, post=lambda mb, lg: (None, lg.float().cpu()),
                            forward_only=True)[0]
        theirs = tr.engine.model(ids.to(tr.engine.device)).logits.float().cpu()
    vocab = theirs.shape[-1]  # the actor's logits carry Megatron's padded vocab beyond it
    assert ours.shape[:-1] == theirs.shape[:-1] and ours.shape[-1] >= vocab
    return float((ours[..., :vocab] - theirs).abs().max())


def test_weight_sync_into_the_hf_engine_on_cuda(models):
    policy, _ = models
    assert launch.spawn(_sync_logits, 1, policy)[0] <= 1e-4


def _prm_score_and_train(policy, prm, out_dir):
    from transformers import AutoModelForTokenClassification

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.prm import build_prm
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from checkpoint_tools import model_source
    from megaprm.trainer.prm_training import PRMTrainConfig, train_prm

    g = init_distributed()
    _full_fp32()
    src = model_source.resolve(prm)
    spec = spec_from_hf(src.hf_dir)
    model = build_prm(spec, tp=1, pp=1, pp_rank=0, dtype=torch.float32)  # vs fp32 transformers
    model_source.load_weights(model, src, spec, g)
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = pipeline.run(model.eval(), [pipeline.TokenBatch(ids, torch.ones(2, 20))],
                            groups=g, post=lambda mb, out: (None, out.float().cpu()),
                            forward_only=True)[0]
        hf = AutoModelForTokenClassification.from_pretrained(prm).cuda().eval()
        ref = hf(ids.cuda()).logits.float().cpu()
    diff = float((ours.reshape(ref.shape) - ref).abs().max())
    # PRM training in CUDA's default dtype (auto: bf16)
    result = train_prm(PRMTrainConfig(model_dir=policy, output_dir=out_dir, num_train=64,
                                      num_eval=32, stage1_steps=1, stage2_steps=1,
                                      global_batch_size=8, micro_batch_size=4), g)
    return diff, result.eval.auroc


def test_prm_scores_equal_transformers_and_one_training_step_on_cuda(models, tmp_path):
    policy, prm = models
    diff, auroc = launch.spawn(_prm_score_and_train, 1, policy, prm, str(tmp_path / "prm"))[0]
    assert diff <= 1e-4
    assert 0.0 <= auroc <= 1.0


def _resume(run_dir, policy, prm, steps):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "rloo", [f"trainer.steps={steps}",
                                                  "trainer.save_every=1"])
    return RLTrainer(cfg, g, build_char_tokenizer()).fit()


def test_checkpoint_save_then_resume_on_cuda_gives_the_same_next_step(models, tmp_path):
    policy, prm = models
    ref = launch.spawn(_resume, 1, str(tmp_path / "ref"), policy, prm, 3)[0]
    launch.spawn(_resume, 1, str(tmp_path / "run"), policy, prm, 2)
    resumed = launch.spawn(_resume, 1, str(tmp_path / "run"), policy, prm, 3)[0]
    assert len(resumed) == 1
    for k, v in resumed[0].items():
        if not k.startswith(("timing/", "throughput/", "weight_sync/")):  # wall-clock
            assert v == pytest.approx(ref[2][k], rel=1e-4, abs=1e-6), k


def test_conversion_verify_and_eval_on_cuda(models, tmp_path):
    policy, _ = models
    ckpt = tmp_path / "ckpt"
    p = subprocess.run([sys.executable, "-m", "checkpoint_tools", "import-hf", "--hf", policy,
                        "--out", str(ckpt)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-m", "checkpoint_tools", "verify", "--hf", policy,
                        "--ckpt", str(ckpt)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and json.loads(p.stdout)["passed"], p.stdout + p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-m", "megaprm.cli", "eval", "--model", str(ckpt),
                        "--benchmarks", "math500", "--limit", "2", "--k", "1", "--max-tokens",
                        "8", "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]

"""The device rule, checked on a CPU-only machine: micro-batches built on the host are moved to
the model's device by the one crossing point (`pipeline.run`), results come back through
`to_host`, and no phase mixes devices. The model sits on the `meta` device (a second device
every CPU-only torch has, which raises on any mix with CPU tensors), so the real Megatron
forward and backward phases run end to end: actor log-probs and training, PRM scoring,
PRIME's sequence log-probs, PRM training's loss, and checkpoint conversion with an
accelerator present. Where the default depends on CUDA (dtype, TF32), `torch.cuda.is_available`
is patched."""
import pytest
import torch

from megaprm.parallel.device import comm_device, model_device, to_device, to_host
from megaprm.parallel.pipeline import TokenBatch


def test_to_device_moves_every_tensor_of_a_batch():
    mb = TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3),
                    {"adv": torch.zeros(2, 3), "meta": "keep"})
    moved = to_device(mb, torch.device("meta"))
    assert moved.input_ids.device.type == "meta" and moved.payload["adv"].device.type == "meta"
    assert moved.payload["meta"] == "keep" and mb.input_ids.device.type == "cpu"
    back = to_host({"x": [torch.zeros(1)], "n": 3})
    assert back["x"][0].device.type == "cpu" and back["n"] == 3
    assert comm_device("gloo").type == "cpu"


def _meta_phases(rank, world_size, hf_dir):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.rl.policy import fixed_micro_batches, logprob_post

    from megaprm.parallel import cpu

    g = init_distributed()
    spec = spec_from_hf(hf_dir)
    # "cuda" means meta from here on: megatron-core's own device="cuda" allocations and
    # current_device() land on the stand-in accelerator, as they land on the GPU there
    meta = torch.device("meta")
    cpu._CPU, torch.cuda.current_device = meta, lambda: meta
    model = build_stage(spec, g).to(meta)
    ids = torch.randint(0, spec.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 12)
    payload = {"adv": torch.randn(4, 11), "m": torch.ones(4, 11)}  # built on the host
    seen = {"model": model_device(model).type}
    # forward only (old / reference log-probs): host batches in, device log-probs out
    fwd = pipeline.run(model, fixed_micro_batches(ids, mask, None, 2, 1), groups=g,
                       post=logprob_post(spec, g, 0.7, with_entropy=True),
                       forward_only=True)
    seen["forward"] = {t.device.type for part in fwd for t in part}

    # training: a loss from the host-built payload, then the backward
    def post(mb, logits):
        lp, ent = logprob_post(spec, g, 0.7, with_entropy=True)(mb, logits)[1]
        seen.setdefault("payload", mb.payload["adv"].device.type)  # the crossed run's
        return -(lp * mb.payload["adv"] * mb.payload["m"]).sum() - 0.01 * ent.sum(), None

    pipeline.run(model, fixed_micro_batches(ids, mask, payload, 2, 1), groups=g, post=post,
                 forward_only=False)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    seen["grads"] = {gr.device.type for gr in grads}
    seen["n_grads"] = len(grads)
    # without the crossing (pipeline.run's to_device disabled) the host payload meets the
    # model's log-probs: a device mix, so the checks above could have failed
    crossing = pipeline.to_device
    pipeline.to_device = lambda obj, device: obj
    try:
        pipeline.run(model, fixed_micro_batches(ids, mask, payload, 2, 1), groups=g, post=post,
                     forward_only=False)
        seen["mix_raises"] = False
    except RuntimeError as e:
        seen["mix_raises"] = "device" in str(e).lower()
    finally:
        pipeline.to_device = crossing
    return seen


def test_phases_keep_the_device_rule_with_the_model_on_another_device(tmp_path):
    """The model on `meta` stands in for the GPU: every host tensor that meets it without the
    crossing raises a device mismatch. (FakeTensorMode's fake CUDA tensors were tried first:
    torch 2.13's CPU build aborts in c10 on the first fake-CUDA embedding lookup.)"""
    from megaprm.models.tiny import save_tiny_model
    from tests.distributed_utils import run_distributed

    hf = save_tiny_model("qwen2", str(tmp_path / "m"), vocab_size=96, hidden_size=32,
                         num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    seen = run_distributed(_meta_phases, 1, hf)[0]
    assert seen["model"] == "meta"
    assert seen["forward"] == {"meta"}
    assert seen["payload"] == "meta"
    assert seen["grads"] == {"meta"} and seen["n_grads"] > 0
    assert seen["mix_raises"], "a host tensor reached the model without an error"


@pytest.mark.gpu
def test_rank_device_is_the_local_gpu():
    from megaprm.parallel.device import rank_device

    if not torch.cuda.is_available():
        pytest.skip("no CUDA on this machine: the GPU tier did not run")
    assert rank_device() == torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------ PRM phases and conversion
# The stand-in extended to every phase that reads values: the model sits on `meta`, "cuda"
# means meta (megatron-core's CUDA allocations and `.cuda()` land there, as on the GPU), and
# the one crossing helper (`device._cross`) brings a meta tensor to the host as zeros of its
# shape and dtype. A host value read from a model-device tensor without the crossing raises.

def _stand_in():
    from megaprm.parallel import cpu, device

    meta = torch.device("meta")
    cpu._CPU, torch.cuda.current_device = meta, lambda: meta
    cross = device._cross

    def stand_in_cross(t, to):
        if t.device.type == "meta" and to.type == "cpu":
            return torch.zeros(t.shape, dtype=t.dtype)
        return cross(t, to)
    device._cross = stand_in_cross
    return meta


def _prm_phase(name, seen, fn):
    """Run one phase; record its result or the error it raised (each phase is one test)."""
    try:
        seen[name] = fn()
    except Exception:  # noqa: BLE001 - reported to the test that owns the phase
        import traceback

        seen[name] = traceback.format_exc(limit=-4)


def _meta_prm_and_conversion(rank, world_size, lm_dir, out_dir):
    import os

    from checkpoint_tools import convert
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.prm import as_prm_spec, build_prm
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed
    from megaprm.rewards import scoring
    from megaprm.trainer import prm_training as pt
    from megaprm.tasks.arithmetic import ArithmeticConfig

    g = init_distributed()
    meta = _stand_in()
    spec = spec_from_hf(lm_dir)
    prm_spec = as_prm_spec(spec, "token_cls")
    enc, _ = pt.encode_examples(pt.arithmetic_examples(ArithmeticConfig(), 4, 0),
                                pt.load_tokenizer(lm_dir), scoring.PRMInputFormat())
    seen = {}
    prm = build_prm(prm_spec, tp=1, pp=1, pp_rank=0).to(meta)
    lm = build_stage(spec, g).to(meta)

    def run_prm():  # failure 1: the head's step logits met the host step mask
        s = scoring.run_prm(prm, g, enc.batch, head="token_cls", micro_batch_size=2,
                            keep_logits=True)
        return {s.scores.device.type, s.logits.device.type, s.step_mask.device.type}

    def sequence_logprobs():
        lp = scoring.sequence_logprobs(lm, g, enc.batch, vocab_size=spec.vocab_size,
                                       micro_batch_size=2)
        return {lp.device.type}

    class NoStep:  # the trainer's optimiser is not what this checks
        def zero_grad(self):
            for p in prm.parameters():
                p.grad = None

        def step(self):
            return 0.0, True

    def prm_loss():  # failure 2: the LM term's zeros (host) stacked with the loss (device)
        out = pt.prm_train_step(prm, NoStep(), g, enc, torch.arange(4), micro_batch_size=2)
        grads = {p.grad.device.type for p in prm.parameters() if p.grad is not None}
        return {"values": [type(v).__name__ for v in out], "grads": grads}

    _prm_phase("run_prm", seen, run_prm)
    _prm_phase("sequence_logprobs", seen, sequence_logprobs)
    _prm_phase("prm_loss", seen, prm_loss)

    # from here torch sees an accelerator (the stand-in's): defaults follow it
    torch.cuda.is_available = lambda: True
    torch.cuda.set_device = lambda d: None

    def prm_training_dtype():  # train-prm's default dtype on CUDA: bf16, trunk and head
        model, _ = pt.build_trainable_prm(pt.PRMTrainConfig(model_dir=lm_dir), g)
        fp32, _ = pt.build_trainable_prm(pt.PRMTrainConfig(model_dir=lm_dir, dtype="fp32"), g)
        return ({str(p.dtype) for p in model.parameters()}, str(model.score.weight.dtype),
                {str(p.dtype) for p in fp32.parameters()})

    _prm_phase("prm_training_dtype", seen, prm_training_dtype)

    # failure 3: conversion on a node whose torch sees an accelerator; in-process as one
    # torchrun rank (RANK/WORLD_SIZE), so the stand-in applies to its rank half too
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

    def conversion():
        ck, hf = os.path.join(out_dir, "ckpt"), os.path.join(out_dir, "hf")
        imp = convert.import_hf(lm_dir, ck)
        exp = convert.export_hf(ck, hf)
        ver = convert.verify(lm_dir, ck)
        return [imp["verify"]["passed"], exp["verify"]["passed"], ver["passed"]]

    _prm_phase("conversion", seen, conversion)
    return seen


@pytest.fixture(scope="module")
def meta_prm_world(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from tests.distributed_utils import run_distributed

    root = tmp_path_factory.mktemp("meta_prm")
    tok = build_char_tokenizer()
    lm = save_tiny_model("qwen2", str(root / "lm"), tokenizer=tok, vocab_size=len(tok),
                         hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64)
    return run_distributed(_meta_prm_and_conversion, 1, lm, str(root))[0]


def test_prm_scoring_returns_host_scores_with_the_prm_on_another_device(meta_prm_world):
    """A failure seen on a GPU: `run_prm`'s step logits stayed on the model's device and met the
    host step mask in `head_step_scores`; `sequence_logprobs` returned device log-probs that
    meet host positions in `implicit_prm_rewards`."""
    assert meta_prm_world["run_prm"] == {"cpu"}, meta_prm_world["run_prm"]
    assert meta_prm_world["sequence_logprobs"] == {"cpu"}, meta_prm_world["sequence_logprobs"]


def test_prm_training_loss_with_the_prm_on_another_device(meta_prm_world):
    """Failure 2: with lm_loss_weight = 0 the LM term was a host zero stacked with the device
    loss. The step runs, its backward reaches the device's parameters, values come back host."""
    out = meta_prm_world["prm_loss"]
    assert isinstance(out, dict), out
    assert out["values"] == ["float", "float", "float"] and out["grads"] == {"meta"}


def test_conversion_runs_on_the_host_where_an_accelerator_is_present(meta_prm_world):
    """Failure 3: checkpoint_tools built its stages on the accelerator, then read their bytes
    with `.numpy()` and compared device logits with host ones. Conversion is host work: import,
    export and verify all run and agree with transformers with an accelerator present."""
    assert meta_prm_world["conversion"] == [True, True, True], meta_prm_world["conversion"]


def test_prm_training_defaults_to_bf16_where_cuda_is_present(meta_prm_world):
    """train-prm's PRM (trunk and head) is bf16 on CUDA; fp32 on request."""
    assert meta_prm_world["prm_training_dtype"] == (
        {"torch.bfloat16"}, "torch.bfloat16", {"torch.float32"}), meta_prm_world


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_the_cpu(monkeypatch, cuda):
    """model.dtype / PRMTrainConfig.dtype "auto" (the default) resolve where the run starts;
    explicit names stay as written; a bad one is a config error naming the field; TF32 is on
    exactly where CUDA is."""
    from megaprm.config import ModelConfig
    from megaprm.errors import ConfigError
    from megaprm.parallel import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    precision_calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precision_calls.append)
    assert ModelConfig().dtype == ("bf16" if cuda else "fp32")
    assert device.resolve_dtype("auto") == (torch.bfloat16 if cuda else torch.float32)
    assert ModelConfig(dtype="fp32").dtype == "fp32" and ModelConfig(dtype="bf16").dtype == "bf16"
    with pytest.raises(ConfigError, match="model.dtype='fp16'"):
        ModelConfig(dtype="fp16")
    device.configure_cuda_math()
    assert precision_calls == (["high"] if cuda else [])

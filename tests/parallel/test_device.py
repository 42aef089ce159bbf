"""The device rule, checked on a CPU-only machine: micro-batches built on the host are moved to
the model's device by the one crossing point (`pipeline.run`) and no phase mixes devices. The
model sits on the `meta` device (a second device every CPU-only torch has, which raises on any
mix with CPU tensors), so the real Megatron forward and backward phases run end to end."""
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
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer import loop

    from megaprm.parallel import cpu

    g = init_distributed()
    spec = spec_from_hf(hf_dir)
    # "cuda" means meta from here on: megatron-core's own device="cuda" allocations and
    # current_device() land on the stand-in accelerator, as they land on the GPU there
    meta = torch.device("meta")
    cpu._CPU, torch.cuda.current_device = meta, lambda: meta
    model = pipeline.build_stage(spec, g).to(meta)
    ids = torch.randint(0, spec.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 12)
    payload = {"adv": torch.randn(4, 11), "m": torch.ones(4, 11)}  # built on the host
    seen = {"model": model_device(model).type}
    # forward only (old / reference log-probs): host batches in, device log-probs out
    fwd = pipeline.run(model, loop._split(ids, mask, None, 2, 1), groups=g,
                       post=loop.logprob_post(spec, g, 0.7, with_entropy=True),
                       forward_only=True)
    seen["forward"] = {t.device.type for part in fwd for t in part}

    # training: a loss from the host-built payload, then the backward
    def post(mb, logits):
        lp, ent = loop.logprob_post(spec, g, 0.7, with_entropy=True)(mb, logits)[1]
        seen["payload"] = mb.payload["adv"].device.type
        return -(lp * mb.payload["adv"] * mb.payload["m"]).sum() - 0.01 * ent.sum(), None

    pipeline.run(model, loop._split(ids, mask, payload, 2, 1), groups=g, post=post,
                 forward_only=False)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    seen["grads"] = {gr.device.type for gr in grads}
    seen["n_grads"] = len(grads)
    # without the crossing (pipeline.run's to_device disabled) the host payload meets the
    # model's log-probs: a device mix, so the checks above could have failed
    crossing = pipeline.to_device
    pipeline.to_device = lambda obj, device: obj
    try:
        pipeline.run(model, loop._split(ids, mask, payload, 2, 1), groups=g, post=post,
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

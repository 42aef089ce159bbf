"""The planner's parameter counts of mixture-of-experts models: Qwen3-30B-A3B's published
total and activated counts, the meta-device count against the closed form at tp / pp / ep
layouts, and the count of a stage megaprm really builds at ep2 (2 gloo ranks)."""
import dataclasses
import math

import pytest

from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.tiny import tiny_config
from megaprm.parallel import launch
from megaprm.planner.models import hf_config_for
from megaprm.planner.params import active_params, closed_form_params, rank_params, stage_params


def _qwen3_30b():
    return spec_from_hf(hf_config_for("Qwen3-30B-A3B", "model").config)


def test_qwen3_30b_a3b_has_its_published_counts():
    # Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated, 29.9B non-embedding; the
    # card cuts to one decimal (the activated count is 3.35B: embeddings, attention, routers and
    # 8 of 128 experts per layer)
    spec = _qwen3_30b()
    p = stage_params(spec, 1, 1)
    assert p.total == 30_532_122_624 and math.floor(p.total / 1e8) / 10 == 30.5
    assert p.active == active_params(spec) == 3_353_032_704
    assert math.floor(p.active / 1e8) / 10 == 3.3
    embeddings = 2 * spec.vocab_size * spec.hidden_size  # untied: embedding + LM head
    assert math.floor((p.total - embeddings) / 1e8) / 10 == 29.9
    # 48 layers x 128 experts x 3 x 2048 x 768 of the total are experts
    assert p.expert_per_rank == 48 * 128 * 3 * 2048 * 768


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 8), (2, 2, 4)])
def test_meta_count_equals_the_closed_form_at_ep(tp, pp, ep):
    for spec in (_qwen3_30b(), spec_from_hf(tiny_config("qwen2_moe"))):
        if spec.num_experts % ep:
            continue
        for r in range(pp):
            assert rank_params(spec, tp, pp, r, ep=ep) == closed_form_params(spec, tp, pp, r, ep)
    p = stage_params(_qwen3_30b(), tp, pp, ep=ep)
    assert p.expert_per_rank == 48 // pp * (128 // ep) * 3 * 2048 * 768 // tp


def _built_count(family):
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed

    g = init_distributed(ep=2)
    model = build_stage(spec_from_hf(tiny_config(family)), g)
    return sum(p.numel() for p in model.parameters())


def test_counts_equal_a_stage_built_at_ep2():
    for family in ("qwen2_moe", "qwen3_moe"):
        spec = spec_from_hf(tiny_config(family))
        got = launch.spawn(_built_count, 2, family)
        assert got == [rank_params(spec, 1, 1, 0, ep=2)] * 2
        assert got[0] < rank_params(spec, 1, 1, 0)  # half the experts


def test_plan_of_qwen3_30b_a3b_at_ep8(capsys):
    """`megaprm plan` of an MoE actor: its total and active counts, the experts each GPU holds
    at parallel.ep and the all-to-all bytes (the formula of planner/experts.py by hand)."""
    from megaprm.cli import main
    from megaprm.config import load_config
    from megaprm.planner import experts
    from megaprm.planner.plan import workload_of

    argv = ["configs/grpo.yaml", "--gpus", "16", "model.path=Qwen3-30B-A3B", "parallel.ep=8",
            "parallel.tp=2"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "actor             30.532 B" in out
    experts_per_gpu = 48 * (128 // 8) * 3 * 2048 * 768 // 2
    assert (f"3.35 B of 30.53 B parameters active per token; experts "
            f"{experts_per_gpu / 1e9:.2f} B parameters ({2 * experts_per_gpu / 1e9:.1f} GB) per "
            f"GPU at parallel.ep=8") in out
    cfg = load_config("configs/grpo.yaml", argv[3:])
    w, _ = workload_of(cfg, {}, 16)
    tokens = w.samples * (w.mean_prompt + w.mean_response) / w.dp
    passes = 2 + (not w.rollout_logprobs) + w.needs_ref
    assert experts.alltoall_bytes(w) == pytest.approx(
        tokens * 8 * 2048 * 2 * 2 * 7 / 8 * 48 * passes)
    assert experts.alltoall_bytes(dataclasses.replace(w, ep=1)) == 0


@pytest.mark.parametrize("argv,needle", [
    (["model.path=Qwen3-30B-A3B", "parallel.ep=32"], "parallel.ep=32: tp*ep = 1*32 = 32 does "
                                                     "not divide the 16 ranks"),
    (["parallel.ep=2"], "ep=2 (parallel.ep / --ep) needs a mixture-of-experts model"),
])
def test_plan_ep_mistakes_are_one_line(capsys, argv, needle):
    from megaprm.cli import main

    assert main(["plan", "configs/grpo.yaml", "--gpus", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_moe_phases_count_the_active_parameters():
    """An MoE actor's update and log-prob FLOPs are those of its active parameters (top-k
    experts per token), not of every expert: the phase seconds by hand from the formula of
    planner/timing.py with active = 3.35 B (all 30.5 B would make them 7.5x longer here)."""
    from megaprm.config import load_config
    from megaprm.planner.hardware import DEFAULT_EFFICIENCY as eff
    from megaprm.planner.hardware import GPUS
    from megaprm.planner.plan import _layout_params, workload_of
    from megaprm.planner.timing import _attn_flops_per_token, phase_seconds

    cfg = load_config("configs/grpo.yaml", ["model.path=Qwen3-30B-A3B", "parallel.ep=8",
                                            "parallel.tp=2"])
    w, _ = workload_of(cfg, {}, 16)
    p = _layout_params(w, exact=False)
    spec = _qwen3_30b()
    assert p.actor_active == active_params(spec) < p.actor_total / 9
    gpu = GPUS["h100"]
    seq = w.mean_prompt + w.mean_response
    fwd_tok = 2 * active_params(spec) + _attn_flops_per_token(w, seq)
    micro = max(1, math.ceil(w.samples / w.dp / w.mini_batches / max(1, w.micro_batch_size)))
    bubble = 1 + (w.pp - 1) / micro
    update = 3 * fwd_tok * w.samples * seq * (4 / 3 if w.recompute else 1)
    want = update * bubble / (w.trainer_world * gpu.bf16_tflops * 1e12 * eff.train_mfu)
    got = phase_seconds(w, p, gpu, eff)
    assert got["update"] == pytest.approx(want, rel=1e-12)
    dense = phase_seconds(w, dataclasses.replace(p, actor_active=0), gpu, eff)
    assert dense["update"] > 7 * got["update"] and dense["log-probs"] > 7 * got["log-probs"]

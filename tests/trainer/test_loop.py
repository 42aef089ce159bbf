"""The RL loop end to end on CPU: every estimator under dp=2 and tp=2, NaN guard, and
kill-during-save + resume reproducing the uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megaprm.algorithms.registry import METHODS
from megaprm.config import load_config
from megaprm.errors import ConfigError
from megaprm.parallel import launch
from tests.rl_setup import DEMO_YAML, rl_config

PER_RANK = ("timing/", "throughput/", "weight_sync/")  # wall-clock: differs between runs
LOOP = ["rollout.max_tokens=20", "actor.micro_batch_size=4"]


def _config(run_dir, policy, prm, method, extra=()):
    return rl_config(run_dir, policy, prm, method, [*LOOP, *extra])


def _run_methods(run_root, policy, prm, tp, steps):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed(tp=tp)
    out = {}
    for method in METHODS:
        cfg = _config(os.path.join(run_root, f"{method}-tp{tp}"), policy, prm, method,
                      [f"trainer.steps={steps}", "trainer.save_every=0"])
        history = RLTrainer(cfg, g, build_char_tokenizer()).fit()
        out[method] = history
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_every_method_runs_on_two_ranks(tiny_models, tmp_path, tp):
    policy, prm = tiny_models
    results = launch.spawn(_run_methods, 2, str(tmp_path), policy, prm, tp, 2)
    for method in METHODS:
        for rank_hist in results:
            hist = rank_hist[method]
            assert len(hist) == 2
            for m in hist:
                assert m["guard/skipped_total"] == 0, (method, m)
                assert all(v == v for v in m.values()), (method, m)  # no NaN
                assert 0.0 <= m["reward/outcome_mean"] <= 1.0
                assert m["timing/update_s"] > 0 and m["timing/rollout_s"] > 0
        # both ranks see the same (dp-reduced) training metrics; timings are per rank
        same = [{k: v for k, v in r[method][-1].items() if not k.startswith(PER_RANK)}
                for r in results]
        assert same[0] == pytest.approx(same[1])
        jsonl = os.path.join(tmp_path, f"{method}-tp{tp}", "metrics.jsonl")
        rows = [json.loads(x) for x in open(jsonl).read().splitlines()]
        assert len(rows) == 2
        # every step logs the weight sync that followed its update: the same bytes each time
        assert rows[0]["weight_sync/gbytes"] == rows[1]["weight_sync/gbytes"] > 0
        assert all(r["weight_sync/seconds"] > 0 and r["weight_sync/gbps"] > 0 for r in rows)
        if method in ("pure", "prof_grpo", "papo", "blend"):
            assert "prm/outcome_agreement" in results[0][method][0]
        if method == "prime":
            assert "prm/loss" in results[0][method][0]


def _resume_work(run_dir, policy, prm, crash_at):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    if crash_at is not None:
        os.environ["MEGAPRM_CRASH_DURING_SAVE_AT"] = str(crash_at)
    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "rloo", ["trainer.steps=4", "trainer.save_every=2"])
    return RLTrainer(cfg, g, build_char_tokenizer()).fit()


def test_kill_during_save_then_resume_reproduces(tiny_models, tmp_path):
    policy, prm = tiny_models
    ref = launch.spawn(_resume_work, 2, str(tmp_path / "ref"), policy, prm, None)[0]
    run = str(tmp_path / "crashy")
    with pytest.raises(launch.RankFailed):  # killed while writing the step-3 checkpoint
        launch.spawn(_resume_work, 2, run, policy, prm, 3)
    ckpts = os.path.join(run, "checkpoints")
    assert open(os.path.join(ckpts, "latest")).read() == "step_000001"
    assert os.path.isdir(os.path.join(ckpts, "step_000003.tmp"))  # the torn one, not named
    resumed = launch.spawn(_resume_work, 2, run, policy, prm, None)[0]
    assert len(resumed) == 2  # steps 2 and 3 only
    for a, b in zip(resumed, ref[2:]):
        for k in a:
            if not k.startswith(PER_RANK):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert not os.path.exists(os.path.join(ckpts, "step_000003.tmp"))


def _nan_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=2"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    before = [p.detach().clone() for p in tr.actor.model.parameters()]
    real = tr.outcome_reward

    def poisoned(*a):
        sb = real(*a)
        sb.outcome[0] = float("nan")
        if not torch.isfinite(sb.outcome).all():
            raise FloatingPointError("verifier returned non-finite rewards")
        return sb
    tr.outcome_reward = poisoned
    hist = tr.fit()
    after = list(tr.actor.model.parameters())
    return hist, all(torch.equal(a, b) for a, b in zip(after, before))


def test_nan_reward_step_is_skipped_not_applied(tiny_models, tmp_path):
    policy, prm = tiny_models
    hist, unchanged = launch.spawn(_nan_work, 1, str(tmp_path), policy, prm)[0]
    assert [h["guard/skipped_total"] for h in hist] == [1.0, 2.0]
    assert unchanged


def test_bad_config_is_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.n=1 is not valid"):
        load_config(DEMO_YAML, ["rollout.n=1"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['actor.lrr'\]"):
        load_config(DEMO_YAML, ["actor.lrr=1"])
    with pytest.raises(ConfigError, match=r"advantage.method='prime' needs prm.kind=implicit"):
        load_config(DEMO_YAML, ["advantage.method=prime"])
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    cli = [sys.executable, "-m", "megaprm.cli", "train", "--config", DEMO_YAML,
           "advantage.method=nope"]
    p = subprocess.run(cli, capture_output=True, text=True)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "advantage.method='nope' is not valid" in err[0], p.stderr


# ------------------------------------------------------------------ the sampling distribution

def _temperature_work(run_dir, policy, prm, temperature):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop
    from megaprm.trainer.rl.policy import targets_to_response

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=1",
                                                 f"rollout.temperature={temperature}"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    batch, _, _ = tr.rollout(0)
    rp = batch.to_right_padded(tr.pad)
    old = targets_to_response(tr.actor.logprobs(rp.input_ids), rp,
                                   batch.response_ids.shape[1])
    m = batch.response_mask.bool()
    diff = float((old - batch.sampler_logprobs)[m].abs().max())
    at_t1 = float((targets_to_response(
        _with_temperature(tr.actor, 1.0).logprobs(rp.input_ids), rp,
        batch.response_ids.shape[1]) - batch.sampler_logprobs)[m].abs().max())
    tr.engine.wake()
    hist = tr.fit()
    return diff, float(batch.sampler_logprobs[m].mean()), at_t1, hist[0]


def _with_temperature(policy, t):
    import copy

    p = copy.copy(policy)
    p.temperature = t
    return p


@pytest.mark.parametrize("temperature", [0.5, 0.7])
def test_trainer_logprobs_are_the_samplers_at_the_rollout_temperature(tiny_models, tmp_path,
                                                                       temperature):
    """The engine samples at T; the trainer's old log-probs of the same tokens equal the
    sampler's (fp32, <= 1e-5) and the first mini-batch's PPO ratio is 1. At T = 1 they differ
    (the bug this guards against: log pi_1 trained on tokens drawn from pi_T)."""
    policy, prm = tiny_models
    diff, sampler_mean, t1_diff, metrics = launch.spawn(
        _temperature_work, 1, str(tmp_path), policy, prm, temperature)[0]
    assert diff <= 1e-5
    assert t1_diff > 100 * max(diff, 1e-6), t1_diff  # a near-uniform tiny model still tells
    assert metrics["actor/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["rollout/logprob_diff_max"] <= 1e-5
    assert metrics["actor/entropy_token_mean"] > 0


def _logprob_temperature_work(run_dir, policy, prm):
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop
    from megaprm.trainer.rl.policy import fixed_micro_batches, logprob_post, response_to_targets

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=1", "rollout.temperature=0.5",
                                                 "actor.logprob_temperature=1.0",
                                                 "actor.mini_batches=1"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    batch, _, _ = tr.rollout(0)  # the batch fit's step 0 draws again (same block, same seed)
    rp = batch.to_right_padded(tr.pad)
    mask = rp.loss_mask[:, :-1].bool()
    # the reference: one plain forward of the whole batch, log-probs and entropy at T = 1/0.5
    refs = {}
    for t in (1.0, 0.5):
        with torch.no_grad():
            mbs = fixed_micro_batches(rp.input_ids, mask.float(), None, 10_000, 1)
            refs[t] = pipeline.run(tr.actor.model, mbs,
                                   groups=g, post=logprob_post(tr.spec, g, t, True),
                                   forward_only=True)[0]
    sampler = response_to_targets(batch.sampler_logprobs, rp)
    lp1, lp_half = tr.actor.logprobs(rp.input_ids, also_at=0.5)
    out = {"old_vs_t1": float((lp1 - refs[1.0][0])[mask].abs().max()),
           "half_vs_sampler": float((lp_half - sampler)[mask].abs().max()),
           "t1_vs_sampler": float((lp1 - sampler)[mask].abs().max()),
           "entropy_t1": float(refs[1.0][1][mask].mean()),
           "entropy_half": float(refs[0.5][1][mask].mean())}
    tr.engine.wake()
    return out, tr.fit()[0]


def test_pure_logprobs_at_t1_while_sampling_at_half(tiny_models, tmp_path):
    """actor.logprob_temperature=1 with rollout.temperature=0.5 (PURE's release): the update's
    log-probs and entropy are the T = 1 ones of a plain forward, the guard still compares with
    the sampler at 0.5 (and passes), and the metrics name both temperatures."""
    policy, prm = tiny_models
    ref, metrics = launch.spawn(_logprob_temperature_work, 1, str(tmp_path), policy, prm)[0]
    assert ref["old_vs_t1"] <= 1e-6
    assert ref["half_vs_sampler"] <= 1e-5
    assert ref["t1_vs_sampler"] > 1e-2  # the two distributions do differ on this model
    assert metrics["rollout/sampling_temperature"] == 0.5
    assert metrics["rollout/logprob_temperature"] == 1.0
    assert metrics["rollout/logprob_diff_max"] <= 1e-5
    assert metrics["actor/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/entropy_token_mean"] == pytest.approx(ref["entropy_t1"], rel=1e-4)
    assert abs(ref["entropy_t1"] - ref["entropy_half"]) > 1e-2


def test_logprob_temperature_is_checked():
    with pytest.raises(ConfigError, match="actor.logprob_temperature"):
        load_config(DEMO_YAML, ["actor.logprob_temperature=0"])
    with pytest.raises(ConfigError, match="actor.logprob_temperature"):
        load_config(DEMO_YAML, ["actor.logprob_temperature=sampler"])
    pure = load_config(os.path.join(os.path.dirname(DEMO_YAML), "..", "..", "configs",
                                    "pure.yaml"))
    assert (pure.rollout.temperature, pure.actor.logprob_temperature) == (0.5, 1.0)


# ------------------------------------------------------------------ metrics are global means

def _metrics_work(run_dir, policy, prm, micro_batch_size, packed=False):
    import torch.distributed as dist

    from megaprm.algorithms.losses import actor_loss
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop
    from megaprm.trainer.rl.policy import fixed_micro_batches, logprob_post

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=1", "actor.entropy_coef=0.01",
                                                 "rollout.temperature=0.8", "actor.mini_batches=1",
                                                 f"actor.micro_batch_size={micro_batch_size}",
                                                 *(["actor.max_tokens_per_micro_batch=96"]
                                                   if packed else [])])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    batch, _, _ = tr.rollout(0)
    rp = batch.to_right_padded(tr.pad)
    gen = torch.Generator().manual_seed(7 + g.rank)
    mask = rp.loss_mask[:, :-1]
    adv = torch.randn(mask.shape, generator=gen)
    # the reference: this rank's full-batch log-probs and entropy in one forward at T
    post = logprob_post(tr.spec, g, tr.temperature, with_entropy=True)
    with torch.no_grad():
        mbs = fixed_micro_batches(rp.input_ids, mask, None, 10_000, 1)
        lp, ent = pipeline.run(tr.actor.model, mbs, groups=g, post=post, forward_only=True)[0]
    old = lp + 0.3 * torch.randn(lp.shape, generator=gen)  # a stale policy: ratios != 1
    metrics = tr.update_actor(rp, adv, old, None, torch.ones(rp.input_ids.shape[0])).metrics
    sel = mask.bool()
    mine = torch.stack([lp[sel], old[sel], adv[sel], ent[sel]])
    parts = [None] * g.world_size
    dist.all_gather_object(parts, mine) if g.world_size > 1 else parts.__setitem__(0, mine)
    lp_a, old_a, adv_a, ent_a = torch.cat(parts, dim=1)[:, None]
    loss, ref = actor_loss(lp_a, old_a, adv_a, torch.ones_like(lp_a), eps_low=cfg.actor.eps_low,
                           eps_high=cfg.actor.eps_high, dual_clip_c=cfg.actor.dual_clip_c,
                           agg="token-mean",
                           entropy=ent_a, entropy_coef=0.01)
    ref["actor/entropy_token_mean"] = float(ent_a.mean())
    ref["actor/loss"] = float(loss)
    return metrics, ref


@pytest.mark.parametrize("world,mbs,packed", [(1, 10_000, False), (1, 3, False),
                                              (2, 10_000, False), (2, 3, False), (1, 3, True)],
                         ids=["1rank-1mb", "1rank-3mb", "2ranks-1mb", "2ranks-3mb",
                              "1rank-packed"])
def test_update_metrics_equal_a_single_batch_reference(tiny_models, tmp_path, world, mbs, packed):
    """Logged actor metrics are global token means over all micro-batches and ranks (maxima as
    maxima), equal to one actor_loss call on the whole gathered batch; with sequences packed
    into token-budget rows the update computes the same losses."""
    policy, prm = tiny_models
    for metrics, ref in launch.spawn(_metrics_work, world, str(tmp_path), policy, prm, mbs,
                                     packed):
        for k in ("actor/pg_loss", "actor/clip_frac", "actor/ratio_mean", "actor/ratio_max",
                  "actor/approx_kl", "actor/entropy", "actor/entropy_token_mean", "actor/loss"):
            assert metrics[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), k
        if mbs == 3:
            assert metrics["actor/updates"] == 1.0


# ------------------------------------------------------------------ all or nothing

def _rollback_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import actor_update, loop

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=2", "actor.mini_batches=2"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    real = actor_update.update_minibatch
    calls = {"n": 0}

    def poisoned(actor, acfg, norm_len, ids, m, adv, old, ref, **kw):
        # the second mini-batch of the first step goes NaN
        calls["n"] += 1
        if calls["n"] == 1:  # a real update (a random policy earns no reward of its own)
            adv = torch.randn(adv.shape, generator=torch.Generator().manual_seed(0))
        if calls["n"] == 2:  # as from NaN logits: the ratio, the loss and the grads go NaN
            old = torch.full_like(old, float("nan"))
        return real(actor, acfg, norm_len, ids, m, adv, old, ref, **kw)
    actor_update.update_minibatch = poisoned  # this spawned rank's module only
    before = [p.detach().clone() for p in tr.actor.model.parameters()]
    opt_before = len(tr.actor.opt.impl.state)
    first = tr.step_or_skip(0)
    opt_after = len(tr.actor.opt.impl.state)
    after = [p.detach().clone() for p in tr.actor.model.parameters()]
    engine = dict(tr.engine.model.named_parameters())
    actor_hf = {k: v.clone() for b in weight_sync.iter_hf_buckets(tr.actor.model, g)
                for k, v in b}
    engine_equal = all(torch.equal(engine[k].detach().cpu(), v) for k, v in actor_hf.items()
                       if k in engine)
    second = tr.step_or_skip(1)
    return (calls["n"], first, all(torch.equal(a, b) for a, b in zip(before, after)),
            opt_before, opt_after, engine_equal, second)


def test_nan_in_second_minibatch_leaves_parameters_and_engine_untouched(tiny_models, tmp_path):
    policy, prm = tiny_models
    (calls, first, unchanged, opt_before, opt_after, engine_equal,
     second) = launch.spawn(_rollback_work, 1, str(tmp_path), policy, prm)[0]
    assert calls >= 2 and first["guard/skipped"] == 1.0
    assert unchanged, "mini-batch 1's update survived a NaN in mini-batch 2"
    assert opt_before == opt_after == 0, "optimiser state of the rolled-back step survived"
    assert engine_equal
    # the next step trains normally (both mini-batches step; a random tiny policy earns no
    # reward, so its advantages and hence its update are zero)
    assert "guard/skipped" not in second and second["actor/updates"] == 2.0


# ------------------------------------------------------------------ faults agreed on by all ranks

def _one_rank_nan_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    os.environ["MEGAPRM_FAULT"] = "outcome:1:0"  # NaN reward on rank 1 at step 0 only
    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=2"])
    return RLTrainer(cfg, g, build_char_tokenizer()).fit()


def test_nan_reward_on_one_rank_is_skipped_by_both(tiny_models, tmp_path):
    policy, prm = tiny_models
    results = launch.spawn(_one_rank_nan_work, 2, str(tmp_path), policy, prm, timeout_s=300)
    for hist in results:
        assert hist[0].get("guard/skipped") == 1.0
        assert "guard/skipped" not in hist[1] and hist[1]["guard/skipped_total"] == 1.0


def _ratio_guard_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop

    g = init_distributed()
    # a threshold below 1 makes every micro-batch "exceed" it: PURE's guard then zeroes them all
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=1", "actor.skip_ratio_above=0.5",
                                                 "actor.mini_batches=1",
                                                 "actor.micro_batch_size=4"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    batch, _, _ = tr.rollout(0)
    rp = batch.to_right_padded(tr.pad)
    old = tr.actor.logprobs(rp.input_ids)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in tr.actor.model.parameters()]
    m = tr.update_actor(rp, adv, old, None, torch.ones(rp.input_ids.shape[0])).metrics
    unchanged = all(torch.equal(a, p) for a, p in zip(before, tr.actor.model.parameters()))
    return m["actor/ratio_skipped_microbatches"], unchanged


def test_pure_ratio_guard_zeroes_the_update(tiny_models, tmp_path):
    """PURE's released guard: a micro-batch whose mean ratio exceeds the threshold moves
    nothing (random advantages would otherwise move every weight)."""
    policy, prm = tiny_models
    skipped, unchanged = launch.spawn(_ratio_guard_work, 1, str(tmp_path), policy, prm)[0]
    assert skipped >= 2 and unchanged


def test_shuffled_mini_batches_permute_every_update_input_alike():
    """actor.shuffle_mini_batches (PRIME's dataloader shuffle): one permutation per (seed, step,
    dp rank), applied to every row-aligned input of the update."""
    from megaprm.rollout.engine import RightPadded
    from megaprm.trainer.rl.actor_update import mini_batch_order, permute_rows

    order = mini_batch_order(12, 1234, 3, 0)
    assert sorted(order.tolist()) == list(range(12))
    assert torch.equal(order, mini_batch_order(12, 1234, 3, 0))
    assert not torch.equal(order, mini_batch_order(12, 1234, 4, 0))
    assert not torch.equal(order, mini_batch_order(12, 1234, 3, 1))
    rows = torch.arange(12)
    rp = RightPadded(rows[:, None].expand(12, 5), rows[:, None] * 2, rows[:, None] * 3, rows)
    out = permute_rows((rp, rows[:, None] * 4.0, rows[:, None] * 5.0, None, rows > 5), order)
    for k, x in enumerate(out[0]):
        first = x[:, 0] if x.dim() == 2 else x
        assert torch.equal(first, order * (1, 2, 3, 1)[k])
    assert torch.equal(out[1][:, 0], order * 4.0) and out[3] is None
    assert torch.equal(out[4], order > 5)


# ------------------------------------------------------------------ PRIME's PRM loop as released

def _prime_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import implicit_prm, loop

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "prime", ["trainer.steps=1", "prm.mini_batches=2",
                                                  "prm.optim.lr=1e-2"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    real_outcome = tr.outcome_reward

    def mixed(batch, truths, group_ids, step):  # group 0 all correct (filtered), others half right
        sb = real_outcome(batch, truths, group_ids, step)
        first = sb.group_ids == sb.group_ids.min()
        sb.outcome = torch.where(first, torch.ones_like(sb.outcome),
                                 (torch.arange(len(sb.outcome)) % 2).float())
        return sb
    tr.outcome_reward = mixed
    seen = {"params_at_call": [], "rows": []}
    real_mb = implicit_prm.prm_minibatch

    def recording(implicit, beta, rp, idx, *a):
        seen["params_at_call"].append([p.detach().clone() for p in tr.prm.policy.model.parameters()])
        seen["rows"].append(idx.tolist())
        return real_mb(implicit, beta, rp, idx, *a)
    implicit_prm.prm_minibatch = recording  # this spawned rank's module only
    captured = {}
    real_adv = tr.advantages

    def keep_q(sb, *a):
        captured["q"], captured["group_ids"] = sb.q.clone(), sb.group_ids.clone()
        captured["mask"] = sb.rollout.response_mask.clone()
        return real_adv(sb, *a)
    tr.advantages = keep_q
    hist = tr.fit()
    p0, p1 = seen["params_at_call"]
    moved = any(not torch.equal(a, b) for a, b in zip(p0, p1))
    captured["after_fit"] = _after_fit(tr, g, run_dir)
    return hist[0], seen["rows"], moved, captured


def _after_fit(tr, g, run_dir) -> dict:
    """The public API experiments use after `fit`: the exported implicit PRM (its HF weights
    against the trained PRM's and the actor's) and fn(engine) on the rollout engine."""
    from safetensors.torch import load_file

    from megaprm.rollout.weight_sync import iter_hf_weights

    out = tr.export_implicit_prm(os.path.join(run_dir, "implicit_prm"))
    got = load_file(os.path.join(out, "model.safetensors"))

    def same(model):
        want = dict(iter_hf_weights(model, g))
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return {"prm": same(tr.prm.policy.model), "actor": same(tr.actor.model),
            "config": os.path.isfile(os.path.join(out, "config.json")),
            "engine": tr.evaluate_with_engine(lambda engine: engine is tr.engine)}


def test_prime_prm_trains_on_the_filtered_batch_in_minibatches_scored_inside(tiny_models, tmp_path):
    """Released PRIME (update=after): prm.mini_batches optimiser steps per iteration over the
    accuracy-filtered rollouts only; mini-batch 2 is scored by the PRM after step 1; filtered
    groups are never trained on and carry q = 0."""
    policy, prm = tiny_models
    m, rows, moved, cap = launch.spawn(_prime_work, 1, str(tmp_path), policy, prm)[0]
    assert m["prm/updates"] == 2.0 and len(rows) == 2
    first = cap["group_ids"] == cap["group_ids"].min()
    trained = sorted(rows[0] + rows[1])
    assert trained == (~first).nonzero()[:, 0].tolist()  # every kept row once, no filtered row
    assert m["prm/trained_rows"] == len(trained)
    assert moved, "mini-batch 2 was scored by the PRM before its first step"
    assert torch.all(cap["q"][first] == 0)
    assert torch.any(cap["q"][~first] * cap["mask"][~first] != 0)
    # after fit: the exported implicit PRM is the trained PRM (not the actor), with its side
    # files; evaluate_with_engine hands fn the rollout engine
    assert cap["after_fit"] == {"prm": True, "actor": False, "config": True, "engine": True}


# ------------------------------------------------------------------ metrics.jsonl after kills

def _killable_run(run_dir, policy, prm, kill_at, crash_at):
    os.environ["MEGAPRM_KILL_AT"] = kill_at
    os.environ["MEGAPRM_CRASH_DURING_SAVE_AT"] = str(crash_at)
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=4", "trainer.save_every=1",
                                                 "rollout.max_tokens=8"])
    return len(RLTrainer(cfg, g, build_char_tokenizer()).fit())


@pytest.mark.slow  # kill-and-resume trials (pytest.ini's `slow`)
def test_metrics_hold_each_step_once_after_kills_at_random_points(tiny_models, tmp_path):
    """6 seeded trials, each kill point at two steps drawn at random: SIGKILL after a step is
    logged, inside a save (after the model files), or right after a save (its row then torn,
    as a full disk leaves it); the restart resumes and metrics.jsonl holds steps 0..3 exactly
    once, a torn row of a saved step restored from its checkpoint (it was lost: [0, 1, 3])."""
    import random

    policy, prm = tiny_models
    rng = random.Random(1234)
    trials = [(step, where) for where in ("after_log", "mid_save", "after_save")
              for step in rng.sample(range(4), 2)]
    for trial, (step, where) in enumerate(trials):
        run_dir = str(tmp_path / f"t{trial}")
        kill_at = f"{step}:{where}" if where != "mid_save" else ""
        crash = step if where == "mid_save" else -1
        with pytest.raises(launch.RankFailed):
            launch.spawn(_killable_run, 1, run_dir, policy, prm, kill_at, crash)
        path = os.path.join(run_dir, "metrics.jsonl")
        if where == "after_save":  # and the saved step's row torn (a full disk): restored
            saved = json.loads(open(path).readlines()[-1])
            with open(path, "r+") as f:
                f.truncate(os.path.getsize(path) - 9)
        launch.spawn(_killable_run, 1, run_dir, policy, prm, "", -1)
        rows = [json.loads(x) for x in open(path)]
        assert [r["step"] for r in rows] == [0, 1, 2, 3], (trial, step, where, rows)
        if where == "after_save":
            assert rows[step] == saved, (trial, step)


# ------------------------------------------------------------------ the oracle process reward

def test_oracle_step_scores_are_the_exact_checkers_labels():
    """prm.kind=oracle: step k scores 1/0 as check_steps marks it, on the token segmentation's
    steps; a wrong_result corruption has exactly one 0, a reference solution none."""
    import random

    from megaprm.rewards.steps import segment_steps, separator_token_ids
    from megaprm.tasks.arithmetic import (ArithmeticConfig, check_steps, corrupt_solution,
                                          generate_problems, reference_solution)
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.reward_phase import oracle_step_scores

    tok = build_char_tokenizer()
    probs = generate_problems(ArithmeticConfig(), 24, seed=5)
    rng = random.Random(0)
    texts = [reference_solution(p) if i % 2 else corrupt_solution(p, rng, "wrong_result")
             for i, p in enumerate(probs)]
    rows = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    R = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (R - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in rows])
    seg = segment_steps(ids, mask, separator_token_ids(tok))
    checks = [check_steps(p, t) for p, t in zip(probs, texts)]
    scores, smask = oracle_step_scores(checks, seg.step_mask)
    for i, c in enumerate(checks):
        n = int(smask[i].sum())
        assert n == len(c.step_correct), i  # the checker's steps are the segmentation's
        assert scores[i, :n].tolist() == [float(x) for x in c.step_correct]
        assert (scores[i, :n] == 0).sum() == (0 if i % 2 else 1)


def _oracle_rl_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "prof_grpo", ["trainer.steps=1", "prm.kind=oracle"])
    tr = RLTrainer(cfg, g, build_char_tokenizer())
    m = tr.fit()[0]
    try:
        tr.export_implicit_prm(os.path.join(run_dir, "implicit_prm"))
    except ValueError as e:  # no implicit PRM to export: said so
        assert "prm.kind='oracle'" in str(e), e
    else:
        raise AssertionError("export_implicit_prm exported a PRM an oracle run does not have")
    return tr.prm is None, m


def test_prof_grpo_runs_on_the_oracle_prm(tiny_models, tmp_path):
    policy, prm = tiny_models
    no_model, m = launch.spawn(_oracle_rl_work, 1, str(tmp_path), policy, prm)[0]
    assert no_model and m["guard/skipped_total"] == 0 and "prm/outcome_agreement" in m


# ------------------------------------------------------------------ old-log-prob forward skipped

def _reuse_work(run_dir, policy, prm):
    """Three trainers from the same weights take step 0 on the same samples: the default (one
    mini-batch on-policy: the old-log-prob forward skipped), the same with the forward forced
    (the reference path), and two mini-batches (the forward needed). Returns per trainer the
    actor forwards outside the update, the step's metrics and the grads it applied."""
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import logprob_phase, loop

    g = init_distributed()
    real = logprob_phase.reuses_new_logprobs
    out = {}
    for name, extra, forced in (("skip", ["actor.mini_batches=1"], None),
                                ("forward", ["actor.mini_batches=1"], False),
                                ("two_minibatches", ["actor.mini_batches=2"], None)):
        cfg = _config(os.path.join(run_dir, name), policy, prm, "grpo",
                      ["trainer.steps=1", "rollout.temperature=0.8", "actor.kl_coef=0.01",
                       "actor.entropy_coef=0.01", "actor.shuffle_mini_batches=true", *extra])
        tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
        calls, grads = [], []
        real_step = tr.actor.opt.step

        def step():  # the grads the optimiser applies (after the dp/tp finalisation)
            out = real_step()
            grads.append([p.main_grad.detach().clone() for p in tr.actor.model.parameters()])
            return out
        tr.actor.opt.step = step
        real_lp = tr.actor.logprobs
        tr.actor.logprobs = lambda *a, **k: (calls.append(1), real_lp(*a, **k))[1]
        logprob_phase.reuses_new_logprobs = (real if forced is None
                                              else (lambda *a, **k: forced))
        try:
            metrics = tr.step(0)
        finally:
            logprob_phase.reuses_new_logprobs = real
        out[name] = (len(calls), metrics, grads[0])
    return out


def test_old_logprob_forward_is_skipped_exactly_when_it_equals_the_update_forward(tiny_models,
                                                                                  tmp_path):
    """One mini-batch on-policy: no old-log-prob forward, and the step's losses, ratios, monitor
    and applied grads equal those of the path with the forward (the ratio is 1 by
    construction, TRL's detach); with two mini-batches the forward runs."""
    from megaprm.config import load_config
    from megaprm.trainer.rl.logprob_phase import reuses_new_logprobs

    policy, prm = tiny_models
    out = launch.spawn(_reuse_work, 1, str(tmp_path), policy, prm)[0]
    (n_skip, m_skip, g_skip), (n_fwd, m_fwd, g_fwd) = out["skip"], out["forward"]
    assert (n_skip, n_fwd, out["two_minibatches"][0]) == (0, 1, 1)
    for k, v in m_fwd.items():
        if not k.startswith(PER_RANK):
            assert m_skip[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert m_skip["actor/ratio_mean"] == 1.0 and m_skip["rollout/logprob_diff_max"] > 0
    assert len(g_skip) == len(g_fwd)
    for a, b in zip(g_skip, g_fwd):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(float(a.abs().max()) > 0 for a in g_skip)

    def cfg(*o):
        return load_config(DEMO_YAML, [f"model.path={policy}", "rollout.temperature=0.8",
                                       "actor.mini_batches=1", *o])
    t = 0.8
    assert reuses_new_logprobs(cfg(), t)
    assert not reuses_new_logprobs(cfg("actor.mini_batches=2"), t)
    assert not reuses_new_logprobs(cfg(), t, on_policy=False)
    assert not reuses_new_logprobs(cfg("actor.logprob_temperature=1.0"), 1.0)
    assert not reuses_new_logprobs(cfg("advantage.method=pure", "advantage.pure.kl_coef=0.01"), t)

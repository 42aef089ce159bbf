"""The real RL loop (trainer.loop.RLTrainer) drives the engine lifecycle for 2 steps on 2 gloo
ranks: vLLM (the recording stand-in of tests/rollout/fake_vllm.py) and the transformers engine go
through the same calls, the vLLM engine is placed with external_launcher and the trainer's tp, and
after the last sync the engine holds exactly the actor's weights (reference: the HF export of the
Megatron actor, `rollout.weight_sync.iter_hf_weights`)."""
import os
import re

import pytest

from megaprm.parallel import launch

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "megaprm", "configs", "demo.yaml")
SMALL = ["trainer.wandb=disabled", "trainer.progress=false", "rollout.max_tokens=12",
         "data.prompts_per_step=4", "rollout.n=4", "actor.micro_batch_size=4",
         "actor.optim.lr=1e-3", "prm.kind=none", "advantage.method=grpo", "trainer.steps=2",
         "trainer.save_every=0"]
# built asleep, then the initial sync (weights only); every step is then verl's order: wake the
# KV cache (after the trainer's state is offloaded, trainer/lifecycle.py) -> generate -> sleep ->
# (train) -> wake weights -> load -> reset prefix cache (the sync at the end of the step; the KV
# cache sleeps until the next rollout)
INIT = "sleep:1 wake_up:weights load_weights reset_prefix_cache "
STEP = ("wake_up:kv_cache generate sleep:1 wake_up:weights load_weights reset_prefix_cache ")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("models") / "policy"),
                           tokenizer=tok, vocab_size=len(tok), hidden_size=32, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=64,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _ops(log):
    from tests.rollout import fake_vllm

    return fake_vllm.call_names(log)


def _record_hf(log):
    """Wrap HFEngine's lifecycle methods to log calls in the stand-in's vocabulary."""
    from megaprm.rollout.hf_engine import HFEngine

    def wrap(name, entry):
        orig = getattr(HFEngine, name)

        def call(self, *a, **k):
            log.append(entry)
            return orig(self, *a, **k)
        setattr(HFEngine, name, call)

    wrap("generate", ("generate",))
    wrap("sleep", ("sleep", 1))
    wrap("load_weights", ("load_weights",))

    orig_update, orig_wake = HFEngine.update_weights, HFEngine.wake

    def update(self, weights, *, strict=True, wake_kv_cache=True):
        # the HF engine has no prefix cache and no KV allocation: log the steps it stands for
        log.append(("wake_up", ["weights"]))
        n = orig_update(self, weights, strict=strict, wake_kv_cache=wake_kv_cache)
        log.append(("reset_prefix_cache",))
        if wake_kv_cache:
            log.append(("wake_up", ["kv_cache"]))
        return n

    def wake(self):
        if self.asleep:
            log.append(("wake_up", None if self._asleep else ["kv_cache"]))
        return orig_wake(self)
    HFEngine.update_weights, HFEngine.wake = update, wake


def _train(run_root, policy, tp):
    from tests.rollout import fake_vllm

    from megaprm.config import load_config
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    fake_vllm.install()  # this spawned rank's `import vllm`
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    g = init_distributed(tp=tp)
    out = {}
    hf_log = [("HFEngine",)]
    _record_hf(hf_log)
    for engine in ("vllm", "hf"):
        cfg = load_config(DEMO_YAML, [f"trainer.run_dir={run_root}/{engine}-tp{tp}",
                                      f"model.path={policy}", f"rollout.engine={engine}", *SMALL])
        tr = RLTrainer(cfg, g, build_char_tokenizer())
        history = tr.fit()
        actor = {n: t.detach().clone() for n, t in weight_sync.iter_hf_weights(tr.actor.model, g)}
        if engine == "vllm":
            llm = fake_vllm.LLM.instances[-1]
            held = dict(llm.model.hf.named_parameters())
            out["vllm"] = {"kwargs": llm.kwargs, "ops": _ops(llm.log), "warnings": llm.warnings,
                           "stale": llm.stale_prefix_hits, "local_rank": llm.local_rank}
        else:
            held = dict(tr.engine.model.named_parameters())
            out["hf"] = {"ops": _ops(hf_log)}
        out[engine]["weights_diff"] = max(float((held[n] - t).abs().max()) for n, t in
                                          actor.items())
        out[engine]["history"] = history
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_trainer_drives_the_lifecycle_on_two_ranks(policy, tmp_path, tp):
    results = launch.spawn(_train, 2, str(tmp_path), policy, tp)
    for rank, res in enumerate(results):
        v = res["vllm"]
        assert v["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert v["kwargs"]["tensor_parallel_size"] == tp
        assert v["kwargs"]["skip_tokenizer_init"] and v["kwargs"]["enable_sleep_mode"]
        assert v["local_rank"] == rank  # not every rank on local rank 0
        assert v["warnings"] == [] and v["stale"] == 0
        for engine in ("vllm", "hf"):
            ops = " ".join(res[engine]["ops"]) + " "
            assert re.fullmatch(f"{re.escape(INIT)}({re.escape(STEP)}){{2}}", ops), (engine, ops)
            assert res[engine]["weights_diff"] == 0.0, engine
            assert len(res[engine]["history"]) == 2
    # one seed for the whole job: the ranks of a tp group sample alike
    assert results[0]["vllm"]["kwargs"]["seed"] == results[1]["vllm"]["kwargs"]["seed"]


def _build_order(run_root, policy):
    from tests.rollout import fake_vllm

    from megaprm.config import load_config
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer
    from megaprm.trainer.rl.policy import Policy

    fake_vllm.install()
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    g = init_distributed()
    seen = []
    real = Policy.__init__

    def policy_init(self, *a, **k):  # what the engine had done when each model was built
        seen.append([_ops(llm.log) for llm in fake_vllm.LLM.instances])
        real(self, *a, **k)
    Policy.__init__ = policy_init
    cfg = load_config(DEMO_YAML, [f"trainer.run_dir={run_root}", f"model.path={policy}",
                                  "rollout.engine=vllm", "actor.kl_coef=0.01", *SMALL])
    tr = RLTrainer(cfg, g, build_char_tokenizer())
    return seen, _ops(fake_vllm.LLM.instances[-1].log), tr.ref is not None


def test_engine_is_built_and_asleep_before_the_models(policy, tmp_path):
    """vLLM checks at start-up that utilisation x total GPU memory is free: the engine must
    exist (and sleep) before the actor and reference allocate theirs."""
    seen, ops, has_ref = launch.spawn(_build_order, 1, str(tmp_path / "run"), policy)[0]
    assert has_ref and len(seen) == 2  # actor and reference
    assert all(s == [["sleep:1"]] for s in seen), seen
    assert ops[:2] == ["sleep:1", "wake_up:weights"] and "load_weights" in ops  # initial sync

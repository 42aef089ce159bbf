"""rollout.refill: dynamic sampling (PRIME's released loop, DAPO / verl's filter_groups). The
outcome rewards are replaced by a known pattern over global group ids, so which groups pass is
known; the rounds, the trained groups and the metrics are checked against a loop reference."""
import os

import pytest
import torch

from megaprm.parallel import launch
from tests.rl_setup import rl_config

P, N = 4, 4  # data.prompts_per_step and rollout.n of tests/rl_setup.SMALL
FAST = ["rollout.max_tokens=8", "actor.micro_batch_size=8", "trainer.save_every=0"]


def passes(pattern: str, gid: int) -> bool:
    """Which global group ids pass the filter (outcomes 1,0,1,0: accuracy 0.5, std > 0);
    the others are all wrong."""
    if pattern == "sparse":    # about one group in three
        return (gid * 7 + 3) % 3 == 0
    if pattern == "rank1_dry":  # with dp=2: rank 1's groups (the upper half) pass rarely
        return (gid % P) < P // 2 or gid % 11 == 7
    if pattern == "never":
        return False
    if pattern == "three_of_four":  # surplus passing groups: 3 of every block of 4 pass
        return gid % 4 != 3
    raise ValueError(pattern)


def reference(pattern: str, dp: int, max_rounds: int, start_block: int = 0):
    """The loop: per dp rank a share of P/dp groups filled from each round's passing groups in
    order; another round while any rank is short, at most max_rounds extra; then the shares are
    topped up with failing groups. Returns (rounds, per-rank trained gids, per-rank passed)."""
    share = P // dp
    got = [[] for _ in range(dp)]
    fail = [[] for _ in range(dp)]
    rounds = 0
    while True:
        block = start_block + rounds
        for r in range(dp):
            for j in range(share):
                gid = block * P + r * share + j
                (got[r] if passes(pattern, gid) else fail[r]).append(gid)
        rounds += 1
        if all(len(g) >= share for g in got) or rounds > max_rounds:
            break
    trained = [sorted((got[r] + fail[r])[:share] if len(got[r]) < share else got[r][:share])
               for r in range(dp)]
    passed = [sorted(got[r][:share]) for r in range(dp)]
    return rounds, trained, passed


def _work(run_dir, policy, prm, method, pattern, extra, steps):
    """One rank: patch the outcome with `pattern`, record every rollout block, the groups the
    estimator sees and the keep mask the update gets."""
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    cfg = rl_config(run_dir, policy, prm, method, [*FAST, f"trainer.steps={steps}", *extra])
    tr = RLTrainer(cfg, g, build_char_tokenizer())
    seen = {"blocks": [], "groups": [], "keep": [], "outcome": []}
    real_rollout, real_outcome = tr.rollout, tr.outcome_reward
    real_adv, real_update = tr.advantages, tr.update_actor

    def rollout(block, *requeued):
        seen["blocks"].append(block)
        seen.setdefault("requeued", []).append(list(*requeued))
        return real_rollout(block, *requeued)

    def outcome(batch, prompts, group_ids, step):
        sb = real_outcome(batch, prompts, group_ids, step)
        pattern_o = torch.tensor([float(passes(pattern, int(gid)) and j % 2 == 0)
                                  for j, gid in enumerate(group_ids.tolist())])
        sb.outcome = pattern_o
        return sb

    def advantages(sb, *a):
        seen["groups"].append(sorted(set(sb.group_ids.tolist())))
        seen["outcome"].append(sb.outcome.clone())
        return real_adv(sb, *a)

    def update(rp, adv_t, old, ref, keep):
        seen["keep"].append(keep.clone())
        return real_update(rp, adv_t, old, ref, keep)

    tr.rollout, tr.outcome_reward = rollout, outcome
    tr.advantages, tr.update_actor = advantages, update
    hist = tr.fit()
    return hist, seen, tr.state.next_block


@pytest.mark.parametrize("method,refill", [("grpo", "std"), ("prime", "accuracy")])
def test_refill_samples_until_the_filtered_batch_is_full(tiny_models, tmp_path, method, refill):
    policy, prm = tiny_models
    hist, seen, next_block = launch.spawn(
        _work, 1, str(tmp_path), policy, prm, method, "sparse",
        [f"rollout.refill={refill}", "rollout.max_refill_rounds=20"], 2)[0]
    start = 0
    for step in range(2):
        rounds, trained, passed = reference("sparse", 1, 20, start)
        m = hist[step]
        assert rounds > 1  # the pattern makes the first block short
        assert m["rollout/refill_rounds"] == rounds - 1
        assert m["rollout/groups_generated"] == rounds * P
        assert m["rollout/groups_kept"] == P and m["rollout/refill_capped"] == 0
        assert seen["groups"][step] == trained[0] == passed[0]
        assert seen["keep"][step].all()  # every trained group passed: all rows carry gradient
        start += rounds
    assert seen["blocks"] == list(range(start)) and next_block == start


def test_refill_stops_at_the_cap_and_trains_on_what_passed(tiny_models, tmp_path):
    policy, prm = tiny_models
    hist, seen, next_block = launch.spawn(
        _work, 1, str(tmp_path), policy, prm, "grpo", "sparse",
        ["rollout.refill=std", "rollout.max_refill_rounds=1"], 1)[0]
    rounds, trained, passed = reference("sparse", 1, 1)
    m = hist[0]
    assert rounds == 2 and len(passed[0]) < P  # the reference is capped too
    assert m["rollout/refill_rounds"] == 1 and m["rollout/refill_capped"] == 1
    assert m["rollout/groups_kept"] == len(passed[0])
    assert seen["groups"][0] == trained[0]
    gids = torch.tensor(trained[0]).repeat_interleave(N)
    want_keep = torch.tensor([g in passed[0] for g in gids.tolist()])
    assert torch.equal(seen["keep"][0], want_keep)  # top-up groups get no gradient
    assert m["actor/updates"] >= 1 and next_block == 2


def test_refill_never_passing_is_capped_not_endless(tiny_models, tmp_path):
    policy, prm = tiny_models
    hist, seen, _ = launch.spawn(_work, 1, str(tmp_path), policy, prm, "grpo", "never",
                                 ["rollout.refill=std", "rollout.max_refill_rounds=2"], 1)[0]
    m = hist[0]
    assert len(seen["blocks"]) == 3 and m["rollout/groups_kept"] == 0
    assert m["rollout/refill_capped"] == 1 and not seen["keep"][0].any()
    assert m["actor/updates"] == 0 and m["guard/skipped_total"] == 0


def test_refill_off_is_one_round_per_step(tiny_models, tmp_path):
    policy, prm = tiny_models
    hist, seen, next_block = launch.spawn(_work, 1, str(tmp_path), policy, prm, "grpo",
                                          "never", [], 2)[0]
    assert seen["blocks"] == [0, 1] and next_block == 2
    assert "rollout/refill_rounds" not in hist[0]
    assert seen["groups"] == [list(range(P)), list(range(P, 2 * P))]


def test_two_ranks_with_different_filters_run_the_same_rounds(tiny_models, tmp_path):
    """dp=2: rank 0's groups pass at once, rank 1's rarely; both generate the same number of
    rounds (agreed), each fills its own share, the global counts agree with the loop."""
    policy, prm = tiny_models
    out = launch.spawn(_work, 2, str(tmp_path), policy, prm, "grpo", "rank1_dry",
                       ["rollout.refill=std", "rollout.max_refill_rounds=20"], 1)
    rounds, trained, _ = reference("rank1_dry", 2, 20)
    assert rounds > 2
    for r, (hist, seen, next_block) in enumerate(out):
        assert seen["blocks"] == list(range(rounds)) and next_block == rounds
        assert seen["groups"][0] == trained[r]
        assert seen["keep"][0].all()
        m = hist[0]
        assert m["rollout/refill_rounds"] == rounds - 1
        assert m["rollout/groups_kept"] == P and m["rollout/groups_generated"] == rounds * P
    same = [{k: v for k, v in hist[0].items() if not k.startswith(("timing/", "throughput/",
                                                                     "weight_sync/"))}
            for hist, _, _ in out]
    assert same[0] == pytest.approx(same[1])  # the logged metrics agree across ranks


def _resume_work(run_dir, policy, prm, steps, pattern=None, extra=()):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    cfg = rl_config(run_dir, policy, prm, "grpo",
                    [*FAST, f"trainer.steps={steps}", "trainer.save_every=1",
                     "rollout.refill=std", "rollout.max_refill_rounds=3", *extra])
    tr = RLTrainer(cfg, g, build_char_tokenizer())
    blocks = []
    real, real_outcome = tr.rollout, tr.outcome_reward

    def rollout(block, *requeued):
        blocks.append((block, *requeued) if requeued else block)
        return real(block, *requeued)

    def outcome(batch, prompts, group_ids, step):
        sb = real_outcome(batch, prompts, group_ids, step)
        sb.outcome = torch.tensor([float(passes(pattern, int(gid)) and j % 2 == 0)
                                   for j, gid in enumerate(group_ids.tolist())])
        return sb
    tr.rollout = rollout
    if pattern is not None:
        tr.outcome_reward = outcome
    tr.fit()
    return blocks, tr.state.next_block


def test_resume_continues_from_the_saved_data_position(tiny_models, tmp_path):
    """The blocks a refilled run draws after a restart are the ones the uninterrupted run drew."""
    policy, prm = tiny_models
    whole, end = launch.spawn(_resume_work, 1, str(tmp_path / "a"), policy, prm, 2)[0]
    first, mid = launch.spawn(_resume_work, 1, str(tmp_path / "b"), policy, prm, 1)[0]
    rest, end_b = launch.spawn(_resume_work, 1, str(tmp_path / "b"), policy, prm, 2)[0]
    assert first + rest == whole and end_b == end and rest[0] == mid
    assert os.path.isdir(tmp_path / "b" / "checkpoints")


def test_resume_keeps_the_requeued_prompts(tiny_models, tmp_path):
    """The requeue list is checkpointed: after a restart the next step regenerates the same
    surplus prompts first (step 0 requeues gids 5, 6)."""
    policy, prm = tiny_models
    args = ("three_of_four", ["rollout.refill_surplus=requeue"])
    first, _ = launch.spawn(_resume_work, 1, str(tmp_path), policy, prm, 1, *args)[0]
    rest, end = launch.spawn(_resume_work, 1, str(tmp_path), policy, prm, 2, *args)[0]
    # the uninterrupted run (test_surplus_prompts_are_requeued_first_as_released)
    assert first + rest == [0, 1, (2, (5, 6))] and end == 3


def test_surplus_prompts_are_requeued_first_as_released(tiny_models, tmp_path):
    """rollout.refill_surplus=requeue (PRIME's add_to_buffer): passing groups beyond the share
    come back at the head of the next step's first round, and are trained then.
    Step 0: blocks 0 (gids 0,1,2 pass) and 1 (4,5,6): trains 0,1,2,4, requeues 5,6.
    Step 1: 5,6 + block 2 (8,9,10 pass): trains 5,6,8,9, requeues 10."""
    policy, prm = tiny_models
    hist, seen, next_block = launch.spawn(
        _work, 1, str(tmp_path), policy, prm, "grpo", "three_of_four",
        ["rollout.refill=std", "rollout.refill_surplus=requeue"], 2)[0]
    assert seen["blocks"] == [0, 1, 2] and next_block == 3
    assert seen["requeued"] == [[], [], [5, 6]]
    assert seen["groups"] == [[0, 1, 2, 4], [5, 6, 8, 9]]
    assert [m["rollout/requeued"] for m in hist] == [2.0, 1.0]
    assert all(k.all() for k in seen["keep"])


def test_refill_config_and_recipes():
    from megaprm.config import load_config
    from megaprm.errors import ConfigError

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    for name in ("prime", "prime_tiny"):  # released PRIME refills (ray_trainer.py:467-524)
        cfg = load_config(os.path.join(root, f"{name}.yaml"))
        assert cfg.rollout.refill == "accuracy" and cfg.rollout.max_refill_rounds >= 1
    assert load_config(None).rollout.refill == "none"  # off unless a recipe asks
    with pytest.raises(ConfigError, match=r"rollout.refill='dapo' is not valid"):
        load_config(None, ["rollout.refill=dapo"])
    with pytest.raises(ConfigError, match=r"rollout.max_refill_rounds=-1 is not valid"):
        load_config(None, ["rollout.max_refill_rounds=-1"])
    with pytest.raises(ConfigError, match=r"rollout.refill_surplus='keep' is not valid"):
        load_config(None, ["rollout.refill_surplus=keep"])
    prime = load_config(os.path.join(root, "prime.yaml"))
    assert prime.rollout.refill_surplus == "requeue"


def test_pick_groups_fills_with_passing_then_tops_up():
    from megaprm.trainer.rl.refill import _pick_groups

    ok = [torch.tensor([False, True]), torch.tensor([True, True])]
    assert _pick_groups(ok, 2) == [[1], [0]]
    assert _pick_groups(ok, 4) == [[0, 1], [0, 1]]
    assert _pick_groups([torch.tensor([False, False])], 2) == [[0, 1]]

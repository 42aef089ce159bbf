"""The sampler-vs-trainer drift warning reads the mean |diff| over response tokens: a bf16 run's
max reaches 0.1-0.6 from rounding alone (H200, the demo's model, mean 1.6-1.9e-3:
scripts/results/gpu_h200/metrics_*.jsonl), while a wrong temperature or stale weights move
every token's log-prob."""
from megaprm.trainer import step_metrics


def _warned(capsys, rank=0, **metrics) -> str:
    step_metrics.warn_on_drift(rank, 3, metrics)
    return capsys.readouterr().out


def test_bf16_rounding_max_alone_does_not_warn(capsys):
    # the H200 demo's step 1 (grpo): mean 1.93e-3, max 0.571
    assert _warned(capsys, **{"rollout/logprob_diff_mean": 1.93e-3,
                              "rollout/logprob_diff_max": 0.571}) == ""


def test_a_mean_above_the_threshold_warns_once_on_rank_0(capsys):
    m = {"rollout/logprob_diff_mean": 0.05, "rollout/logprob_diff_max": 0.9}
    out = _warned(capsys, **m)
    assert "step 3" in out and "mean |diff| 0.05 > 0.01" in out and "max 0.9" in out
    assert out.count("\n") == 1
    assert _warned(capsys, rank=1, **m) == ""


def test_stale_samples_never_warn(capsys):
    assert _warned(capsys, **{"rollout/logprob_diff_mean": 0.5, "rollout/logprob_diff_max": 2.0,
                              "rollout/staleness_max": 1.0}) == ""

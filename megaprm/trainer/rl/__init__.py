"""The RL step: `loop.RLTrainer` (build, `step`, `fit`), the typed batches the phases hand each
other (`batch`), the phases themselves (rollout source, reward, log-probs, advantages, actor
update, PRIME's implicit PRM, refill, correction, step metrics) and the run's state (`resume`).
Beside it in megaprm/trainer: the PRM trainer, SFT, the run-directory code and the commands."""

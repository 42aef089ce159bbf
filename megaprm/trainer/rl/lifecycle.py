"""Who is on the device in each phase (docs/architecture.md "Memory has a lifecycle").

The colocated engine and the trainer's models share one device. A step goes, in verl's order
(`ActorRolloutRefWorker.rollout_mode` / `trainer_mode`):

    train -> wake the engine's weights -> sync -> offload the trainer's state -> wake the KV
    cache -> generate -> sleep the engine -> reload what the next phase needs

`sync()` is the first half, at the end of the update (so between steps - checkpoints, logs - the
engine holds the actor's weights and the trainer its state); `generate(fn)` is the second half,
around a rollout or an evaluation. The KV cache, the largest allocation of the engine, is woken
only after the trainer's state has left the device, and the trainer's state comes back only after
the engine sleeps: the two peaks never meet.

The trainer's state moves per model by its switch (`actor.offload`, `ref.offload`,
`prm.offload`; parallel/offload.py): parameters and optimizer state to host memory and back bit
for bit, grads released. Every model offloaded before generation is reloaded after it (the
phases after the rollout - process reward, old and reference log-probs, the PRM and actor
updates - need all of them).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from megaprm.parallel.offload import Offload


class Lifecycle:
    """`engine`: the colocated RolloutEngine; `sync`: streams the actor's weights into it with
    `update_weights(..., wake_kv_cache=False)` and returns the stream's metrics (the loop's);
    `offloads`: the models whose switch is on."""

    def __init__(self, engine, sync: Callable[[], Optional[dict]], offloads: list[Offload]):
        self.engine, self._sync, self.offloads = engine, sync, list(offloads)
        self.synced = False  # the engine's weights are awake and are the actor's current ones

    def sync(self) -> Optional[dict]:
        """train -> wake the engine's weights -> sync. The KV cache stays asleep. Returns what
        the stream returned (its metrics)."""
        self.reload()  # the weights are read from the actor (resident outside `generate`)
        out = self._sync()
        self.synced = True
        return out

    def generate(self, fn: Callable[[], object]):
        """-> offload the trainer's state -> wake the KV cache -> fn() -> sleep the engine ->
        reload. Syncs first where the engine slept since the last sync (a skipped step, an
        evaluation, a refill round): a sleep may have dropped its weights (level 2)."""
        if not self.synced:
            self.sync()
        self.offload()
        self.engine.wake()  # what still sleeps: the KV cache
        try:
            return fn()
        finally:
            self.engine.sleep()
            self.synced = False
            self.reload()

    def offload(self) -> int:
        freed = sum(o.offload() for o in self.offloads)
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the caching allocator's blocks back to the driver (vLLM)
        return freed

    def reload(self) -> int:
        return sum(o.reload() for o in self.offloads)


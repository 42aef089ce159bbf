"""megaprm.faults: the test-only hooks are inert unless their variable is set, parse what the
reliability tests set, and read the environment once."""
import os
import signal

import pytest
import torch

from megaprm import faults


@pytest.fixture
def hooks(monkeypatch):
    """Set the hooks' variables for one test (the cache is cleared before and after)."""
    def set_env(**env):
        for k in (faults.KILL_AT_ENV, faults.CRASH_DURING_SAVE_AT_ENV, faults.NAN_AT_ENV,
                  faults.KILL_ROLLOUT_AT_ENV):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        faults.active.cache_clear()
    yield set_env
    faults.active.cache_clear()


def test_nothing_set_is_inert(hooks, monkeypatch):
    hooks()
    killed = []
    monkeypatch.setattr(os, "kill", lambda *a: killed.append(a))
    t = torch.ones(3)
    for step in range(4):
        faults.kill_at(step, "after_log")
        faults.kill_at(step, "after_save")
        faults.kill_rollout_at(step)
        assert not faults.crash_during_save(step)
        assert faults.nan_at("outcome", 0, step, t) is t
    assert faults.active() == faults.Faults()
    assert killed == []


def test_each_hook_fires_only_where_it_is_aimed(hooks, monkeypatch):
    hooks(MEGAPRM_KILL_AT="2:after_save", MEGAPRM_CRASH_DURING_SAVE_AT="3",
          MEGAPRM_FAULT="outcome:1:0", MEGAPRM_KILL_ROLLOUT_AT="4")
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    faults.kill_at(2, "after_log")
    faults.kill_at(1, "after_save")
    assert killed == []
    faults.kill_at(2, "after_save")
    assert killed == [(os.getpid(), signal.SIGKILL)]
    faults.kill_rollout_at(3)
    faults.kill_rollout_at(4)
    assert len(killed) == 2
    assert [faults.crash_during_save(s) for s in range(5)] == [False, False, False, True, False]
    t = torch.ones(2, 2, dtype=torch.int64)
    assert faults.nan_at("outcome", 0, 0, t) is t  # another rank
    assert faults.nan_at("outcome", 1, 1, t) is t  # another step
    assert faults.nan_at("advantage", 1, 0, t) is t  # another tensor
    hit = faults.nan_at("outcome", 1, 0, t)
    assert hit.dtype == torch.float32 and torch.isnan(hit.view(-1)[0])
    assert torch.equal(hit.view(-1)[1:], torch.ones(3)) and t.dtype == torch.int64  # a copy


def test_the_environment_is_read_once(hooks, monkeypatch):
    hooks(MEGAPRM_CRASH_DURING_SAVE_AT="1")
    assert faults.crash_during_save(1)
    monkeypatch.setenv(faults.CRASH_DURING_SAVE_AT_ENV, "2")  # too late: already read
    assert faults.crash_during_save(1) and not faults.crash_during_save(2)


def test_read_env_parses_an_explicit_mapping():
    got = faults.read_env({"MEGAPRM_FAULT": "outcome:3:7", "MEGAPRM_KILL_ROLLOUT_AT": "5"})
    assert got == faults.Faults(nan_at=("outcome", 3, 7), kill_rollout_at=5)

"""`on_ranks`: how a multi-rank command runs. Every command that needs several ranks (demo,
compare, train, train-prm) calls it with two functions of its own: `preflight()` runs once, in
the launcher, and checks everything it can without ranks; `body()` runs on every torchrun rank.
The command modules import this one; it imports only the launchers.
"""
from __future__ import annotations

from megaprm.parallel import launch, ray_launch

NOTHING_TO_DO = object()  # a preflight's answer when no rank needs to start


def on_ranks(args, argv, preflight, body) -> int:
    """`preflight()` in the launcher, then `body()` on every torchrun rank. A preflight may
    return a lock the launcher holds while its ranks run, or NOTHING_TO_DO (no rank starts)."""
    if not launch.under_torchrun():
        lock = preflight()
        if lock is NOTHING_TO_DO:  # the preflight said why, in one line
            return 0
        try:
            if ray_launch.wanted(args):
                return ray_launch.relaunch(args, argv)
            return launch.relaunch(args, argv)
        finally:
            if lock is not None:
                lock.release()
    launch.die_with_parent()
    return body()

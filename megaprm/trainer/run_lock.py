"""One run per run directory: a lock file holding the pid and host of the process that owns it.

    with RunLock(run_dir):          # or lock = RunLock(run_dir); lock.acquire(); ... release()
        train(...)

The lock file `run_dir/.megaprm.lock` is created with O_CREAT | O_EXCL (atomic, also on NFS
v3+), so of two starts exactly one wins; the other gets RunLockError naming the holder. A lock
whose pid is dead on this host is stale (a kill -9, a crashed node-local launcher) and is taken
over; a lock from another host cannot be checked from here and is refused, with the command to
remove it. Take the lock in the launcher, before any rank starts (ranks die with it).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Optional

LOCK_FILE = ".megaprm.lock"


class RunLockError(RuntimeError):
    """Another process holds the run directory; the message is one line."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated as held by an unknown process


class RunLock:
    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "argv": sys.argv}
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _stale(self, holder: dict) -> bool:
        pid = holder.get("pid")
        return (isinstance(pid, int) and holder.get("host") == socket.gethostname()
                and not _alive(pid))

    def _take_over(self, holder: dict) -> None:
        """Move a stale lock aside; if what we moved is no longer that stale lock (another
        start replaced it meanwhile), put it back."""
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != holder:
            try:
                os.link(aside, self.path)  # fails if a third start already holds the path
            except FileExistsError:
                pass
        os.remove(aside)

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunLockError naming the holder."""
        os.makedirs(self.run_dir, exist_ok=True)
        for _ in range(5):
            if self._create():
                self.held = True
                return self
            holder = _read(self.path)
            if holder is None:  # released between our attempts
                continue
            if holder and self._stale(holder):
                print(f"[megaprm] taking over the stale lock {self.path} of pid "
                      f"{holder['pid']} (no longer running on {holder['host']})", flush=True)
                self._take_over(holder)
                continue
            break
        holder = _read(self.path) or {}
        since = time.strftime("%Y-%m-%d %H:%M:%S",
                              time.localtime(holder.get("started", 0))) if holder else "?"
        who = (f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"
               if holder else "an unknown process (unreadable lock file)")
        raise RunLockError(
            f"run directory {self.run_dir} is in use by {who}; stop that run or use another "
            f"run directory (if that process is gone, delete {self.path})")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = _read(self.path)
        if holder and holder.get("pid") == os.getpid() and \
                holder.get("host") == socket.gethostname():
            os.remove(self.path)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

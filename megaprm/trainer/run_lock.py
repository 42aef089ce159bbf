"""One run per run directory: a lock file holding the pid and host of the process that owns it.

    with RunLock(run_dir):          # or lock = RunLock(run_dir); lock.acquire(); ... release()
        train(...)

The lock file `run_dir/.megaprm.lock` is written complete under a private name, flock()ed and
then hard-linked into place (link is atomic and fails if the name exists, also on NFS v3+), so
of two starts exactly one wins and the other gets RunLockError naming the holder; a full disk
fails the start in one line and leaves no lock behind. The holder keeps its flock while it
runs. A lock whose pid is dead on this host is stale (a kill -9, a crashed node-local launcher)
and is taken over; so is an unreadable lock (an empty one left by an older megaprm on a full
disk) that no live process holds flock()ed. A readable lock from another host cannot be checked
from here and is refused, with the command to remove it. Take the lock in the launcher, before
any rank starts (ranks die with it).
"""
from __future__ import annotations

import errno
import fcntl
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
        self._fd = None  # the flock()ed lock file while held

    def _create(self) -> bool:
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.time(), "argv": sys.argv}).encode()
        tmp = f"{self.path}.{socket.gethostname()}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)
            os.fsync(fd)
            os.link(tmp, self.path)
        except FileExistsError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            try:
                os.remove(tmp)
            except OSError:
                pass
        self._fd = fd
        return True

    def _unheld(self) -> bool:
        """An unreadable lock file that no live process holds flock()ed (and not just being
        written: older than 2 s)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            if time.time() - os.fstat(fd).st_mtime < 2:
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:  # held (EWOULDBLOCK), or flock unsupported: not ours to take
            return False
        finally:
            os.close(fd)

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
        try:
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
                if not holder and self._unheld():
                    print(f"[megaprm] taking over the unreadable lock {self.path}: no running "
                          "process holds it (left by a start that failed, e.g. a full disk)",
                          flush=True)
                    self._take_over(holder)
                    continue
                break
        except OSError as e:
            raise RunLockError(f"cannot lock run directory {self.run_dir}: "
                               f"{e.strerror or e} ({e.filename or self.path})") from None
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
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

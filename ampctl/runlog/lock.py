"""One owner per run folder: a lock file that a second process on the same folder is refused by.

``ampctl train --name x`` twice at once, a ``--resume`` while the run is still live, two sweeps
with one ``--name``, two :class:`~ampctl.integrations.ProtectedRun` on one ``run_dir``: each takes
:func:`lock_run` on the folder first, before it writes anything there. The first one owns the
folder until it ends; the others get :class:`RunLockedError` (a :class:`~ampctl.errors.UsageError`:
one line, exit code 2) naming the owner's pid and host.

Why ``fcntl.flock`` on a lock file rather than an ``O_CREAT|O_EXCL`` file: the kernel drops a
flock when its process dies, however it dies (SIGKILL, a node's OOM killer), so a dead owner's lock
is never mistaken for a live one -- no pid check, no race between two processes taking over the
same stale file, no pid reuse that makes a dead owner look alive. The pid and host written in the
file are only for the messages: a file found with an owner in it but no flock held is a stale lock
(its process died before it could remove it), and taking it over says so in one line. A flock is
held per open file, so two owners in one process (two ProtectedRuns) exclude each other too.

On a clean end the owner removes the file, then lets the flock go. A process that opened the file
just before it was removed would lock a file no longer in the folder; :func:`lock_run` checks that
the file it locked is still the one at the path and tries again otherwise.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from ampctl.errors import UsageError

__all__ = ["LOCK_NAME", "RunLock", "RunLockedError", "lock_run"]

#: The lock file inside a run (or sweep) folder.
LOCK_NAME = ".ampctl.lock"

try:  # POSIX; on a system without flock the folder is not locked (nothing else changes)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class RunLockedError(UsageError):
    """The folder is owned by another live process (one line: who, and what to do)."""


def _owner_text(raw: str) -> str:
    """``pid 123 on host h (since 12:00:01 UTC)`` from a lock file's text, or ``""``."""
    fields = dict(part.split("=", 1) for part in raw.split() if "=" in part and len(part) < 300)
    pid, host = fields.get("pid", ""), fields.get("host", "")
    if not pid.isdigit():
        return ""
    out = f"pid {pid}" + (f" on host {host}" if host else "")
    since = fields.get("since", "")
    if since.replace(".", "", 1).isdigit():
        out += f" (since {time.strftime('%H:%M:%S UTC', time.gmtime(float(since)))})"
    return out


class RunLock:
    """A held lock on a folder (see the module docstring); :meth:`release` ends it (idempotent).

    ``took_over``: the previous owner's description when a stale lock (a dead process's) was
    taken over, else None -- the caller says it in one line."""

    def __init__(self, path: Path, fd: int | None, took_over: str | None) -> None:
        self.path, self._fd, self.took_over = path, fd, took_over

    @property
    def held(self) -> bool:
        return self._fd is not None

    def message(self) -> str | None:
        """The one line that says a stale lock was taken over (None when there was none)."""
        if self.took_over is None:
            return None
        return (
            f"took over the stale lock {self.path} of {self.took_over}: that process is gone "
            "(it stopped without removing the lock)"
        )

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)  # the flock goes with the last descriptor of the open file

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lock never released by its owner goes when it is collected
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)  # type: ignore[arg-type]
            except OSError:
                pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_run(folder: str | Path, *, what: str = "run folder", hint: str = "") -> RunLock:
    """Own ``folder`` (which must exist) until :meth:`RunLock.release`, or raise
    :class:`RunLockedError` when another live process owns it. ``what`` names the folder in the
    message (``run folder``, ``sweep folder``); ``hint`` is appended to it (what to do instead).
    The lock file is opened without following a link (a link there is refused as bad input)."""
    path = Path(folder) / LOCK_NAME
    if fcntl is None:  # pragma: no cover
        return RunLock(path, None, None)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunLockedError(
                    f"{path} is a symbolic link: ampctl's lock file must be a regular file in the "
                    f"{what}; remove the link"
                ) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:  # the owner writes its pid just after its flock: give it a moment to
                for _wait in range(20):
                    owner = _owner_text(os.pread(fd, 4096, 0).decode(errors="replace"))
                    if owner:
                        break
                    time.sleep(0.01)
            finally:
                os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise RunLockedError(
                f"{what} {folder} is in use by {owner or 'another ampctl process'}: two runs "
                f"never write one folder; wait for it to end{hint}"
            ) from None
        if not _same_file(fd, path):  # its owner removed it as we opened it: take the new one
            os.close(fd)
            continue
        try:
            old = os.pread(fd, 4096, 0).decode(errors="replace")
        except OSError:
            old = ""
        took_over = _owner_text(old) or None
        mine = f"pid={os.getpid()} host={socket.gethostname()} since={time.time():.0f}\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine.encode(), 0)
        except OSError:  # a full disk: the flock still holds; only the message lacks the owner
            pass
        if took_over is not None and took_over.startswith(f"pid {os.getpid()} "):
            took_over = None  # our own earlier lock in this process (released without removal)
        return RunLock(path, fd, took_over)
    raise RunLockedError(f"{what} {folder}: could not take the lock {path} (it keeps changing)")

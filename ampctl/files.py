"""Every file ampctl writes goes through here (standard library only: amp/, train/, ui/ and
commands/ may all import it).

A run folder is data from a stranger, and so is what it holds where ampctl writes: a planted
``.config.yaml.tmp -> ../victim`` or a ``metrics.jsonl`` that is a symlink must not make ampctl
write outside the folder.

* :func:`write_file` / :func:`write_bytes` / :func:`write_text` (a whole file): a temp file with
  a random name is created exclusively in the target's folder without following links
  (``O_CREAT | O_EXCL | O_NOFOLLOW``), written, flushed and fsync'ed, then ``os.replace``\\ d
  onto the target (which swaps a link at the target itself, never writes through it) and the
  folder fsync'ed. Readers see the old file or the new one; on failure the temp file is removed.
* :func:`write_new`: the same, but the target must not exist (``os.link`` of the finished temp
  file: it fails rather than replace anything, even in a race).
* :func:`append_line` (JSONL logs): opened with ``O_APPEND | O_NOFOLLOW``; a symlink or a file
  that is not a regular file is refused (:class:`WriteRefused`, one line); the whole line goes in
  one ``os.write`` and a short or failed write is truncated back, so no half line stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ampctl.errors import UsageError

__all__ = [
    "WriteRefused",
    "append_line",
    "check_appendable",
    "fsync_dir",
    "open_append",
    "touch",
    "write_bytes",
    "write_file",
    "write_new",
    "write_text",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class WriteRefused(UsageError):
    """A path ampctl would write is a symlink, not a regular file, or exists already where
    nothing may be overwritten: nothing was written."""


def fsync_dir(folder: str | Path) -> None:
    """fsync a folder (so a rename in it is durable); silently nothing where that is not
    possible (some file systems, Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_in(folder: Path, name: str) -> tuple[int, Path]:
    """A fresh temp file in ``folder``: created exclusively, never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp name", str(folder))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def write_file(path: str | Path, mode: str = "wb", *, replace: bool = True) -> Iterator[IO[Any]]:
    """A file object (``"wb"`` or ``"w"``) whose content becomes ``path`` atomically when the
    block ends without an error (see the module docstring); on an error the temp file is removed
    and ``path`` is untouched. ``replace=False``: ``path`` must not exist
    (:class:`WriteRefused` when it does, before or after the block)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"write_file mode {mode!r}: use 'wb' or 'w'")
    path = Path(path)
    if not replace and (path.exists() or path.is_symlink()):
        raise WriteRefused(f"{str(path)!r} exists already: nothing is overwritten")
    fd, tmp = _temp_in(path.parent, path.name)
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path, follow_symlinks=False)
            except FileExistsError:
                raise WriteRefused(
                    f"{str(path)!r} exists already: nothing is overwritten"
                ) from None
            os.unlink(tmp)
        fsync_dir(path.parent)
    except OSError as e:  # the file it was for, not the temp file, in the message
        _unlink_quietly(tmp)
        if isinstance(e, WriteRefused) or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` as the whole of ``path``, atomically and never through a link."""
    with write_file(path, "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) as the whole of ``path``, atomically and never through a link."""
    write_bytes(path, text.encode("utf-8"))


def write_new(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` as a new file ``path``; :class:`WriteRefused` when ``path`` exists (a file,
    a link, anything): nothing is overwritten."""
    with write_file(path, "wb", replace=False) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def _refuse_kind(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise WriteRefused(
            f"{str(path)!r} is a symlink: ampctl does not append through a link (a run folder is "
            "data and may not make ampctl write outside it); remove the link"
        )
    if not stat.S_ISREG(st.st_mode):
        raise WriteRefused(f"{str(path)!r} is not a regular file: ampctl does not append to it")


def check_appendable(path: str | Path) -> None:
    """Raise :class:`WriteRefused` when ``path`` exists and is a symlink or not a regular file
    (what :func:`append_line` would refuse); nothing is opened or created."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    _refuse_kind(p, st)


def _open_append_fd(p: Path) -> int:
    """An ``O_APPEND`` descriptor of ``p`` (created when missing), never through a link;
    :class:`WriteRefused` for a symlink or a non-regular file."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK
    try:  # O_NONBLOCK: a planted FIFO fails (ENXIO) instead of blocking the open
        fd = os.open(p, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO) or p.is_symlink():
            check_appendable(p)
        raise
    try:
        _refuse_kind(p, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | Path) -> IO[bytes]:
    """A binary file object appending to ``path`` (created when missing; a log a subprocess
    writes, a lock file); :class:`WriteRefused` for a symlink or a non-regular file."""
    return os.fdopen(_open_append_fd(Path(path)), "ab")


def touch(path: str | Path) -> None:
    """Create ``path`` empty when missing (an existing file is left as it is);
    :class:`WriteRefused` for a symlink or a non-regular file."""
    os.close(_open_append_fd(Path(path)))


def append_line(path: str | Path, line: str | bytes) -> None:
    """Append one line (a newline is added when missing) to ``path``, created when missing.
    Refuses a symlink or a non-regular file (:class:`WriteRefused`). The line goes in one
    ``os.write`` (continued after a short one); a failed write is cut back to the previous size
    (no half line) and raises the ``OSError`` naming ``path``."""
    p = Path(path)
    data = line.encode("utf-8") if isinstance(line, str) else bytes(line)
    if not data.endswith(b"\n"):
        data += b"\n"
    fd = _open_append_fd(p)
    try:
        before = os.fstat(fd).st_size
        view = memoryview(data)
        try:  # a short write is continued: the next write says why it stopped (EFBIG, ENOSPC)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "short write", str(p))
                view = view[n:]
        except OSError as e:  # a full disk (ENOSPC), a file size limit (EFBIG): named by file
            _truncate_quietly(fd, before)  # no half line is left behind
            raise OSError(e.errno, e.strerror, str(p)) from None
    finally:
        os.close(fd)


def _truncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass

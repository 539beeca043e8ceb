"""Progress of a long read (``ampctl diagnose`` reading a checkpoint's tensors).

Nothing is shown for a read that ends within :data:`QUIET_FOR` seconds. After that:

* on an interactive terminal, a rich progress bar on stderr: bytes read, bytes/s, tensors, ETA;
* otherwise (``--json``, a pipe, CI, ``TERM=dumb``), a plain line on stderr every
  :data:`PLAIN_EVERY` seconds and one at the end::

      reading checkpoint: 3.2 GiB of 12.6 GiB (25%), 71 of 289 tensors, 410.3 MiB/s, eta 00:23

stdout is never written (``--json`` output stays a single JSON document). The reader reports
through :class:`ampctl.commands.diagnose.health.ReadProgress`'s three calls; this module
imports neither torch nor the readers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ampctl.trust import human_size

__all__ = ["ByteProgress", "QUIET_FOR", "PLAIN_EVERY"]

#: A read shorter than this shows nothing.
QUIET_FOR = 2.0
#: Seconds between two plain lines.
PLAIN_EVERY = 10.0


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return (
        f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"
        if s >= 3600
        else f"{s // 60:02d}:{s % 60:02d}"
    )


class ByteProgress:
    """A read of ``total`` bytes in ``tensors`` steps, shown as a bar or as plain lines.

    ``live``: a rich bar (default: stderr is an interactive terminal); ``stream``: where plain
    lines go (stderr); ``clock``: the time source (tests pass their own). Implements the
    ``start`` / ``advance`` / ``finish`` calls of
    :class:`~ampctl.commands.diagnose.health.ReadProgress`; never raises into the reader."""

    def __init__(
        self,
        what: str = "reading checkpoint",
        *,
        live: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet_for: float = QUIET_FOR,
        plain_every: float = PLAIN_EVERY,
    ) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.console = Console(file=self.stream, stderr=stream is None)
        self.live = (
            self.console.is_terminal and not self.console.is_dumb_terminal if live is None else live
        )
        self.clock = clock
        self.quiet_for = quiet_for
        self.plain_every = plain_every
        self.total = self.done = self.tensors = self.count = 0
        self.t0 = self.last = 0.0
        self.shown = False
        self._bar: Progress | None = None
        self._task: Any = None

    # the ReadProgress calls
    def start(self, total_bytes: int, tensors: int) -> None:
        self.total, self.tensors = int(total_bytes), int(tensors)
        self.done = self.count = 0
        self.t0 = self.last = self.clock()
        self.shown = False

    def advance(self, name: str, nbytes: int) -> None:
        self.done += int(nbytes)
        self.count += 1
        now = self.clock()
        try:
            if not self.shown and now - self.t0 >= self.quiet_for:
                self._show(now)
            elif self._bar is not None:
                self._bar.update(self._task, completed=self.done, tensors=self.count)
            elif self.shown and now - self.last >= self.plain_every and self.count < self.tensors:
                self._line(now)
        except Exception:  # noqa: BLE001 - a display never breaks a read
            pass

    def finish(self) -> None:
        try:
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, tensors=self.count)
                self._bar.stop()
                self._bar = None
            elif self.shown:
                self._line(self.clock(), final=True)
        except Exception:  # noqa: BLE001
            pass

    # display
    def _show(self, now: float) -> None:
        self.shown = True
        if not self.live:
            self._line(now)
            return
        self._bar = Progress(
            TextColumn(f"{self.what}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]}/" + f"{self.tensors} tensors"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self._task = self._bar.add_task(self.what, total=max(self.total, 1), tensors=0)
        self._bar.update(self._task, completed=self.done)
        self._bar.start()

    def _line(self, now: float, *, final: bool = False) -> None:
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        tail = (
            f"done in {_clock(elapsed)}"
            if final
            else f"eta {_clock((self.total - self.done) / rate) if rate > 0 else '?'}"
        )
        self.stream.write(
            f"{self.what}: {human_size(self.done)} of {human_size(self.total)} ({pct:.0f}%), "
            f"{self.count} of {self.tensors} tensors, {human_size(rate)}/s, {tail}\n"
        )
        self.stream.flush()

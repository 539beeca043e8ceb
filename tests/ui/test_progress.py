"""The read progress of ``ampctl diagnose``: quiet for a short read, a line now and then in plain
mode (stderr only), a bar on a terminal."""

from __future__ import annotations

import io

from ampctl.ui.progress import ByteProgress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _read(p: ByteProgress, clock: Clock, steps: int, dt: float, nbytes: int = 1 << 30) -> None:
    p.start(steps * nbytes, steps)
    for i in range(steps):
        clock.t += dt
        p.advance(f"t{i}", nbytes)
    p.finish()


def test_a_short_read_shows_nothing():
    out, clock = io.StringIO(), Clock()
    _read(ByteProgress(live=False, stream=out, clock=clock), clock, steps=10, dt=0.1)
    assert out.getvalue() == ""


def test_plain_mode_writes_a_line_now_and_then_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    p = ByteProgress(live=False, stream=out, clock=clock, quiet_for=2.0, plain_every=10.0)
    _read(p, clock, steps=30, dt=1.0)  # 30 GiB in 30 s
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 2 s, 12 s, 22 s, and the end
    assert lines[0] == (
        "reading checkpoint: 2.0 GiB of 30.0 GiB (7%), 2 of 30 tensors, 1.0 GiB/s, eta 00:28"
    )
    assert lines[-1] == (
        "reading checkpoint: 30.0 GiB of 30.0 GiB (100%), 30 of 30 tensors, 1.0 GiB/s, "
        "done in 00:30"
    )


def test_a_terminal_gets_a_bar_with_bytes_per_second():
    out, clock = io.StringIO(), Clock()
    p = ByteProgress(live=True, stream=out, clock=clock, quiet_for=2.0)
    p.start(4 << 30, 4)
    clock.t = 3.0
    p.advance("a", 1 << 30)
    assert p._bar is not None  # the bar runs while the read goes on
    for name in "bcd":
        p.advance(name, 1 << 30)
    p.finish()
    assert p._bar is None  # and is gone when it ends (transient)

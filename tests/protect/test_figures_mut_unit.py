"""The log window's course loss at its boundary (ampctl.protect.figures): a window that began at
the scaler's last update has no step of its own yet, so it has no course (mutation survivors of
issue #31)."""

from __future__ import annotations

from ampctl.protect.figures import LogWindow
from tests.protect.recorded import row, scaler_with


def test_a_window_that_began_at_the_last_update_has_no_course_loss_yet():
    scaler = scaler_with([row(loss=2.0), row(loss=3.0)])
    assert scaler.num_updates == 2
    assert LogWindow(first_update=2).course_loss(scaler) is None
    assert LogWindow(first_update=2).loss(scaler) == (0.0, 0.0)
    course = LogWindow(first_update=1).course_loss(scaler)  # one step since: update 2
    assert (course[0].item(), course[1].item()) == (3.0, 1.0)

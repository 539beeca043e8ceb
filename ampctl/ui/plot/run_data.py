"""A run folder read for drawing: metrics, events, summary, the exact skipped steps from the
latest checkpoint's scaler history, and the branches a resume set aside.

Each file is read in one streaming pass (:func:`ampctl.runlog.iter_jsonl`: a per-line cap,
never a whole-file cap) and reduced as it is read to what the figure can show
(:mod:`.decimate`): memory is bounded by the figure's resolution and the caps below, never by
the run's length. A value that is not a number (``"x"``, ``true``, a list) is a missing value."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ampctl.errors import UsageError
from ampctl.runlog import BranchInfo, RunLayout, list_branches, read_json
from ampctl.runlog.readers import iter_jsonl

from . import decimate
from .common import EVENT_STYLE, RESTORING, _dnum, _num
from .decimate import Decimator, Marks

KEYS = (
    "loss",
    "scale",
    "overflow_rate",
    "grad_norm",
    "grad_underflow_frac",
    "act_grad_underflow_frac",
)
EVENT_CAP = 500  # guard decisions drawn one by one; beyond, one line per pixel column and kind
RESTORE_CAP = 10_000  # rollbacks/fallbacks placed exactly; beyond, the metrics' skip counts
HISTORY_CAP = 1 << 20  # scaler history records read from a checkpoint (ampctl keeps 1024)
_EVENT_FIELDS = ("kind", "step", "to_step", "from_step", "discarded_steps", "overflow")


@dataclass
class SkipMark:
    """Skipped steps at ``step``: ``count`` of them; ``exact`` when the step is known (scaler
    history), else the logged step that closed an interval with skips (metrics counter)."""

    step: int | float
    scale: float
    count: int
    exact: bool


Restore = tuple[int, int, str, int]  # (decided at step, restored step, kind, steps discarded)


def _int(v: Any) -> int | None:
    """A finite number from a run file as an int; anything else (missing, "x", inf) None."""
    x = _num(v)
    return int(x) if math.isfinite(x) else None


@dataclass
class RunData:
    """What a run folder says, reduced to what the figure draws (no matplotlib needed)."""

    KEYS: ClassVar[tuple[str, ...]] = KEYS  # the metrics series, in Decimator order

    run_dir: Path
    metrics: Decimator
    last_row: dict[str, Any]
    events: list[dict[str, Any]]  # guard decisions drawn one by one (the first EVENT_CAP)
    summary: dict[str, Any] | None
    scale: Decimator | None = None  # the per-step scale line (history), else metrics' scale
    skips: list[SkipMark] = field(default_factory=list)
    skips_grouped: bool = False  # more skip marks than MARK_CAP: one per pixel column, counted
    skip_source: str = "metrics"  # "history" | "history+metrics" | "metrics"
    restores: list[Restore] = field(default_factory=list)
    event_marks: dict[str, Marks] = field(default_factory=dict)  # decisions beyond EVENT_CAP
    overflow_marks: dict[str, Marks] = field(default_factory=dict)  # "gradient"/"forward" ticks
    branches: list[BranchInfo] = field(default_factory=list)  # history set aside by resumes
    notes: list[str] = field(default_factory=list)  # lines that could not be read, ...

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def rows_read(self) -> int:
        return self.metrics.count

    @property
    def decimated(self) -> bool:
        """Whether the figure shows buckets (min/max per pixel column) instead of every row."""
        return self.metrics.decimated or (self.scale is not None and self.scale.decimated)

    def series(self, key: str) -> tuple[list[float], list[float], list[bool]]:
        """(steps, values, kept) of one metrics key: every row in file order while the run is
        short, else the first/min/max/last points per pixel column; missing values are NaN."""
        return self.metrics.series(key)

    def scale_series(self) -> tuple[list[float], list[float], list[bool]]:
        return (self.scale or self.metrics).series("scale")


def _check_run_dir(run_dir: Path, what: str = "run folder") -> Path:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UsageError(
            f"{str(run_dir)!r} does not exist: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not run_dir.is_dir():
        raise UsageError(
            f"{str(run_dir)!r} is a file: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not RunLayout(run_dir).metrics.is_file():
        raise UsageError(
            f"{str(run_dir)!r} has no metrics.jsonl: give a {what} written by ampctl train, "
            "or a sweep folder with results.json"
        )
    return run_dir


class _Events:
    """events.jsonl in one pass: the guard decisions to draw (the first EVENT_CAP, then counts
    per pixel column), overflow ticks, and the rollbacks/fallbacks in order -- where each was
    decided (``from_step``; in runs of ampctl 0.1, the step of the overflow event just before
    it), the step restored, the kind and the steps that ran after the decision and were
    discarded. ``exact`` turns False when a decision step cannot be known (then restores are
    placed at their recorded step)."""

    def __init__(self) -> None:
        self.drawn: list[dict[str, Any]] = []
        self.more: dict[str, Marks] = {}
        self.overflow: dict[str, Marks] = {}
        self.exact: list[Restore] | None = []
        self.placed: list[Restore] = []
        self.restores_over_cap = False
        self._last_overflow: int | None = None

    def add(self, ev: dict[str, Any]) -> None:
        step = _dnum(ev.get("step"))
        if not math.isfinite(step):
            return
        kind = ev.get("kind")
        if not isinstance(kind, str):
            return
        if kind == "overflow":
            self._last_overflow = int(step)
            which = ev.get("overflow", "gradient")
            which = which if which in ("gradient", "forward") else "gradient"
            self.overflow.setdefault(which, Marks()).add(step)
        elif kind in RESTORING:
            self._restore(ev, kind, step)
        if kind not in EVENT_STYLE:
            return
        if len(self.drawn) < EVENT_CAP and not self.more:
            self.drawn.append({k: ev.get(k) for k in _EVENT_FIELDS if k in ev})
        else:
            self.more.setdefault(kind, Marks()).add(step)

    def _restore(self, ev: dict[str, Any], kind: str, step: float) -> None:
        to = _int(ev.get("to_step"))
        if len(self.placed) >= RESTORE_CAP:
            self.restores_over_cap, self.exact = True, None
            return
        self.placed.append((int(step), to if to is not None else int(step), kind, 0))
        if self.exact is None:
            return
        frm = _int(ev.get("from_step"))
        frm = frm if frm is not None else self._last_overflow
        to = to if to is not None else (int(step) if "to_step" not in ev else None)
        if frm is None or to is None or frm <= to:
            self.exact = None
            return
        discarded = _int(ev.get("discarded_steps")) or 0
        self.exact.append((frm, to, kind, max(discarded, 0)))
        self._last_overflow = None


def _latest_scaler_state(run_dir: Path, notes: list[str]) -> dict[str, Any] | None:
    """The scaler state (and step, wall time) of the run's latest checkpoint, or None when the
    folder has none, it cannot be read, or its history is not a list of numbered records. The
    checkpoint is memory-mapped with ``weights_only=True``: only the small scaler tensors are
    actually read, and a history over HISTORY_CAP records is not read at all."""
    import torch

    path = RunLayout(run_dir).latest_checkpoint()
    if path is None:
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        raw = ck["scaler"]["history"]
        if not isinstance(raw, torch.Tensor):
            raw = torch.as_tensor(raw, dtype=torch.float64)
        if raw.numel() > 3 * HISTORY_CAP:
            notes.append(
                f"{path}: the scaler history holds {raw.numel() // 3} records, over the "
                f"{HISTORY_CAP} read for a plot: skipped steps come from metrics.jsonl"
            )
            return None
        hist = raw.to(torch.float64).reshape(-1, 3)
        hist = hist[~torch.isnan(hist[:, 0])]  # the ring buffer's unused rows
        if not bool(torch.isfinite(hist).all()):
            return None
        u = hist[:, 0]
        if u.numel() and (bool((u < 1).any()) or bool((u != u.round()).any())):
            return None
        if u.numel() > 1 and not bool((u[1:] > u[:-1]).all()):
            return None
        step = int(ck["step"])
        total = ck["scaler"].get("skipped_total", float((hist[:, 2] > 0).sum()))
        wall = _num((ck.get("trainer") or {}).get("wall_s", math.inf))
        return {
            "step": step,
            "skipped_total": int(total),
            "wall_s": wall if not math.isnan(wall) else math.inf,
            "history": hist.tolist(),
        }
    except Exception:  # noqa: BLE001 - a broken checkpoint only costs the exact skip steps
        return None


class _UpdateMap:
    """Trainer step of each scaler update 1..n: one step per update; after a restore decided at
    step ``frm`` (and ``discarded`` more steps that already ran), back to the restored step (the
    scaler keeps counting through them). Built from the restores alone, as segments (never a
    loop over a step range a file claims): update ``u`` of the segment starting at update
    ``u0`` ran trainer step ``t0 + (u - u0)``."""

    def __init__(self, restores: list[Restore]) -> None:
        self.u0, self.t0 = [1], [1]
        for frm, to, _kind, discarded in restores:
            u0, t0 = self.u0[-1], self.t0[-1]
            if frm < t0:  # never reached again: the later restores do not apply either
                break
            back = u0 + (frm + discarded - t0)  # the update after which the step goes back
            self.u0.append(back + 1)
            self.t0.append(to + 1)

    def __call__(self, u: int) -> int:
        i = bisect.bisect_right(self.u0, u) - 1
        return self.t0[i] + (u - self.u0[i])


def _skips_between(
    prev: float, s: float, below: float, above: float
) -> int:  # skips since the previous row that fall at/below ``below`` or beyond ``above``
    n = max(0.0, min(s, below) - min(prev, below)) + max(0.0, s - max(prev, above))
    return int(n) if math.isfinite(n) else 0


def _stream_branch_loss(path: Path) -> Decimator:
    dec = Decimator(("loss",))
    for r in iter_jsonl(path):
        s = _dnum(r.get("step"))
        if math.isfinite(s):
            dec.add(s, (_dnum(r.get("loss")),))
    return dec


def load_run_data(run_dir: str | Path, foreign: Any = None) -> RunData:
    """Read a run folder: metrics, events, summary, and the exact skipped steps and per-step
    scale from the latest checkpoint's scaler history when it is there and consistent with the
    events; otherwise skips per log interval from the metrics. One streaming pass per file,
    memory bounded by the figure's resolution. Raises UsageError for a missing folder, no
    metrics.jsonl, or no rows. Reads the checkpoint on the CPU (no device). ``foreign``:
    ``foreign(run_dir, RunData)``, another tool's log beside a folder that has no metrics.jsonl
    (#40: ``ampctl plot`` passes diagnose's readers), or None."""
    if foreign is not None and (data := foreign(run_dir, RunData)) is not None:
        return data
    run_dir = _check_run_dir(Path(run_dir))
    lay = RunLayout(run_dir)
    notes: list[str] = []

    ev_stream = iter_jsonl(lay.events)
    evs = _Events()
    for e in ev_stream:
        evs.add(e)
    if ev_stream.note(lay.events):
        notes.append(ev_stream.note(lay.events) or "")
    if evs.restores_over_cap:
        notes.append(
            f"{lay.events}: over {RESTORE_CAP} rollbacks/fallbacks: they are marked at their "
            "recorded steps and skipped steps come from metrics.jsonl"
        )
    restores = evs.exact

    # the checkpoint's history first, so the metrics pass can place it in the scale line
    st = _latest_scaler_state(run_dir, notes)
    hist_ok, tmap = False, None
    if st is not None and st["history"] and restores is not None:
        tmap = _UpdateMap(restores)
        hist_ok = tmap(int(st["history"][-1][0])) == st["step"]

    metrics = Decimator(KEYS)
    m_stream = iter_jsonl(lay.metrics)
    last_row: dict[str, Any] | None = None
    approx = Marks()  # skips per log interval (metrics counter)
    exact = Marks()
    scale_line: Decimator | None = None
    if hist_ok:
        hist = st["history"]
        first_t = tmap(int(hist[0][0]))
        covered = sum(1 for r in hist if r[2] > 0)
        below = st["skipped_total"] - covered  # skips older than the history ring buffer
        above = st["skipped_total"]  # skips beyond the checkpoint
        wall = st["wall_s"]
        scale_line = Decimator(("scale",))
        hist_fed = False

        def feed_history() -> None:
            for u, scale, sk in hist:
                t = tmap(int(u))
                scale = _dnum(scale)
                scale_line.add(t, (scale,))
                if sk > 0:
                    exact.add(t, scale)
    else:
        below = above = math.inf
    prev = 0.0
    for r in m_stream:
        step = _dnum(r.get("step"))
        if not math.isfinite(step):
            continue
        last_row = r
        scale = _dnum(r.get("scale"))
        metrics.add(step, [_dnum(r.get(k)) for k in KEYS])
        s = _num(r.get("skipped"))
        if s != prev and math.isfinite(s):  # the counter moved (rare): skips to mark
            n = _skips_between(prev, s, below, above)
            if n > 0:
                approx.add(step, scale, n)
            prev = max(prev, s)
        if scale_line is not None:
            elapsed = _num(r.get("elapsed_s"))
            if elapsed > wall:  # logged after the checkpoint
                if not hist_fed:
                    feed_history()
                    hist_fed = True
                scale_line.add(step, (scale,))
            elif step < first_t and elapsed <= wall:  # the part the ring buffer forgot
                scale_line.add(step, (scale,))
    if scale_line is not None and not hist_fed:
        feed_history()
    if last_row is None:
        if m_stream.error is not None:
            raise UsageError(f"{str(lay.metrics)!r}: unreadable: {m_stream.error}")
        raise UsageError(
            f"{str(lay.metrics)!r} is empty: nothing to plot yet (a row is written every "
            "trainer.log_every steps)"
        )
    if m_stream.note(lay.metrics):
        notes.insert(0, m_stream.note(lay.metrics) or "")

    data = RunData(
        run_dir=run_dir,
        metrics=metrics,
        last_row=last_row,
        events=evs.drawn,
        summary=read_json(lay.summary),
        scale=scale_line,
        event_marks=evs.more,
        overflow_marks=evs.overflow,
        notes=notes,
    )
    data.branches = [b for b in list_branches(lay) if RunLayout(b.path).metrics.is_file()]
    data.restores = restores if restores is not None else evs.placed
    skips = [SkipMark(s, y, c, True) for s, y, c in exact.marks()]
    skips += [SkipMark(s, y, c, False) for s, y, c in approx.marks()]
    data.skips = skips
    data.skips_grouped = exact.is_grouped or approx.is_grouped
    if data.skips_grouped:
        notes.append(
            f"{exact.total + approx.total} skipped steps: over {decimate.MARK_CAP} marks, drawn as one "
            "mark per pixel column with its count"
        )
    if hist_ok:
        data.skip_source = "history+metrics" if len(approx) else "history"
    return data


def branch_loss(branch: BranchInfo) -> Decimator:
    """A set-aside branch's loss, streamed and reduced like the run's own."""
    return _stream_branch_loss(RunLayout(branch.path).metrics)

"""Reading one trial folder (data only: nothing named in it is imported or evaluated) and turning
what a trial process left behind into a results row with a status.

A trial is evaluated *at a step*: the end of the rung it ran (its metrics row there, the events
up to there). With ``--halving`` a trial that went on to later rungs still has its earlier rungs'
rows, so a resumed sweep re-reads every rung's figures from the folders and takes the same
promotion decisions again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampctl.config import RunConfig
from ampctl.runlog import RunLayout, RunRecord, as_number, is_finite_number, read_json
from ampctl.runlog.readers import read_config_text

from .plan import SweepPlan, Trial

__all__ = [
    "COLUMNS",
    "FINISHED",
    "TRIAL_RECORD",
    "PieceResult",
    "read_trial",
    "trial_row",
    "blank_row",
    "config_diff",
    "reached_step",
    "tail",
]

FINISHED = ("ok", "aborted")  # summary.json statuses of a process that ran to its end
TRIAL_RECORD = "sweep_trial.json"  # what the sweep recorded about a trial (exit code, node, ...)
STDERR_TAIL_LINES = 20

# results.csv / results.json columns; the swept keys other than init_scale/growth_interval are
# inserted after growth_interval (by their override key, e.g. ``optim.lr``).
COLUMNS = [
    "rank",
    "trial",
    "kind",
    "status",
    "reason",
    "init_scale",
    "growth_interval",
    "precision",
    "rung",
    "steps",
    "steps_spent",
    "skipped",
    "overflow_rate",
    "final_scale",
    "first_overflow_step",
    "final_loss",
    "reference",
    "reference_loss",
    "loss_gap",
    "steps_per_s",
    "wall_time_s",
    "max_grad_amax",
    "rollbacks",
    "fallbacks",
    "exit_code",
    "stderr_tail",
    "run_dir",
]


def plan_columns(plan: SweepPlan) -> list[str]:
    i = COLUMNS.index("growth_interval") + 1
    return COLUMNS[:i] + plan.extra_keys + COLUMNS[i:]


def _step_of(row: dict[str, Any]) -> int | None:
    s = as_number(row.get("step"))
    return int(s) if s is not None else None


def reached_step(run_dir: Path) -> int:
    """The furthest step a trial folder recorded (summary or metrics), 0 when none."""
    s = as_number((read_json(RunLayout(run_dir).summary) or {}).get("steps"))
    rows = RunRecord.read(run_dir).metrics.rows
    last = max((_step_of(r) or 0 for r in rows), default=0)
    return max(int(s) if s is not None else 0, last)


def read_trial(run_dir: str | Path, at_step: int | None = None) -> dict[str, Any]:
    """The figures of one trial folder at ``at_step`` (default: its last logged row): the metrics
    row there (loss, skipped, scale, elapsed time), the first overflow up to there, the largest
    finite fp16 ``grad_amax`` up to there, event counts, and the summary's status.

    The first overflow is the step of the first ``overflow`` event; runs without those events
    fall back to the first metrics row whose skipped count is non-zero (an upper bound: rows are
    written every ``log_every`` steps). Pure file reading, no torch."""
    run_dir = Path(run_dir)
    full = RunRecord.read(run_dir)
    last = max((_step_of(r) or 0 for r in full.metrics.rows), default=None)
    step = at_step if at_step is not None else last
    rec = RunRecord.read(run_dir, upto_step=at_step) if at_step is not None else full
    s = full.summary or {}
    row = next((r for r in reversed(rec.metrics.rows) if _step_of(r) == step), None)
    first = next(
        (
            int(e["step"])
            for e in rec.events
            if e.get("kind") == "overflow" and is_finite_number(e.get("step"))
        ),
        None,
    )
    if first is None:
        first = next(
            (_step_of(r) for r in rec.metrics if (as_number(r.get("skipped")) or 0) > 0), None
        )
    amax = [
        float(r["grad_amax"])
        for r in rec.metrics
        if r.get("precision") in ("fp16", "fp16-pure")
        and is_finite_number(r.get("grad_amax"))
        and float(r["grad_amax"]) > 0
    ]
    counts: dict[str, int] = {}
    for e in rec.events:
        counts[str(e.get("kind"))] = counts.get(str(e.get("kind")), 0) + 1
    abort = next(
        (e.get("message") for e in reversed(rec.events.rows) if e.get("kind") == "abort"), None
    )
    r = row or {}
    wall = as_number(r.get("elapsed_s"))
    skipped = as_number(r.get("skipped"))
    # steps attempted: a rollback replays the steps it rewinds (as summary.json's overflow_rate)
    rewound = sum(
        max(0.0, (as_number(e.get("from_step")) or 0) - (as_number(e.get("to_step")) or 0))
        for e in rec.events
        if e.get("kind") == "rollback"
    )
    attempts = (step or 0) + rewound
    return {
        "summary_status": s.get("status"),
        "summary_steps": as_number(s.get("steps")),
        "has_row": row is not None,
        "precision": r.get("precision", s.get("precision")),
        "steps": step if row is not None else None,
        "skipped": int(skipped) if skipped is not None else None,
        "overflow_rate": (skipped / attempts) if skipped is not None and attempts else None,
        "final_scale": as_number(r.get("scale")),
        "first_overflow_step": first,
        "final_loss": as_number(r.get("loss")),
        "steps_per_s": (step / wall) if step and wall else None,
        "wall_time_s": wall,
        "max_grad_amax": max(amax) if amax else None,
        "amax_rows": len(amax),
        "rollbacks": counts.get("rollback", 0),
        "fallbacks": counts.get("fallback", 0),
        "abort_message": abort,
        "notes": full.notes(),
    }


def tail(path: Path, lines: int = STDERR_TAIL_LINES, chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def blank_row(plan: SweepPlan, trial: Trial, status: str = "pending") -> dict[str, Any]:
    """A row with the trial's identity and no figures yet."""
    row: dict[str, Any] = {c: None for c in plan_columns(plan)}
    row.update(
        trial=trial.name,
        kind=trial.kind,
        status=status,
        run_dir=str(plan.sweep_dir / trial.name),
        rung=0,
        steps_spent=0,
    )
    for k in plan.extra_keys:
        row[k] = trial.swept.get(k)
    if trial.kind == "trial":
        row["init_scale"] = trial.cfg.scaler.init_scale
        row["growth_interval"] = trial.cfg.scaler.growth_interval
    return row


@dataclass
class PieceResult:
    """How one ``ampctl train`` process of a trial ended, as the sweep saw it."""

    exit_code: int | None  # None: not known (found finished on resume, or the launcher failed)
    target: int  # the step it was to reach (trainer.stop_at of that process)
    rung: int = 0
    error: str = ""  # what the launcher saw when the trial or its node died
    stderr_tail: str = ""
    stopped: str = ""  # "ctrl-c", or the divergence reason when the sweep stopped it


def trial_row(plan: SweepPlan, trial: Trial, piece: PieceResult) -> dict[str, Any]:
    """The results row of ``trial`` at ``piece.target`` (its status before gaps and ranking are
    known), after a process that was to reach that step ended (``piece.exit_code`` known), or
    as found in its folder on resume (``exit_code`` None): then a trial that went past the step
    is evaluated there, so earlier rungs read the same as when they ran."""
    run_dir = plan.sweep_dir / trial.name
    row = blank_row(plan, trial, status="crashed")
    row.update(rung=piece.rung, exit_code=piece.exit_code, stderr_tail="")
    info = read_trial(run_dir, at_step=piece.target) if run_dir.is_dir() else None
    if info is not None and not info["has_row"]:
        info = read_trial(run_dir)  # its last row: how far it got
    st = info["summary_status"] if info else None
    reached = reached_step(run_dir) if info else 0
    code = piece.exit_code
    at_target = bool(info and info["has_row"] and info["steps"] == piece.target)
    if code is None and not piece.error:  # found on resume
        done_ok = at_target and (reached > piece.target or (st == "ok" and reached == piece.target))
        if done_ok or st in FINISHED:
            code = row["exit_code"] = 0 if done_ok or st == "ok" else 1
    else:
        done_ok = at_target and code == 0 and st == "ok" and reached == piece.target
    if info is not None:
        row.update({k: info[k] for k in row if k in info and k != "rung"})
        row["_amax_rows"] = info["amax_rows"]
        row["steps_spent"] = reached
    row["status"], row["reason"] = _classify(piece, info, code, done_ok, reached)
    if row["status"] == "crashed":
        row["stderr_tail"] = piece.stderr_tail or tail(run_dir / "stderr.log")
    return row


def _classify(
    piece: PieceResult, info: dict[str, Any] | None, code: int | None, done_ok: bool, reached: int
) -> tuple[str, str]:
    st = info["summary_status"] if info else None
    if piece.stopped and piece.stopped != "ctrl-c":
        return "diverged", piece.stopped
    if done_ok:
        loss = info["final_loss"] if info else None
        if not is_finite_number(loss):
            return "diverged", f"loss {loss} at step {piece.target}"
        return "ok", ""
    if st == "aborted" and code == 1:
        msg = info["abort_message"] if info else None
        return "diverged", "aborted by the guard" + (f": {msg}" if msg else "")
    if piece.stopped == "ctrl-c":
        return "interrupted", "stopped by Ctrl-C; continued on resume"
    if piece.error:
        return "crashed", piece.error
    if st == "interrupted":
        return "interrupted", "stopped by a signal; continued on resume"
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    if st is None:
        return "crashed", f"{how}, no summary.json"
    if code == 0:
        return "crashed", f"{how} but the run reached step {reached}, not {piece.target}"
    return "crashed", f"{how} (summary status {st})"


def config_diff(
    path: Path, cfg: RunConfig, ignore: tuple[str, ...] = ("trainer.runs_dir",)
) -> tuple[str, Any, Any] | None:
    """The first key whose value differs between the run's ``config.yaml`` and ``cfg``, as
    ``(key, value in the file, value in cfg)``; None when they agree or the file is unreadable.
    The file is read as data (interpolations are not evaluated). Keys in ``ignore`` and keys
    present on one side only (a newer schema) are not compared."""
    old = read_config_text(path) if path.is_file() else None
    if old is None:
        return None
    new = cfg.to_dict()

    def flat(d: Any, p: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flat(v, f"{p}{k}."))
            return out
        return {p[:-1]: d}

    a, b = flat(old), flat(json.loads(json.dumps(new, default=str)))
    diff = sorted(k for k in set(a) & set(b) if k not in ignore and a[k] != b[k])
    return (diff[0], a[diff[0]], b[diff[0]]) if diff else None

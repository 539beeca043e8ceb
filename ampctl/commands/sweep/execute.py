"""Running a sweep: rungs of trial processes through a launcher, watched live, collected into
rows, ranked, written.

One rung after another (without ``--halving`` there is one, of the full steps): every trial of the
rung and every baseline runs to the rung's step -- a new ``ampctl train --name TRIAL`` process,
or ``ampctl train --resume TRIAL_DIR trainer.stop_at=STEP`` for a trial that already has a
folder (the next rung, an interrupted trial) -- ``--jobs`` at a time through the launcher. While
they run the sweep reads their metrics rows: a trial whose loss is not finite or far above the
reference at the same step (:data:`~.rank.STOP_GAP`) is stopped at once. When the rung is done the
best 1/ETA continue to the next rung; the others are ``stopped``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from ampctl.config import ConfigError
from ampctl.files import open_append, touch
from ampctl.runlog import RunLayout, as_number, atomic_write_text, read_json
from ampctl.runlog.layout import checkpoint_step
from ampctl.runlog.lock import LOCK_NAME, lock_run
from ampctl.trust import find_targets, is_shipped_target

from .launchers import KILL_GRACE_S, Launcher, LauncherOptions, Outcome, TrialJob, make_launcher
from .plan import SweepPlan, Trial, plan_sweep
from .rank import (
    DIVERGE_GAP,
    STOP_GAP,
    finalize_rows,
    live_divergence,
    recommend,
    s_star,
    scale_target,
    select_promoted,
)
from .render import View, print_report
from .report import SweepResult, report_lines, write_results
from .trial import TRIAL_RECORD, PieceResult, blank_row, config_diff, tail, trial_row

__all__ = ["sweep", "run_sweep", "SweepRun"]

POLL_S = 0.05
WATCH_S = 1.0  # live rows are read (and the table redrawn) at most this often


def _quote_value(v: str) -> str:
    """A string as a Hydra override value (quoted when it has characters Hydra would parse)."""
    if re.fullmatch(r"[A-Za-z0-9_/.:~-]+", v):
        return v
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _move_aside(path: Path) -> Path:
    i = 1
    while True:
        dst = path.with_name(f"{path.name}.incomplete-{i}")
        if not dst.exists():
            path.rename(dst)
            return dst
        i += 1


class _MetricsTail:
    """The rows of a growing metrics.jsonl, read incrementally (``{step: row}``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, {}
        self._rest = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # rewritten (trimmed on resume): read it again
            self.offset, self.rows, self._rest = 0, {}, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self._rest + f.read()
        self.offset = size
        *lines, self._rest = data.split(b"\n")
        new = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill: skipped, as everywhere
            step = as_number(row.get("step")) if isinstance(row, dict) else None
            if step is not None:
                self.rows[int(step)] = row
                new.append(row)
        return new


@dataclass
class _Piece:
    """One ``ampctl train`` process of a trial, submitted to the launcher."""

    trial: Trial
    rung: int
    target: int
    start: int  # the step it resumed from (0 for a new run)
    job: TrialJob
    handle: Any
    threads: int
    stopped: str = ""  # "ctrl-c", or the divergence reason when the sweep stopped it
    checked: int = 0  # live rows checked up to this step


class SweepRun:
    """One invocation of a sweep: see the module docstring. Built by :func:`sweep`."""

    def __init__(
        self,
        plan: SweepPlan,
        launcher: Launcher,
        *,
        jobs: int | None,
        threads: int | None,
        diverge_gap: float,
        stop_gap: float,
        view: View,
        on_result: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.plan, self.launcher, self.view = plan, launcher, view
        self.jobs, self.threads = jobs, threads
        self.diverge_gap, self.stop_gap = diverge_gap, stop_gap
        self.on_result = on_result
        self.logs = plan.sweep_dir / "_logs"
        self.rows = {t.name: blank_row(plan, t) for t in plan.trials}
        self.tails: dict[str, _MetricsTail] = {}
        self.running: list[_Piece] = []
        self.groups = {t.name: t.group for t in plan.trials if t.kind == "trial"}
        self.result = SweepResult(plan=plan, rows=[], ranking=[], recommendation=None, s_star=None)
        self.result.launcher = launcher.name
        self._last_watch = 0.0
        self.target: float | None = None  # the init_scale ties are broken towards (S*)

    # ------------------------------------------------------------------ the story
    def run(self) -> SweepResult:
        plan = self.plan
        entering = [t for t in plan.trials if t.kind == "trial"]
        self.refresh()
        self.view.start(self.result.rows, self.expected_runs())
        try:
            for k, budget in enumerate(plan.budgets):
                self.run_rung(k, budget, entering)
                if k < plan.top_rung:
                    entering = self.promote(k, budget, entering)
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.stop_running()
        finally:
            self.kill_leftovers()
            self.view.stop()
            self.launcher.close()
        self.refresh()
        return self.result

    def expected_runs(self) -> int:
        """Trial processes a full run of the plan takes (rung sizes + baselines per rung)."""
        n = sum(t.kind == "trial" for t in self.plan.trials)
        nb = len(self.plan.trials) - n
        total = 0
        for _ in self.plan.budgets:
            total += n + nb
            n = max(1, n // (self.plan.halving or 1))
        return total

    def run_rung(self, k: int, budget: int, entering: list[Trial]) -> None:
        queue: deque[Trial] = deque()
        for t in [t for t in self.plan.trials if t.kind == "baseline"] + entering:
            row = self.found_done(t, k, budget)
            if row is None:
                queue.append(t)
            else:
                self.rows[t.name] = row
                if t.name not in self.result.launched and t.name not in self.result.reused:
                    self.result.reused.append(t.name)
                    self.view.done += 1
        self.refresh()
        n = self.launcher.in_flight(self.jobs, len(queue))
        threads = self.threads or self.launcher.threads(n)
        while queue or self.running:
            while queue and len(self.running) < n:
                self.launch(queue.popleft(), k, budget, threads)
            time.sleep(POLL_S)
            for p in list(self.running):
                out = self.launcher.poll(p.handle)
                if out is not None:
                    self.running.remove(p)
                    self.finish(p, out)
            if time.perf_counter() - self._last_watch > WATCH_S:
                self.watch()

    def promote(self, k: int, budget: int, entering: list[Trial]) -> list[Trial]:
        """The best 1/ETA of rung ``k`` continue; the other ok trials are ``stopped``."""
        self.refresh()
        n_next = max(1, len(entering) // (self.plan.halving or 1))
        rung_rows = [self.rows[t.name] for t in entering]
        promoted = select_promoted(rung_rows, n_next, self.target)
        for r in rung_rows:
            if r["trial"] in promoted:
                _mark(r, "pending", f"promoted to rung {k + 1}")
                r["rung"] = k + 1
            elif r["status"] == "ok":
                _mark(r, "stopped", f"not promoted after rung {k} ({budget} steps)")
        self.result.rungs.append(
            {"rung": k, "steps": budget, "trials": len(entering), "promoted": promoted}
        )
        nxt = self.plan.budgets[k + 1]
        ties = len(promoted) - n_next if len(promoted) > n_next else 0
        self.view.say(
            f"Rung {k} ({budget} steps) done: {len(promoted)} of {len(entering)} continue to "
            f"rung {k + 1} ({nxt} steps)"
            + (f" ({ties} tie with the last of the best {n_next})" if ties else "")
            + f": {', '.join(promoted) or '(none)'}"
        )
        self.refresh()
        return [self.plan.trial(n) for n in promoted]

    # ------------------------------------------------------------------ one trial
    def found_done(self, t: Trial, k: int, budget: int) -> dict[str, Any] | None:
        """The trial's row when its folder already holds this rung's result (a resumed sweep, or
        a trial the sweep stopped as diverged), else None: it has to run."""
        run_dir = self.plan.sweep_dir / t.name
        if not run_dir.is_dir():
            return None
        rec = read_json(run_dir / TRIAL_RECORD) or {}
        if rec.get("stopped_by_sweep") and rec.get("rung") == k:
            piece = PieceResult(
                rec.get("exit_code"), int(rec.get("target") or budget), k, stopped=rec["reason"]
            )
            return trial_row(self.plan, t, piece)
        row = trial_row(self.plan, t, PieceResult(None, budget, k))
        return row if row["status"] in ("ok", "diverged") else None

    def command(self, t: Trial, budget: int, resume: bool) -> list[str]:
        """The ``ampctl train`` command of one rung of a trial: it runs to ``budget`` with
        ``trainer.stop_at`` (the lr schedule keeps the full run's horizon, so a trial run in
        rungs trains as the run the user will do), resumed from its own checkpoint after the
        first rung."""
        plan = self.plan
        run_dir = plan.sweep_dir / t.name
        full = t.cfg.trainer.max_steps
        stop = [f"trainer.stop_at={budget if budget != full else 'null'}"]
        if resume:
            # the user composed this config: its own _target_s are allowed on the resume
            cfg = t.cfg.to_dict()
            targets = [f"{k}={v}" for k, v in find_targets(cfg) if not is_shipped_target(v)]
            args = ["--resume", str(run_dir), *stop, *targets]
        else:
            stop = stop if budget != full else []
            args = [*t.overrides, *stop, f"trainer.runs_dir={_quote_value(str(plan.sweep_dir))}"]
            args += ["--name", t.name]
            if plan.config_dir is not None:
                args += ["--config-dir", str(plan.config_dir)]
        return ["-m", "ampctl", "train", *args, "--quiet"]

    def resumable(self, t: Trial, lay: RunLayout) -> tuple[bool, int]:
        """Whether a trial folder continues from its newest checkpoint, and from which step: one
        that ended between rungs or by a signal (it wrote its summary), or one killed with no
        time to write anything more (SIGKILL, a node lost: a checkpoint but no summary) whose
        ``config.yaml`` is the one this sweep validated. Others start again from scratch."""
        latest = lay.latest_checkpoint() if lay.root.is_dir() else None
        if latest is None:
            return False, 0
        if lay.summary.is_file():
            return True, int(as_number((read_json(lay.summary) or {}).get("steps")) or 0)
        ignore = ("trainer.runs_dir", "trainer.stop_at")
        if not lay.config.is_file() or config_diff(lay.config, t.cfg, ignore=ignore) is not None:
            return False, 0
        return True, checkpoint_step(latest) or 0

    def launch(self, t: Trial, k: int, budget: int, threads: int) -> None:
        run_dir = self.plan.sweep_dir / t.name
        lay = RunLayout(run_dir)
        resume, start = self.resumable(t, lay)
        if resume:
            self.result.resumed.append(t.name)
        elif run_dir.exists():
            self.result.moved_aside.append(_move_aside(run_dir).name)
        self.tails.pop(t.name, None)
        self.logs.mkdir(exist_ok=True)
        job = TrialJob(
            name=t.name,
            args=self.command(t, budget, resume),
            env={
                "OMP_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1",
            },
            cwd=os.getcwd(),
            sweep_dir=str(self.plan.sweep_dir),
            stdout=str(self.logs / f"{t.name}.stdout.log"),
            stderr=str(self.logs / f"{t.name}.stderr.log"),
            stop_file=str(self.logs / f"{t.name}.stop"),
        )
        for f in (job.stdout, job.stderr, job.stop_file):
            Path(f).unlink(missing_ok=True)
        handle = self.launcher.submit(job)
        self.running.append(_Piece(t, k, budget, start, job, handle, threads, checked=start))
        if t.name not in self.result.launched:
            self.result.launched.append(t.name)
        row = self.rows[t.name]
        _mark(row, "running", "")
        row["rung"] = k
        self.view.refresh()

    def finish(self, p: _Piece, out: Outcome) -> None:
        t = p.trial
        run_dir = self.plan.sweep_dir / t.name
        piece = PieceResult(
            out.exit_code,
            p.target,
            p.rung,
            error=out.error,
            stderr_tail=tail(Path(p.job.stderr)),
            stopped=p.stopped,
        )
        self.keep_logs(p, run_dir)
        row = trial_row(self.plan, t, piece)
        drift = config_diff(
            run_dir / "config.yaml", t.cfg, ignore=("trainer.runs_dir", "trainer.stop_at")
        )
        if drift is not None:  # e.g. a conf/ or --config-dir file edited while the sweep ran
            key, ran, planned = drift
            row.update(
                status="invalid",
                reason=f"ran with {key}={ran} but the sweep validated {key}={planned}: a config "
                "file changed during the sweep; start it again under a new --name",
            )
        if run_dir.is_dir():
            self.record(p, out, row, run_dir)
        self.rows[t.name] = row
        self.refresh()
        self.view.finished(row)
        if self.on_result is not None:
            self.on_result(row)

    def keep_logs(self, p: _Piece, run_dir: Path) -> None:
        """Append the process's logs to the trial folder's stdout.log / stderr.log."""
        Path(p.job.stop_file).unlink(missing_ok=True)
        if not run_dir.is_dir():
            return  # it died before creating its folder: the logs stay in _logs/
        for src, name in ((p.job.stdout, "stdout.log"), (p.job.stderr, "stderr.log")):
            src_p = Path(src)
            if src_p.exists():
                with open_append(run_dir / name) as f:
                    f.write(src_p.read_bytes())
                src_p.unlink()

    def record(self, p: _Piece, out: Outcome, row: dict[str, Any], run_dir: Path) -> None:
        path = run_dir / TRIAL_RECORD
        old = read_json(path) or {}
        piece = {
            "rung": p.rung,
            "target": p.target,
            "resumed_from_step": p.start,
            "exit_code": out.exit_code,
            "error": out.error,
            "node": out.node,
            "launcher": self.launcher.name,
            "threads": p.threads,
            "command": shlex.join(["python", *p.job.args]),
            "stopped": p.stopped,
        }
        doc = {
            "exit_code": out.exit_code,
            "threads": p.threads,
            "command": piece["command"],
            "rung": p.rung,
            "target": p.target,
            "status": row["status"],
            "reason": row["reason"],
            "stopped_by_sweep": bool(p.stopped and p.stopped != "ctrl-c"),
            "pieces": list(old.get("pieces", [])) + [piece],
        }
        atomic_write_text(path, json.dumps(doc, indent=2, default=str) + "\n")

    # ------------------------------------------------------------------ watching
    def tail_of(self, name: str) -> _MetricsTail:
        if name not in self.tails:
            self.tails[name] = _MetricsTail(RunLayout(self.plan.sweep_dir / name).metrics)
        return self.tails[name]

    def reference(self, t: Trial, step: int) -> tuple[float | None, str]:
        """The loss a trial's row at ``step`` is compared with while it runs: its baseline's at
        that step, or (without baselines) the lowest among the other trials' of its group."""
        if t.group:
            row = self.tail_of(t.group).rows.get(step)
            return (as_number(row.get("loss")) if row else None), t.group
        peers = []
        for o in self.plan.trials:
            if o.kind != "trial" or o.name == t.name or o.group != t.group:
                continue
            if self.rows[o.name]["status"] in ("diverged", "pending"):
                continue
            tl = self.tail_of(o.name)
            if step not in tl.rows:
                tl.read()  # a peer that finished since the last watch
            v = as_number(tl.rows.get(step, {}).get("loss"))
            if v is not None and math.isfinite(v):
                peers.append(v)
        return (min(peers) if peers else None), "the best other trial"

    def watch(self) -> None:
        """Read the running trials' new rows: show them, stop a trial that diverged."""
        self._last_watch = time.perf_counter()
        for t in self.plan.trials:
            if t.kind == "baseline":
                self.tail_of(t.name).read()
        for p in self.running:
            tl = self.tail_of(p.trial.name)
            tl.read()
            if tl.rows:
                last = tl.rows[max(tl.rows)]
                self.rows[p.trial.name].update(
                    steps=max(tl.rows),
                    final_loss=as_number(last.get("loss")),
                    skipped=last.get("skipped"),
                    final_scale=as_number(last.get("scale")),
                )
            if p.trial.kind != "trial" or p.stopped:
                continue
            for step in sorted(s for s in tl.rows if s > p.checked):
                ref, label = self.reference(p.trial, step)
                why = live_divergence(step, tl.rows[step].get("loss"), ref, label, self.stop_gap)
                if why is None and ref is None:
                    break  # wait for the reference's row at this step
                p.checked = step
                if why is not None:
                    p.stopped = why
                    self.request_stop(p)
                    self.view.say(f"{p.trial.name}: {why}")
                    break
        self.view.refresh(self.result.rows)

    def request_stop(self, p: _Piece) -> None:
        touch(p.job.stop_file)
        self.launcher.cancel(p.handle)

    # ------------------------------------------------------------------ stopping
    def stop_running(self) -> None:
        """Ctrl-C: ask every running trial to stop (it writes a checkpoint), wait up to
        ``KILL_GRACE_S``, then -- or at a second Ctrl-C -- kill what is left; collect them."""
        for p in self.running:
            p.stopped = p.stopped or "ctrl-c"
            self.request_stop(p)
        deadline = time.perf_counter() + KILL_GRACE_S + 5.0
        try:
            self._collect_until(deadline)
        except KeyboardInterrupt:
            pass
        self.kill_leftovers()

    def _collect_until(self, deadline: float) -> None:
        while self.running and time.perf_counter() < deadline:
            time.sleep(0.1)
            for p in list(self.running):
                out = self.launcher.poll(p.handle)
                if out is not None:
                    self.running.remove(p)
                    self.finish_quietly(p, out)

    def finish_quietly(self, p: _Piece, out: Outcome) -> None:
        """Collect a trial while stopping: no ``on_result``; a failure to read its folder must
        not hide why the sweep is stopping."""
        on_result, self.on_result = self.on_result, None
        try:
            self.finish(p, out)
        except Exception:  # noqa: BLE001 - the row stays as it was; the sweep is ending anyway
            pass
        finally:
            self.on_result = on_result

    def kill_leftovers(self) -> None:
        """Kill what still runs (after the grace period, or after an unexpected error)."""
        if not self.running:
            return
        for p in self.running:
            p.stopped = p.stopped or "ctrl-c"
            self.launcher.cancel(p.handle, force=True)
        try:
            self._collect_until(time.perf_counter() + 10.0)
        except KeyboardInterrupt:
            pass
        for p in list(self.running):
            self.running.remove(p)
            self.finish_quietly(p, Outcome(None, error="killed by the sweep; no answer after"))

    # ------------------------------------------------------------------ results
    def references(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for t in self.plan.trials:
            if t.kind == "baseline":
                tl = self.tail_of(t.name)
                tl.read()
                out[t.name] = {
                    s: v for s, r in tl.rows.items() if (v := as_number(r.get("loss"))) is not None
                }
        return out

    def refresh(self) -> None:
        res, plan = self.result, self.plan
        res.rows = [self.rows[t.name] for t in plan.trials]
        done = [r for r in res.rows if r["status"] not in ("pending", "running")]
        refs = self.references()

        def rank(target: float | None) -> list[str]:
            return finalize_rows(
                done,
                self.diverge_gap,
                self.groups,
                references=refs,
                stop_gap=self.stop_gap,
                top_rung=plan.top_rung,
                target=target,
            )

        rank(None)  # statuses and gaps first: the S* estimate reads the ranked trials
        self.target = scale_target(plan, res.rows)
        res.ranking = rank(self.target)
        res.recommendation = recommend(plan, res.rows, res.ranking, self.target)
        res.s_star = s_star(plan, res.rows, res.recommendation)
        write_results(res, self.diverge_gap)
        self.view.refresh(res.rows)


def _mark(row: dict[str, Any], status: str, reason: str) -> None:
    """Set a row's status as the sweep decided it (not a rule :func:`finalize_rows` re-applies)."""
    row.pop("_base_status", None)
    row.pop("_base_reason", None)
    row.update(status=status, reason=reason)


# ---------------------------------------------------------------------------- entry points
def _check_folder(plan: SweepPlan, budgets: list[int]) -> bool:
    """Refuse to resume a folder that is not this sweep's; returns whether it exists."""
    sdir = plan.sweep_dir
    if not sdir.exists() or {p.name for p in sdir.iterdir()} <= {LOCK_NAME}:
        return False
    meta = read_json(sdir / "sweep.json")
    if meta is None:
        raise ConfigError(
            f"--name {plan.name}: {sdir} exists and is not a sweep folder (no sweep.json); "
            "pick another --name"
        )
    if meta.get("halving") != plan.halving:
        was = f"--halving {meta.get('halving')}" if meta.get("halving") else "no --halving"
        raise ConfigError(
            f"--name {plan.name}: this sweep was run with {was}; give the same to resume it, or "
            "pick another --name"
        )
    for t in plan.trials:
        lay = RunLayout(sdir / t.name)
        summary = read_json(lay.summary)
        if summary is None:
            continue
        d = config_diff(lay.config, t.cfg, ignore=("trainer.runs_dir", "trainer.stop_at"))
        ran = as_number(summary.get("max_steps"))
        if d is None and ran is not None and int(ran) != budgets[-1]:
            d = ("trainer.max_steps", int(ran), budgets[-1])
        if d is not None:
            k, old, new = d
            raise ConfigError(
                f"--name {plan.name}: trial {t.name} in {sdir} was run with {k}={old}, this sweep "
                f"gives {k}={new}; re-run it with the same overrides and --steps, or pick "
                "another --name"
            )
    return True


def _write_meta(plan: SweepPlan, overrides: list[str], launcher: str) -> None:
    doc = {
        "name": plan.name,
        "overrides": list(overrides),
        "steps": plan.steps,
        "baseline": plan.baseline,
        "halving": plan.halving,
        "rung_steps": plan.budgets,
        "launcher": launcher,
        "trials": [{"name": t.name, "kind": t.kind, "overrides": t.overrides} for t in plan.trials],
    }
    atomic_write_text(plan.sweep_dir / "sweep.json", json.dumps(doc, indent=2) + "\n")


def resume_command(
    plan: SweepPlan, overrides: list[str], jobs: int | None, opts: LauncherOptions
) -> str:
    args = ["ampctl", "sweep-scale", *overrides]
    if plan.steps is not None:
        args += ["--steps", str(plan.steps)]
    if jobs is not None and jobs != 1:
        args += ["--jobs", str(jobs)]
    if plan.halving is not None:
        args += ["--halving", str(plan.halving)]
    if plan.baseline is None:
        args.append("--no-baseline")
    if plan.config_dir is not None:
        args += ["--config-dir", str(plan.config_dir)]
    args += opts.args() + ["--name", plan.name]
    return shlex.join(args)


def _intro(run: SweepRun, jobs: int | None) -> str:
    plan = run.plan
    n = sum(t.kind == "trial" for t in plan.trials)
    nb = len(plan.trials) - n
    flight = run.launcher.in_flight(jobs, n + nb)
    line = f"Sweep {plan.sweep_dir}: {n} trials" + (
        f" + {nb} {plan.baseline} baseline{'s' if nb > 1 else ''}" if nb else ""
    )
    line += ", " + run.launcher.describe(flight)
    cores = getattr(run.launcher, "cores", None)
    if cores is not None and jobs is not None and flight < jobs and flight == cores:
        line += f" (--jobs {jobs} capped at {cores} cores)"
    if plan.halving is not None:
        line += (
            f"; successive halving (ETA {plan.halving}): rungs of "
            f"{', '.join(map(str, plan.budgets))} steps"
        )
    return line


def sweep(
    overrides: list[str],
    *,
    steps: int | None = None,
    jobs: int | None = None,
    baseline: bool = True,
    name: str | None = None,
    config_dir: str | Path | None = None,
    halving: int | None = None,
    launcher: str | LauncherOptions = "local",
    diverge_gap: float = DIVERGE_GAP,
    stop_gap: float = STOP_GAP,
    threads: int | None = None,
    console: Console | None = None,
    mode: str = "plain",
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Plan, validate and run a sweep; returns its :class:`SweepResult` (results files written).

    ``name`` of an existing sweep folder resumes it: trials that finished (ok, or diverged) are
    kept, trials with a checkpoint (interrupted, between rungs, or killed: SIGKILL to the
    sweep's process group) continue from their newest checkpoint that loads, other trial folders are renamed ``<trial>.incomplete-N`` and run
    again. ``jobs``: trials in flight (default 1 locally, all with ray/slurm). ``threads`` per
    trial defaults to the launcher's share. ``on_result(row)`` is called after each finished
    trial process (a KeyboardInterrupt raised there acts like Ctrl-C). A KeyboardInterrupt (or
    SIGTERM) stops launching, asks running trials to stop (they checkpoint; killed after
    ``KILL_GRACE_S``), writes the results so far and returns with ``interrupted=True``.
    Raises UsageError for bad input before anything is written. Host-side only; the trials'
    device work happens in their own processes."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs {jobs}: give an integer >= 1")
    if mode not in ("auto", "live", "plain", "quiet"):
        raise ValueError(f"mode must be auto, live, plain or quiet, got {mode!r}")
    opts = launcher if isinstance(launcher, LauncherOptions) else LauncherOptions(launcher)
    opts.validate()
    console = console or Console()
    plan = plan_sweep(
        overrides,
        steps=steps,
        baseline=baseline,
        name=name,
        config_dir=config_dir,
        halving=halving,
    )
    existed = plan.sweep_dir.exists()
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run(
        plan.sweep_dir, what="sweep folder", hint=", then run the same command again to resume it"
    )
    try:
        return _sweep_locked(
            plan,
            lock,
            opts,
            overrides,
            jobs,
            threads,
            diverge_gap,
            stop_gap,
            console,
            mode,
            on_result,
        )
    except BaseException:
        if not existed:  # refused before it began: leave no empty folder behind
            lock.release()
            try:
                plan.sweep_dir.rmdir()
            except OSError:
                pass
        raise
    finally:
        lock.release()


def _sweep_locked(
    plan, lock, opts, overrides, jobs, threads, diverge_gap, stop_gap, console, mode, on_result
) -> SweepResult:
    """:func:`sweep` once the sweep folder is this process's (:func:`lock_run`)."""
    resuming = _check_folder(plan, plan.budgets)
    backend = make_launcher(opts, plan.sweep_dir)
    _write_meta(plan, overrides, opts.launcher)
    view = View(plan, console, mode)
    run = SweepRun(
        plan,
        backend,
        jobs=jobs,
        threads=threads,
        diverge_gap=diverge_gap,
        stop_gap=stop_gap,
        view=view,
        on_result=on_result,
    )
    view.say(_intro(run, jobs))
    if lock.took_over is not None:
        view.say(lock.message())
    old_term = None
    if threading.current_thread() is threading.main_thread():

        def _on_term(signum, frame):  # noqa: ARG001 - treat SIGTERM like Ctrl-C
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, _on_term)
    try:
        result = run.run()
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    if resuming:
        view.say(
            f"Resumed: {len(result.reused)} trial(s) found done, {len(result.resumed)} continued "
            f"from their checkpoint"
            + (f"; moved aside: {', '.join(result.moved_aside)}" if result.moved_aside else "")
        )
    if mode != "quiet":
        lines = report_lines(result, resume_command(plan, overrides, jobs, opts))
        print_report(console, result, lines)
    return result


def run_sweep(
    overrides: list[str],
    steps: int | None,
    jobs: int | None,
    baseline: bool,
    name: str | None,
    config_dir: Path | None,
    mode: str,
    halving: int | None = None,
    launcher: LauncherOptions | None = None,
) -> int:
    """What ``ampctl sweep-scale`` does; returns the exit code (0 a recommendation was made,
    1 no trial finished the full steps ok, 130 interrupted). Bad input raises a UsageError."""
    console = Console()
    if not console.is_terminal:  # files and pipes: room for the table, no wrapping
        console = Console(width=max(console.width, 120))
    result = sweep(
        overrides,
        console=console,
        steps=steps,
        jobs=jobs,
        baseline=baseline,
        name=name,
        config_dir=config_dir,
        mode=mode,
        halving=halving,
        launcher=launcher or LauncherOptions(),
    )
    return result.exit_code

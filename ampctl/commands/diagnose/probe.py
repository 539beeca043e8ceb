"""Advice checked before it is printed (#36): a short probe of the recommended change from the
recommended checkpoint, and, for an lr, a small ladder of candidates from the history
(:attr:`.verdict.LrChange.ladder`) of which the best that holds is recommended.

A probe is ampctl's own protected loop (:class:`ampctl.train.trainer.Trainer`) run for the rest of
the run's warmup and then :data:`PATIENCES` times the divergence rule's patience in log rows of
:data:`PROBE_EVERY` steps (a probe within a warmup would only try lower lrs), in a temporary run
folder that is removed after, from the checkpoint (or, with none before the trouble, from a fresh
start of the run's config) with the change applied; with no change, resuming as it was is tried.
The config is the checkpoint's through the trust rule (:func:`ampctl.config.config_from_saved`);
the data is the run's own when it is synthetic or ``--trust-code`` allows the paths its config
names, else synthetic batches of the run's shape, as the replay does
(:func:`.replay.replay_data`). No sink, plot or activation probe runs.

A candidate *held* when the probe ended ``ok`` (no abort, no divergence) with every row finite
and the mean loss of its last third of rows no higher than
:data:`~ampctl.protect.advice.ABOVE_START` times the loss it started from (:func:`judged`); the
best that held has the lowest such mean. The ladder is walked down while each rung holds better
than the one above, and where its rungs are more than :data:`FINE` apart the lrs halfway around
the best are tried too. Only ampctl runs are probed (the model and the loop are rebuilt from the
checkpoint alone); other formats say why.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["PATIENCES", "PROBE_EVERY", "Trial", "ProbeOutcome", "probe_advice"]

#: Probe length in the divergence rule's patience (rows): long enough for it to fire.
PATIENCES = 4
#: Steps per probe row.
PROBE_EVERY = 2
#: Candidates tried at most, and the wall-clock budget of all probes together (seconds).
MAX_TRIALS = 6
#: Rungs further apart than this factor are refined halfway around the best one.
FINE = 3.0
BUDGET_S = 120.0


@dataclass
class Trial:
    lr: float | None
    status: str
    first: float | None  # the loss it started from (before its first update), else its first row
    last: float | None
    steps: int
    held: bool
    what: str = "the change"  # what was tried, when not an lr ("resumed as it was")

    def words(self) -> str:
        from ampctl.protect.advice import fmt_lr

        lr = f"lr {fmt_lr(self.lr)}" if self.lr is not None else self.what
        how = "held" if self.held else ("did not hold" if self.status == "ok" else self.status)
        figs = (
            f", loss {self.first:.4g} -> {self.last:.4g}"
            if self.first is not None and self.last is not None
            else ""
        )
        return f"{lr}: {how}{figs}"


@dataclass
class ProbeOutcome:
    ran: bool
    reason: str | None = None  # why no probe ran
    origin: str | None = None  # the checkpoint it started from (None: a fresh start)
    steps: int = 0
    data: str | None = None
    trials: list[Trial] = field(default_factory=list)
    chosen: Trial | None = None
    ends: int | None = None  # the run's max_steps, when it cut the probe short

    def line(self) -> str:
        if not self.ran:
            return f"probe: not run: {self.reason}"
        where = f"from {self.origin}" if self.origin else "from a fresh start"
        tried = "; ".join(t.words() for t in self.trials)
        if self.chosen is None:
            verdict = "nothing tried held: the advice below is not known to work"
        else:
            verdict = f"recommended: {self.chosen.words().split(':')[0]}"
        n = f"{self.steps} step" + ("" if self.steps == 1 else "s")
        if self.ends is not None:
            where += f", all the run has left before its max_steps {self.ends}"
        return f"probe ({n} {where}, {self.data}): {tried}. {verdict}"


def _probe_config(
    cfg: Any, overrides: list[str], steps_from: int, trust_code: bool, device: str
) -> tuple[Any, str]:
    from ampctl.config import config_from_saved, with_changes

    run = config_from_saved(cfg.to_dict(), overrides, source="the probe", trust_code=trust_code)
    # the rest of a warmup, then a few patiences at the lr itself (a warmup alone tries lower ones)
    warmup = max(0, int(run.optim.warmup_steps) - steps_from)
    steps = warmup + PATIENCES * int(run.guard.divergence_patience) * PROBE_EVERY
    d = run.data
    label = "the run's data"
    named = [v for v in (d.path, d.tokenizer, d.cache_dir) if v]
    if d.kind != "synthetic" and not trust_code:
        vocab = getattr(run.model, "vocab_size", None) or d.vocab_size
        run = with_changes(
            run,
            data={"kind": "synthetic", "path": None, "tokenizer": None, "vocab_size": vocab},
        )
        label = "synthetic batches of the run's shape (no path the checkpoint names is opened)"
    elif named:
        label += " (opened as --trust-code allows)"
    run = with_changes(
        run,
        trainer={
            "stop_at": min(steps_from + steps, run.trainer.max_steps),
            "log_every": PROBE_EVERY,
            "ckpt_every": 10**9,
            "device": device,
            "compile": False,
        },
        logging={
            "tensorboard": False,
            "mlflow": False,
            "wandb": False,
            "plot": False,
            "act_grads": False,
        },
    )
    return run, label


def _trial(run_cfg: Any, ck: dict[str, Any] | None, lr: float | None) -> Trial:
    from ampctl.runlog import RunLayout
    from ampctl.runlog.readers import iter_jsonl
    from ampctl.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="ampctl-probe-"))
    try:
        with torch.random.fork_rng(devices=[]):
            (tmp / "run").mkdir()
            tr = Trainer(run_cfg, tmp / "run", resume=ck)
            res = tr.run()
        rows = [r for r in iter_jsonl(RunLayout(tmp / "run").metrics) if "loss" in r]
        losses = [r["loss"] for r in rows if isinstance(r.get("loss"), int | float)]
        start = tr.protection.divergence.start  # a fresh start: the loss before any update
        first = start if ck is None and start is not None and math.isfinite(start) else None
        return judged(lr, res.status, first, losses, len(rows) * PROBE_EVERY)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def judged(lr: float | None, status: str, first: float | None, losses: list[float], steps: int):
    """A trial from its logged losses (oldest first; ``first``: the loss before its first
    update, None: its first row). It held when it ended ``ok`` with every loss finite and the
    mean of its last third of rows (one row is noise) no higher than ``ABOVE_START`` times where
    it started."""
    from ampctl.protect.advice import ABOVE_START

    if first is None and losses:
        first = losses[0]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    third = max(1, len(losses) // 3)
    last = sum(losses[-third:]) / third if finite else (losses[-1] if losses else None)
    held = status == "ok" and finite and first is not None and last <= ABOVE_START * first
    return Trial(lr, status, first, last, steps, held)


def probe_advice(
    *,
    fmt: str,
    cfg: Any | None,
    cfg_reason: str | None,
    resume: str | None,
    overrides: list[str],
    ladder: list[float],
    trust_code: bool,
    device: torch.device,
    budget_s: float = BUDGET_S,
    found: Any = None,
    rebuild: str | None = None,
    run_lr: float | None = None,
) -> ProbeOutcome:
    """Probe ``overrides`` (the recommended changes; ``optim.lr`` replaced by each rung of
    ``ladder`` in turn, highest first) from ``resume`` (a checkpoint path; None: a fresh start).
    Goes down the ladder until a rung that held is followed by one that holds no better (or not
    at all), within ``budget_s`` and :data:`MAX_TRIALS`. An ampctl run is retrained by its own
    loop; another tool's by :mod:`.probe_loop` (a Hugging Face folder with ``config.json``, or
    any run whose model the user's ``rebuild`` factory builds). **Syncs** (it trains)."""
    from ampctl.config import ConfigError
    from ampctl.errors import UsageError, first_line
    from ampctl.train.checkpoint import load_checkpoint

    if fmt != "ampctl" or rebuild:
        return _foreign(fmt, found, resume, overrides, ladder, rebuild, run_lr, device, budget_s)
    if cfg is None:
        why = cfg_reason or "the run's config cannot be rebuilt"
        return ProbeOutcome(False, f"{why}: pass --rebuild MODULE:FUNCTION to try the advice")
    ck = None
    if resume is not None:
        try:
            ck = load_checkpoint(Path(resume))
        except (UsageError, OSError, RuntimeError, ValueError) as e:
            return ProbeOutcome(False, f"the checkpoint {resume} cannot be loaded: {first_line(e)}")
        ck.pop("path", None)  # the probe's run folder is its own: nothing is set aside
    steps_from = int(ck["step"]) if ck is not None else 0
    out = ProbeOutcome(True, origin=resume)

    def one(lr: float | None, ov: list[str]) -> Trial:
        run_cfg, out.data = _probe_config(cfg, ov, steps_from, trust_code, str(device))
        out.steps = run_cfg.trainer.stop_at - steps_from
        if out.steps < PATIENCES * PROBE_EVERY * run_cfg.guard.divergence_patience:
            out.ends = run_cfg.trainer.max_steps
        return _trial(run_cfg, ck, lr)

    try:
        return _walk(out, overrides, ladder, one, budget_s)
    except (UsageError, ConfigError, RuntimeError, ValueError, KeyError) as e:
        return ProbeOutcome(False, f"the probe could not be built: {first_line(e)}")


def _walk(out: ProbeOutcome, overrides, ladder, one, budget_s: float) -> ProbeOutcome:
    """The ladder walked with ``one(lr, overrides)`` (a :class:`Trial`) for each rung."""
    from ampctl.protect.advice import fmt_lr

    rest = [o for o in overrides if not o.startswith("optim.lr=")]
    rungs: list[float | None] = list(ladder) or [None]
    t0 = time.perf_counter()
    while rungs and len(out.trials) < MAX_TRIALS and time.perf_counter() - t0 <= budget_s:
        lr = rungs.pop(0)
        ov = [*rest, *([f"optim.lr={fmt_lr(lr)}"] if lr is not None else [])]
        trial = one(float(fmt_lr(lr)) if lr is not None else None, ov)
        if not ov:
            trial.what = "resumed as it was"
        best = min((t for t in out.trials if t.held), key=lambda t: t.last, default=None)
        out.trials.append(trial)
        if best is not None and (not trial.held or trial.last >= best.last):
            # down the ladder while each rung holds better than the one above; then, where the
            # rungs are far apart, the lrs halfway (geometrically) on either side of the best
            rungs = _between(best.lr, ladder, [t.lr for t in out.trials])
    out.chosen = min((t for t in out.trials if t.held), key=lambda t: t.last, default=None)
    return out


def _foreign(fmt, found, resume, overrides, ladder, rebuild, run_lr, device, budget_s):
    """The probe of a run ampctl did not train (:mod:`.probe_loop`), or why none ran."""
    from ampctl.errors import UsageError, first_line
    from ampctl.protect.settings import GuardConfig

    from . import readers
    from .probe_loop import hf_loop, loop_trial, rebuild_loop

    if rebuild is None and (found is None or found.model_dir is None):
        return ProbeOutcome(
            False,
            f"a {fmt} checkpoint stores weights but not how to build its model, and its loop, data and optimizer are your code: pass "
            "--rebuild MODULE:FUNCTION (your factory of the model and its batches) to try the "
            "advice (an ampctl run's, and a Hugging Face folder's with config.json, are tried)",
        )
    try:
        start = readers.read(resume, fmt) if resume is not None else None
        if rebuild is not None:
            loop = rebuild_loop(rebuild, found, start, device)
        else:
            loop = hf_loop(found, start, device)
    except (UsageError, OSError, RuntimeError, ValueError, ImportError) as e:
        return ProbeOutcome(False, f"the model cannot be rebuilt: {first_line(e)}")
    warmup = next(
        (int(o.split("=")[1]) for o in overrides if o.startswith("optim.warmup_steps=")), 0
    )
    steps = warmup + PATIENCES * GuardConfig().divergence_patience * PROBE_EVERY
    loop.lr = run_lr
    out = ProbeOutcome(True, origin=resume, steps=steps, data=loop.data)

    def one(lr: float | None, ov: list[str]) -> Trial:
        status, rows, _ = loop_trial(loop, lr, ov, steps, PROBE_EVERY, device)
        return judged(lr, status, None, rows, steps)

    try:
        return _walk(out, overrides, ladder, one, budget_s)
    except (UsageError, ValueError, KeyError) as e:
        return ProbeOutcome(False, f"the probe could not be built: {first_line(e)}")


def _between(best: float | None, ladder: list[float], tried: list[float | None]) -> list[float]:
    """The lrs geometrically halfway between ``best`` and the rungs beside it, when the ladder's
    spacing is wider than :data:`FINE` (not yet tried), never above its first rung (the highest
    lr the history supports: a short probe favours a high lr that a long run would not hold)."""
    if best is None or len(ladder) < 2 or ladder[0] / ladder[1] <= FINE:
        return []
    from ampctl.protect.advice import fmt_lr

    half = math.sqrt(ladder[0] / ladder[1])
    near = [float(fmt_lr(x)) for x in (best / half, best * half) if x <= 1.01 * ladder[0]]
    return [x for x in near if all(t is None or abs(t / x - 1) > 0.05 for t in tried)]

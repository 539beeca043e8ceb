"""``ampctl sweep-scale``: which loss-scaling settings waste the fewest steps and keep the loss on
track, measured with real training runs -- on this machine, on a Ray cluster or on SLURM, every
trial to the end or by successive halving.

Every trial is a real ``ampctl train`` process (same seed, same data order) in
``runs/<sweep>/<trial>/``; a crash, a NaN or a dead node in one trial never stops the sweep. An
fp32 baseline (bf16 on a CUDA device that has it) is the reference loss. The sweep writes
``results.csv`` and ``results.json`` after every finished trial process, ranks the trials and
prints the best trial's settings as the one command line to paste; under it, as information (not
a second recommendation), the data-driven estimate ``S* = 65504 / max|g|`` and the init_scale it
suggests (:func:`ampctl.amp.formats.recommended_init_scale`, the one definition diagnose uses
too): the trial of the grid that tried it, or the override that adds it to the grid.

The package, one concern per file:

- :mod:`.plan` -- overrides -> trials and baselines (configs validated up front), halving rungs;
- :mod:`.trial` -- one trial folder read as data at a step, and the row/status of a process;
- :mod:`.rank` -- pure: gaps, divergence, ranking, promotion, recommendation, S*;
- :mod:`.report` -- pure: :class:`SweepResult`, results.csv/json, the closing report's lines;
- :mod:`.render` -- rich: the live/ranked table, plain lines;
- :mod:`.run` -- the driver: rungs of processes through a launcher, watched live;
- :mod:`.launchers` -- ``local`` / ``ray`` / ``slurm`` behind submit / poll / cancel.

Status of a trial
-----------------
``ok``: ran the full steps, loss on track; ``stopped`` (``--halving``): finished its rung ok but
was not among the best 1/ETA, so it stopped there; ``diverged``: the guard aborted it, its loss
went non-finite, it was more than ``stop_gap`` (:data:`STOP_GAP` = 50%) above the reference at
any logged step (stopped at once, in any mode), or it ended the full steps more than
``diverge_gap`` (:data:`DIVERGE_GAP` = 10%) above the reference; ``crashed``: a non-zero exit other
than a guard abort, killed, no ``summary.json``, or its node/worker died under the launcher (its
stderr tail is kept); ``interrupted`` / ``pending``: stopped by Ctrl-C / not run yet (both
continued on resume); ``invalid``: the trial's ``config.yaml`` differs from the config validated
before the sweep (a config file was edited while the sweep ran): not comparable, not ranked.

Why 10% at the end: with working loss scaling, fp16 tracks fp32 to within rounding noise -- on
the tiny default model the gap is under 1%, and the seeds' BERT-Large case ends level with its
fp32 baseline. The gap reaches 10% only when training itself went wrong: most steps skipped, a
rollback/fallback storm, or a blow-up the guard only softened (``optim.lr=10``: loss 2665 vs 4.1).
Why 50% while running and before the last rung: early in a run a trial that skipped its first
few steps lags the baseline by those steps, which is a large relative gap while the loss falls
fast but closes by the end; 50% is far beyond that lag and far below a blow-up.

Ranking (:mod:`.rank`): trials that finished their rung ok, the highest rung first; within a
rung by loss gap counted in whole 0.1% steps (:data:`GAP_TIE`; clipped at 0, truncated: any gap
under +0.1% ties with the reference), then fp16 without loss scaling (``init_scale`` <= 1) after
the scaled trials (it is recommended only when strictly best on loss), then fewest skipped steps.
Trials equal on those tie; a tie goes to the init_scale closest to the data-driven S* estimate
(the conventional default 2^16 without one), then the growth_interval closest to 2000 -- never
to steps/s, which moves with machine load -- and the report says who tied and which rule
decided.

Successive halving (``--halving ETA``): rungs end at ``steps / ETA^k`` steps
(:func:`rung_budgets`); every trial runs the first rung; the best ``1/ETA`` of each rung continue
(and any trial that ties with the last of them: a tie break never decides who stops), resumed from their own checkpoints (``ampctl train --resume TRIAL_DIR trainer.stop_at=STEP``),
to the full steps. The baselines run every rung too (each continued from its checkpoint), so
each rung compares trials and baseline at the same step, with the same learning-rate schedule.
Results record each trial's ``rung`` and ``steps_spent``.
"""

from __future__ import annotations

import importlib

#: The package's names by the module that defines them, each imported when first used (PEP 562):
#: the trial's runner (``.launchers.process``), run by a Ray worker or a SLURM job, imports no
#: torch through this package.
_FROM = {
    ".execute": ("run_sweep", "sweep"),
    ".launchers": ("LAUNCHERS", "LauncherOptions", "Outcome", "TrialJob"),
    ".launchers.local": ("threads_per_trial",),
    ".plan": ("DEFAULT_GRID", "SweepPlan", "Trial", "parse_sweep", "plan_sweep", "rung_budgets"),
    ".rank": (
        "DIVERGE_GAP",
        "GAP_TIE",
        "STOP_GAP",
        "finalize_rows",
        "live_divergence",
        "merit",
        "rank_key",
        "tie_info",
    ),
    ".report": ("SweepResult", "trial_steps"),
    ".trial": ("COLUMNS", "PieceResult", "config_diff", "read_trial", "trial_row"),
}
_WHERE = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_WHERE, key=str.lower)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)

"""``ampctl sweep-scale``: which loss-scaling settings waste the fewest steps and keep the loss on
track, measured with real training runs.

Every trial is a real ``ampctl train`` process (same seed, same data order) in
``runs/<sweep>/<trial>/``; a crash or a NaN in one trial never stops the sweep. An fp32 baseline
(bf16 on a CUDA device that has it) is the reference loss. The sweep writes ``results.csv`` and
``results.json`` after every finished trial, ranks the trials and prints the best settings as a
command line ready to paste, next to the data-driven estimate ``S* = 65504 / max|g|``.

Library entry points (the CLI calls :func:`run_sweep`):

- :func:`plan_sweep` expands the overrides (Hydra's own override parser, sweeps as in Hydra's
  BasicSweeper) into :class:`Trial` objects and validates every trial's config up front.
- :func:`sweep` plans, runs the trials (``jobs`` at a time), and returns a :class:`SweepResult`.
- :func:`finalize_rows` (gaps, divergence, ranking) and :func:`ideal_scale` are pure functions.

Status of a trial
-----------------
``ok``; ``diverged``: the guard aborted it, its final loss is not finite, or its final loss is more
than ``diverge_gap`` (default :data:`DIVERGE_GAP` = 10%) above the reference; ``crashed``: a
non-zero exit other than a guard abort, or no ``summary.json`` (its stderr tail is kept);
``interrupted`` / ``pending``: stopped by Ctrl-C / not run yet (both re-run on resume);
``invalid``: the trial's ``config.yaml`` differs from the config validated before the sweep (a
config file was edited while the sweep ran), so it is not comparable and not ranked.

Why 10%: with working loss scaling, fp16 tracks fp32 to within rounding noise -- on the tiny
default model the gap is under 1% (fp16 4.1128 vs fp32 4.1384 after 12 steps), and the seeds'
BERT-Large case ends level with its fp32 baseline. The gap reaches 10% only when training itself
went wrong: most steps skipped (the loss stays near where it started while the baseline learns),
a rollback/fallback storm, or a blow-up the guard only softened (e.g. ``optim.lr=10``: loss 2665
vs 4.1). A lower threshold would flag the ordinary lag of a few skipped steps in a short sweep as
divergence; the gap itself is in the results for a stricter reading.

Ranking: ``ok`` trials only; by loss gap (clipped at 0 -- a loss below the reference is on track
-- and rounded to 0.1%, finer differences are fp16 noise), then fewest skipped steps, then
speed (steps/s).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ampctl.config import ConfigError, RunConfig, load_config, split_overrides
from ampctl.ui.display import fmt_float, fmt_loss, fmt_pct, fmt_scale

__all__ = [
    "COLUMNS",
    "DEFAULT_GRID",
    "DIVERGE_GAP",
    "SweepPlan",
    "SweepResult",
    "Trial",
    "finalize_rows",
    "ideal_scale",
    "plan_sweep",
    "read_trial",
    "run_sweep",
    "sweep",
]

FP16_MAX = 65504.0
DIVERGE_GAP = 0.10  # relative final-loss gap above which a trial counts as diverged (see above)
GAP_TIE = 1e-3  # loss gaps are compared in steps of 0.1% when ranking
DEFAULT_GRID = ["scaler.init_scale=1024,8192,65536", "scaler.growth_interval=100,500,2000"]
SCALE_KEYS = ("scaler.init_scale", "scaler.growth_interval")
FINISHED = ("ok", "aborted")  # summary.json statuses of a finished trial (not re-run on resume)
STDERR_TAIL_LINES = 20
KILL_GRACE_S = 15.0  # after SIGTERM a trial writes a checkpoint; then it is killed

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
    "steps",
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

_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*$")


# ---------------------------------------------------------------------------- planning
@dataclass
class Trial:
    """One training run of the sweep."""

    name: str  # folder name under the sweep folder
    kind: str  # "trial" (fp16, swept scaling) or "baseline"
    swept: dict[str, str]  # swept override key -> value (as the override parser prints it)
    overrides: list[str]  # what ``ampctl train`` gets (trainer.runs_dir is added at launch)
    cfg: RunConfig
    group: str = ""  # the baseline this trial is compared with ("" when none)


@dataclass
class SweepPlan:
    name: str
    sweep_dir: Path
    trials: list[Trial]  # baselines first: their loss is the reference of the others
    swept_keys: list[str]
    fixed: list[str]  # the user's overrides that are not sweeps (conf=NAME included)
    steps: int | None
    baseline: str | None  # the baseline precision, None with --no-baseline
    config_dir: Path | None

    @property
    def extra_keys(self) -> list[str]:
        """Swept keys shown as their own column (init_scale and growth_interval always are)."""
        return [k for k in self.swept_keys if _bare(k) not in SCALE_KEYS]

    @property
    def columns(self) -> list[str]:
        i = COLUMNS.index("growth_interval") + 1
        return COLUMNS[:i] + self.extra_keys + COLUMNS[i:]


def _bare(key: str) -> str:
    """``+a.b`` / ``~a.b`` / ``a.b@pkg`` -> ``a.b``."""
    return key.lstrip("+~").split("@")[0]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def parse_sweep(tokens: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Split override tokens into fixed ones and sweeps ``[(key, [value, ...]), ...]``.

    Uses Hydra's override parser and expands choice/range sweeps the way Hydra's BasicSweeper
    does (``sweep_string_iterator``). ``conf=NAME`` stays in the fixed list. With no sweep at all
    the default grid (:data:`DEFAULT_GRID`) is used for the scaling keys the user did not fix.
    Raises :class:`ConfigError` for unparsable tokens and unsupported sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException, OverrideParseException

    _preset, rest = split_overrides(tokens)
    fixed = [t for t in tokens if t.startswith("conf=")][-1:]
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(rest)
    except OverrideParseException as e:
        raise ConfigError(
            f"cannot parse override: {_first_line(e)} (use key=value, key=a,b,c or key=range(start,stop,step))"
        ) from None
    sweeps: list[tuple[str, list[str]]] = []
    for o in parsed:
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        key = o.get_key_element()
        if not o.is_discrete_sweep() or o.value_type is ValueType.GLOB_CHOICE_SWEEP:
            raise ConfigError(
                f"{o.input_line}: this kind of sweep is not supported; list the values (key=a,b,c) "
                "or use range(start,stop,step)"
            )
        try:
            values = list(o.sweep_string_iterator())
        except HydraException as e:
            raise ConfigError(f"{o.input_line}: {_first_line(e)}") from None
        if not values:
            raise ConfigError(f"{o.input_line}: the sweep has no values; give at least one")
        if any(_bare(k) == _bare(key) for k, _ in sweeps):
            raise ConfigError(f"{_bare(key)} is swept twice; give one sweep per key")
        sweeps.append((key, values))
    if not sweeps:
        fixed_keys = {_bare(t.split("=", 1)[0]) for t in fixed}
        default = [t for t in DEFAULT_GRID if t.split("=", 1)[0] not in fixed_keys]
        if default:
            _, more = parse_sweep(default)
            sweeps = more
    # a swept key replaces the user's fixed value of it (e.g. a preset list with init_scale=1024)
    swept = {_bare(k) for k, _ in sweeps}
    fixed = [t for t in fixed if t.startswith("conf=") or _bare(t.split("=", 1)[0]) not in swept]
    return fixed, sweeps


def _value_text(v: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", v.strip("'\""))


def _trial_names(keys: list[str], combos: list[tuple[str, ...]]) -> list[str]:
    leaves = [_bare(k).split(".")[-1] for k in keys]
    if len(set(leaves)) != len(leaves):
        leaves = [_bare(k) for k in keys]
    names: list[str] = []
    for combo in combos:
        name = ",".join(f"{leaf}={_value_text(v)}" for leaf, v in zip(leaves, combo, strict=True))
        name = name or "trial"
        if len(name) > 180:
            import hashlib

            name = name[:160] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
        base, i = name, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.append(name)
    return names


def _baseline_precision(cfg: RunConfig) -> str:
    """fp32, or bf16 on a CUDA device that supports it (much faster there, fp32's range)."""
    from ampctl.amp.precision import bf16_supported
    from ampctl.train.builders import resolve_device

    dev = resolve_device(cfg.trainer.device)
    return "bf16" if dev.type == "cuda" and bf16_supported(dev) else "fp32"


def _is_scaling_key(key: str) -> bool:
    k = _bare(key)
    return k == "scaler" or k.startswith("scaler.")


def _is_precision_key(key: str) -> bool:
    k = _bare(key)
    return k == "precision" or k.startswith("precision.")


def _load(overrides: list[str], config_dir: Path | None, trial: str) -> RunConfig:
    try:
        return load_config(overrides, config_dir)
    except ConfigError as e:
        raise ConfigError(f"{_first_line(e)} (sweep trial {trial})") from None


def plan_sweep(
    overrides: list[str],
    *,
    steps: int | None = None,
    baseline: bool = True,
    name: str | None = None,
    config_dir: str | Path | None = None,
) -> SweepPlan:
    """Expand ``overrides`` into trials and validate every trial's config (nothing is written).

    Raises :class:`ConfigError` (a UsageError) naming the override, key or trial at fault."""
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: give an integer >= 1")
    if name is not None and (not _NAME_OK.match(name) or name in (".", "..")):
        raise ConfigError(
            f"--name {name!r}: use letters, digits and . _ - = , + (no slashes or spaces)"
        )
    cdir = Path(config_dir) if config_dir is not None else None
    fixed, sweeps = parse_sweep(list(overrides))
    keys = [k for k, _ in sweeps]
    combos = list(itertools.product(*[vals for _, vals in sweeps]))
    extra = [f"trainer.max_steps={steps}"] if steps is not None else []
    if not any(_bare(t.split("=", 1)[0]) == "logging.plot" for t in fixed):
        # one plot per sweep (`ampctl plot <sweep>`), not one per trial
        extra.append("logging.plot=false")
    trials: list[Trial] = []
    for tname, combo in zip(_trial_names(keys, combos), combos, strict=True):
        swept = dict(zip(keys, combo, strict=True))
        ovr = fixed + [f"{k}={v}" for k, v in swept.items()] + extra
        cfg = _load(ovr, cdir, tname)
        if cfg.precision.name not in ("fp16", "fp16-pure"):
            raise ConfigError(
                f"precision={cfg.precision.name} (sweep trial {tname}): loss scaling is only used by "
                "fp16 and fp16-pure; sweep with precision=fp16 or precision=fp16-pure"
            )
        trials.append(Trial(name=tname, kind="trial", swept=swept, overrides=ovr, cfg=cfg))
    bprec = _baseline_precision(trials[0].cfg) if baseline else None
    baselines: list[Trial] = []
    if bprec is not None:
        gkeys = [k for k in keys if not _is_scaling_key(k) and not _is_precision_key(k)]
        bfixed = [
            t for t in fixed if _bare(t.split("=", 1)[0]) not in ("precision", "precision.name")
        ]
        gleaves = _trial_names(gkeys, [tuple("x" for _ in gkeys)])[0].split(",") if gkeys else []
        gleaves = [g.split("=", 1)[0] for g in gleaves]
        by_group: dict[tuple[str, ...], str] = {}
        for t in trials:
            gvals = tuple(t.swept[k] for k in gkeys)
            if gvals not in by_group:
                suffix = ",".join(
                    f"{leaf}={_value_text(v)}" for leaf, v in zip(gleaves, gvals, strict=True)
                )
                bname = f"baseline-{bprec}" + (f",{suffix}" if suffix else "")
                ovr = (
                    bfixed
                    + [f"{k}={v}" for k, v in zip(gkeys, gvals, strict=True)]
                    + [f"precision={bprec}"]
                    + extra
                )
                cfg = _load(ovr, cdir, bname)
                baselines.append(
                    Trial(
                        name=bname,
                        kind="baseline",
                        swept=dict(zip(gkeys, gvals, strict=True)),
                        overrides=ovr,
                        cfg=cfg,
                    )
                )
                by_group[gvals] = bname
            t.group = by_group[gvals]
    runs_dir = Path(trials[0].cfg.trainer.runs_dir).expanduser()
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"sweep-{stamp}"
        i = 1
        while (runs_dir / name).exists():
            name, i = f"sweep-{stamp}-{i}", i + 1
    return SweepPlan(
        name=name,
        sweep_dir=(runs_dir / name).resolve(),
        trials=baselines + trials,
        swept_keys=keys,
        fixed=fixed,
        steps=steps,
        baseline=bprec,
        config_dir=cdir,
    )


# ---------------------------------------------------------------------------- reading a trial
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return rows


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str):  # "nan"/"inf" written as strings
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _finite(x: Any) -> bool:
    v = _num(x)
    return v is not None and math.isfinite(v)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``summary.json`` of a run folder, or None when it is missing or unreadable."""
    try:
        obj = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def read_trial(run_dir: str | Path) -> dict[str, Any]:
    """The figures of one trial folder: summary fields, first overflow step, max grad amax.

    The first overflow is the step of the first ``overflow`` event; runs without those events
    (guard off, fused optimizers) fall back to the first metrics row whose skipped count is
    non-zero (an upper bound: rows are written every ``log_every`` steps). ``max_grad_amax`` is the
    largest finite ``grad_amax`` over the rows logged in fp16. Pure file reading, no torch."""
    run_dir = Path(run_dir)
    s = read_summary(run_dir) or {}
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    events = _read_jsonl(run_dir / "events.jsonl")
    first = next(
        (int(e["step"]) for e in events if e.get("kind") == "overflow" and _finite(e.get("step"))),
        None,
    )
    if first is None:
        first = next(
            (
                int(r["step"])
                for r in metrics
                if (_num(r.get("skipped")) or 0) > 0 and _finite(r.get("step"))
            ),
            None,
        )
    amax = [
        float(r["grad_amax"])
        for r in metrics
        if r.get("precision") in ("fp16", "fp16-pure")
        and _finite(r.get("grad_amax"))
        and float(r["grad_amax"]) > 0
    ]
    counts = s.get("events") if isinstance(s.get("events"), dict) else {}
    steps = _num(s.get("steps"))
    wall = _num(s.get("wall_time_s"))
    abort = next((e.get("message") for e in reversed(events) if e.get("kind") == "abort"), None)
    return {
        "summary_status": s.get("status"),
        "precision": s.get("precision"),
        "steps": int(steps) if steps is not None else None,
        "skipped": s.get("skipped"),
        "overflow_rate": _num(s.get("overflow_rate")),
        "final_scale": _num(s.get("final_scale")),
        "first_overflow_step": first,
        "final_loss": _num(s.get("final_loss")),
        "steps_per_s": (steps / wall) if steps is not None and wall else None,
        "wall_time_s": wall,
        "max_grad_amax": max(amax) if amax else None,
        "amax_rows": len(amax),
        "rollbacks": int(counts.get("rollback", 0)),
        "fallbacks": int(counts.get("fallback", 0)),
        "abort_message": abort,
    }


def _tail(path: Path, lines: int = STDERR_TAIL_LINES, chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def trial_row(
    plan: SweepPlan, trial: Trial, exit_code: int | None, stderr_tail: str = ""
) -> dict[str, Any]:
    """A results row for ``trial`` from its folder (its status before gaps are known)."""
    run_dir = plan.sweep_dir / trial.name
    row: dict[str, Any] = {c: None for c in plan.columns}
    row.update(
        trial=trial.name, kind=trial.kind, run_dir=str(run_dir), exit_code=exit_code, stderr_tail=""
    )
    for k in plan.extra_keys:
        row[k] = trial.swept.get(k)
    if trial.kind == "trial":
        row["init_scale"] = trial.cfg.scaler.init_scale
        row["growth_interval"] = trial.cfg.scaler.growth_interval
    info = read_trial(run_dir) if run_dir.is_dir() else None
    if info is not None:
        row.update({k: info[k] for k in COLUMNS if k in info})
        row["_amax_rows"] = info["amax_rows"]
    st = info["summary_status"] if info is not None else None
    if exit_code is None and st in FINISHED:  # finished in an earlier invocation
        exit_code = row["exit_code"] = 0 if st == "ok" else 1
    if st is None:
        row["status"] = "crashed"
        how = (
            f"killed by signal {-exit_code}"
            if exit_code is not None and exit_code < 0
            else f"exit code {exit_code}"
        )
        row["reason"] = f"{how}, no summary.json"
    elif st == "interrupted":
        row["status"], row["reason"] = "interrupted", "stopped by a signal; re-run on resume"
    elif st == "aborted" and exit_code == 1:
        row["status"] = "diverged"
        row["reason"] = "aborted by the guard" + (
            f": {info['abort_message']}" if info and info["abort_message"] else ""
        )
    elif exit_code != 0:
        row["status"], row["reason"] = "crashed", f"exit code {exit_code} (summary status {st})"
    elif not _finite(row["final_loss"]):
        row["status"], row["reason"] = "diverged", f"final loss {row['final_loss']}"
    else:
        row["status"], row["reason"] = "ok", ""
    if row["status"] == "crashed":
        row["stderr_tail"] = stderr_tail or _tail(run_dir / "stderr.log")
    return row


# ---------------------------------------------------------------------------- pure results logic
def ideal_scale(amax: float, limit: float = FP16_MAX) -> float:
    """``S* = limit / amax`` rounded down to a power of two: the largest power-of-two scale that
    keeps the largest observed gradient under fp16's max. Raises ValueError for amax <= 0/nan."""
    if not (amax > 0 and math.isfinite(amax)):
        raise ValueError(f"amax must be a finite number > 0, got {amax}")
    return 2.0 ** math.floor(math.log2(limit / amax))


def _rank_key(row: dict[str, Any]) -> tuple[float, float, float]:
    gap = row["loss_gap"] if _finite(row.get("loss_gap")) else 0.0
    skipped = _num(row.get("skipped"))
    speed = _num(row.get("steps_per_s"))
    return (
        round(max(gap, 0.0) / GAP_TIE),
        skipped if skipped is not None else math.inf,
        -(speed if speed is not None and math.isfinite(speed) else 0.0),
    )


def finalize_rows(
    rows: list[dict[str, Any]],
    diverge_gap: float = DIVERGE_GAP,
    groups: dict[str, str] | None = None,
) -> list[str]:
    """Fill ``reference``, ``reference_loss``, ``loss_gap`` and ``rank`` in place; mark trials whose
    gap exceeds ``diverge_gap`` as diverged. Returns the ranked trial names (best first).

    A trial's reference is its baseline (``groups[trial] -> baseline name``) when that finished ok
    with a finite loss, else the lowest final loss among the ok trials of the same group."""
    groups = groups or {}
    by_name = {r["trial"]: r for r in rows}
    trials = [r for r in rows if r["kind"] == "trial"]
    for r in rows:
        r["rank"] = None
        if r["kind"] == "trial":
            r["reference"] = r["reference_loss"] = r["loss_gap"] = None
    for r in trials:
        if r["status"] != "ok":
            continue
        g = groups.get(r["trial"], "")
        b = by_name.get(g)
        if b is not None and b["status"] == "ok" and _finite(b["final_loss"]):
            ref, label = float(b["final_loss"]), g
        else:
            peers = [
                p
                for p in trials
                if p["status"] == "ok"
                and _finite(p["final_loss"])
                and groups.get(p["trial"], "") == g
            ]
            best = min(peers, key=lambda p: float(p["final_loss"]))
            ref, label = float(best["final_loss"]), f"best trial ({best['trial']})"
        r["reference"], r["reference_loss"] = label, ref
        r["loss_gap"] = (float(r["final_loss"]) - ref) / abs(ref) if ref != 0 else None
    for r in trials:
        if r["status"] == "ok" and _finite(r["loss_gap"]) and r["loss_gap"] > diverge_gap:
            r["status"] = "diverged"
            r["reason"] = (
                f"final loss {r['loss_gap']:+.1%} vs {r['reference']} (threshold +{diverge_gap:.0%})"
            )
    ranked = sorted((r for r in trials if r["status"] == "ok"), key=_rank_key)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    return [r["trial"] for r in ranked]


def _fmt_value(v: float | int | str | None) -> str:
    v2 = _num(v)
    if v2 is None:
        return str(v)
    if v2 == int(v2) and abs(v2) < 1e15:
        return str(int(v2))
    return repr(v2)


# ---------------------------------------------------------------------------- results
@dataclass
class SweepResult:
    plan: SweepPlan
    rows: list[dict[str, Any]]  # one per trial, in plan order
    ranking: list[str]
    recommendation: dict[str, Any] | None
    s_star: dict[str, Any] | None
    launched: list[str] = field(default_factory=list)  # trials run by this invocation
    reused: list[str] = field(default_factory=list)  # trials found finished (resume)
    moved_aside: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def sweep_dir(self) -> Path:
        return self.plan.sweep_dir

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 0 if self.ranking else 1


def _recommend(
    plan: SweepPlan, rows: list[dict[str, Any]], ranking: list[str]
) -> dict[str, Any] | None:
    if not ranking:
        return None
    trial = next(t for t in plan.trials if t.name == ranking[0])
    ovr = list(plan.fixed)
    for k, v in trial.swept.items():
        ovr.append(f"{k}={v}")
    for k in SCALE_KEYS:
        if not any(_bare(t.split("=", 1)[0]) == k for t in ovr):
            ovr.append(f"{k}={_fmt_value(getattr(trial.cfg.scaler, k.split('.')[1]))}")
    return {"trial": trial.name, "overrides": ovr, "command": _train_command(plan, ovr)}


def _train_command(plan: SweepPlan, ovr: list[str]) -> str:
    cd = ["--config-dir", str(plan.config_dir)] if plan.config_dir is not None else []
    return shlex.join(["ampctl", "train", *ovr, *cd])


def _s_star(
    plan: SweepPlan, rows: list[dict[str, Any]], recommendation: dict[str, Any] | None
) -> dict[str, Any] | None:
    used = [
        r
        for r in rows
        if r["kind"] == "trial" and r["status"] == "ok" and _finite(r.get("max_grad_amax"))
    ]
    if not used:
        return None
    amax = max(float(r["max_grad_amax"]) for r in used)
    n_rows = sum(int(r.get("_amax_rows") or 0) for r in used)
    s = ideal_scale(amax)
    max_scale = max(t.cfg.scaler.max_scale for t in plan.trials if t.kind == "trial")
    base = recommendation["overrides"] if recommendation else list(plan.fixed)
    ovr = [
        f"scaler.init_scale={_fmt_value(s)}"
        if _bare(o.split("=", 1)[0]) == "scaler.init_scale"
        else o
        for o in base
    ]
    if not any(_bare(o.split("=", 1)[0]) == "scaler.init_scale" for o in ovr):
        ovr.append(f"scaler.init_scale={_fmt_value(s)}")
    return {
        "value": s,
        "exponent": int(math.log2(s)),
        "max_grad_amax": amax,
        "rows": n_rows,
        "trials": len(used),
        "above_max_scale": s > max_scale,
        "max_scale": max_scale,
        "command": _train_command(plan, ovr),
    }


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return "" if v is None else v


def write_results(result: SweepResult, diverge_gap: float) -> None:
    """Write results.csv and results.json into the sweep folder (atomically, each)."""
    plan = result.plan
    cols = plan.columns
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in result.rows:
        w.writerow({k: _cell(r.get(k)) for k in cols})
    _atomic_write(plan.sweep_dir / "results.csv", buf.getvalue())
    doc = {
        "sweep": plan.name,
        "sweep_dir": str(plan.sweep_dir),
        "overrides": plan.fixed,
        "swept": {k: v for k, v in _swept_values(plan).items()},
        "steps": plan.steps,
        "baseline": plan.baseline,
        "diverge_gap": diverge_gap,
        "columns": cols,
        "trials": [{k: r.get(k) for k in cols} for r in result.rows],
        "ranking": result.ranking,
        "recommendation": result.recommendation,
        "s_star": result.s_star,
        "interrupted": result.interrupted,
        "complete": all(r["status"] not in ("pending", "interrupted") for r in result.rows),
    }
    _atomic_write(
        plan.sweep_dir / "results.json",
        json.dumps(doc, indent=2, default=str, allow_nan=True) + "\n",
    )


def _swept_values(plan: SweepPlan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in plan.trials:
        if t.kind != "trial":
            continue
        for k, v in t.swept.items():
            out.setdefault(k, [])
            if v not in out[k]:
                out[k].append(v)
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- display
_STATUS_STYLE = {
    "ok": "green",
    "diverged": "bold red",
    "crashed": "bold red",
    "interrupted": "yellow",
    "invalid": "bold red",
    "running": "cyan",
    "pending": "dim",
}


def _gap_text(v: Any) -> str:
    if not _finite(v):
        return "-"
    g = float(v)
    return "0.00%" if abs(g) < 5e-5 else f"{g:+.2%}"


def _cell_num(v: Any, fmt: Callable[[Any], str]) -> str:
    return "-" if v is None else fmt(v)


def sweep_table(
    plan: SweepPlan, rows: list[dict[str, Any]], title: str, ranked: bool = False
) -> Table:
    """A rich table of the trials: one row per trial, identified by its init_scale, growth
    interval and any other swept values; baselines show their precision instead of a scale.
    ``ranked``: best first, with the rank in the first column."""
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("init_scale", justify="right", no_wrap=True)
    t.add_column("growth", justify="right", no_wrap=True)
    for k in plan.extra_keys:
        t.add_column(_bare(k).split(".")[-1], justify="right", no_wrap=True)
    for name in ("skipped", "overflow", "final scale", "1st ovf", "final loss", "gap", "steps/s"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    order = list(rows)
    if ranked:
        order.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["kind"] != "baseline"))
    for i, r in enumerate(order, 1):
        st = r["status"]
        done = st not in ("pending", "running")
        base = r["kind"] == "baseline"
        if ranked:
            first = "base" if base else (str(r["rank"]) if r.get("rank") else "-")
        else:
            first = "base" if base else str(i)
        cells = [
            first,
            (plan.baseline or "-") if base else _cell_num(r["init_scale"], _fmt_value),
            _cell_num(r["growth_interval"], _fmt_value),
        ]
        cells += [str(r[k]) if r.get(k) is not None else "-" for k in plan.extra_keys]
        if done:
            cells += [
                _cell_num(r["skipped"], str),
                _cell_num(r["overflow_rate"], fmt_pct),
                "-" if base else _cell_num(r["final_scale"], _fmt_value),
                _cell_num(r["first_overflow_step"], str),
                _cell_num(r["final_loss"], fmt_loss),
                "-" if base else _gap_text(r.get("loss_gap")),
                _cell_num(r["steps_per_s"], lambda v: fmt_float(v, 3)),
            ]
        else:
            cells += ["-"] * 7
        style = _STATUS_STYLE.get(st)
        cells.append(f"[{style}]{st}[/]" if style else st)
        t.add_row(*cells)
    return t


class _View:
    """Live table (terminal) or one plain line per finished trial."""

    def __init__(self, plan: SweepPlan, console: Console, mode: str) -> None:
        if mode == "auto":
            mode = "live" if console.is_terminal and not console.is_dumb_terminal else "plain"
        self.plan, self.console, self.mode = plan, console, mode
        self.rows: list[dict[str, Any]] = []
        self.done = 0
        self._live: Live | None = None

    def start(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        if self.mode == "live":
            self._live = Live(
                self._render(), console=self.console, auto_refresh=False, transient=True
            )
            self._live.start(refresh=True)

    def _render(self) -> Table:
        n = len(self.rows)
        return sweep_table(
            self.plan, self.rows, f"ampctl sweep-scale - {self.plan.name}: {self.done}/{n} done"
        )

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render(), refresh=True)

    def finished(self, row: dict[str, Any], total: int) -> None:
        self.done += 1
        if self.mode == "plain":
            r = row
            gap = "base" if r["kind"] == "baseline" else _gap_text(r.get("loss_gap"))
            self.console.out(
                f"[{self.done}/{total}] {r['trial']}: {r['status']} loss={fmt_loss(r['final_loss'])} gap={gap} "
                f"skipped={r['skipped'] if r['skipped'] is not None else '-'} "
                f"overflow={fmt_pct(r['overflow_rate']) if r['overflow_rate'] is not None else '-'} "
                f"scale={fmt_scale(r['final_scale'], pow2=False) if r['final_scale'] is not None else '-'} "
                f"first_overflow={r['first_overflow_step'] if r['first_overflow_step'] is not None else '-'} "
                f"steps/s={fmt_float(r['steps_per_s'], 3) if r['steps_per_s'] is not None else '-'} "
                f"time={_cell_num(r['wall_time_s'], lambda v: f'{v:.1f}s')}"
                + (f" ({r['reason']})" if r.get("reason") else ""),
                highlight=False,
            )
        self.refresh()

    def stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()


# ---------------------------------------------------------------------------- running
@dataclass
class _Running:
    trial: Trial
    proc: subprocess.Popen
    out_path: Path
    err_path: Path
    threads: int


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def threads_per_trial(
    jobs: int, cores: int | None = None, env: dict[str, str] | None = None
) -> int:
    """CPU threads for each trial so that ``jobs x threads <= cores``; an ``OMP_NUM_THREADS``
    already set in the environment is an upper bound (a shared machine's limit stays)."""
    cores = cores or _cores()
    n = max(1, cores // max(jobs, 1))
    cap = (env if env is not None else os.environ).get("OMP_NUM_THREADS", "")
    if cap.isdigit() and int(cap) >= 1:
        n = min(n, int(cap))
    return n


def _quote_value(v: str) -> str:
    """A string as a Hydra override value (quoted when it has characters Hydra would parse)."""
    if re.fullmatch(r"[A-Za-z0-9_/.:~-]+", v):
        return v
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _launch(plan: SweepPlan, trial: Trial, threads: int, logs: Path) -> _Running:
    cmd = [
        sys.executable,
        "-m",
        "ampctl",
        "train",
        *trial.overrides,
        f"trainer.runs_dir={_quote_value(str(plan.sweep_dir))}",
        "--name",
        trial.name,
        "--quiet",
    ]
    if plan.config_dir is not None:
        cmd += ["--config-dir", str(plan.config_dir)]
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    out_path, err_path = logs / f"{trial.name}.stdout.log", logs / f"{trial.name}.stderr.log"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # own session: a Ctrl-C on the terminal reaches the sweep only; it stops the trials itself
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    return _Running(trial=trial, proc=proc, out_path=out_path, err_path=err_path, threads=threads)


def _collect(plan: SweepPlan, run: _Running, code: int, stopped: bool = False) -> dict[str, Any]:
    """The row of a trial process that has exited with ``code``. ``stopped``: the sweep sent it
    SIGTERM (Ctrl-C); a trial that had already written a finished summary keeps its outcome."""
    run_dir = plan.sweep_dir / run.trial.name
    tail = _tail(run.err_path)
    signalled = None
    if stopped and (read_summary(run_dir) or {}).get("status") in FINISHED and code not in (0, 1):
        signalled, code = code, 0 if read_summary(run_dir)["status"] == "ok" else 1
    if run_dir.is_dir():  # keep the logs with the trial
        for src, dst in ((run.out_path, "stdout.log"), (run.err_path, "stderr.log")):
            if src.exists():
                os.replace(src, run_dir / dst)
        info = {"exit_code": code, "threads": run.threads, "command": run.proc.args}
        if signalled is not None:
            info["signalled_after_finish"] = signalled
        (run_dir / "sweep_trial.json").write_text(json.dumps(info, default=str) + "\n")
    row = trial_row(plan, run.trial, code, stderr_tail=tail)
    if stopped and row["status"] == "crashed":
        row.update(status="interrupted", reason="killed by Ctrl-C; re-run on resume")
    drift = config_diff(run_dir / "config.yaml", run.trial.cfg)
    if drift is not None:  # e.g. a conf/ or --config-dir file edited while the sweep ran
        k, ran, planned = drift
        row.update(
            status="invalid",
            reason=f"ran with {k}={ran} but the sweep validated {k}={planned}: a config file "
            "changed during the sweep; start it again under a new --name",
        )
    return row


def _stop(running: list[_Running]) -> None:
    """SIGTERM the running trials (each writes a checkpoint and an interrupted summary) and wait
    up to ``KILL_GRACE_S``; then, or at a second Ctrl-C, kill what is left."""
    for run in running:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
    deadline = time.perf_counter() + KILL_GRACE_S
    try:
        for run in running:
            try:
                run.proc.wait(timeout=max(deadline - time.perf_counter(), 0.1))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        pass
    for run in running:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def _stored_exit_code(run_dir: Path) -> int | None:
    try:
        v = json.loads((run_dir / "sweep_trial.json").read_text()).get("exit_code")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return v if isinstance(v, int) else None


def config_diff(path: Path, cfg: RunConfig) -> tuple[str, Any, Any] | None:
    """The first key whose value differs between the run's ``config.yaml`` and ``cfg``, as
    ``(key, value in the file, value in cfg)``; None when they agree or the file is unreadable.
    ``trainer.runs_dir`` and keys present on one side only (a newer schema) are not compared."""
    from omegaconf import OmegaConf

    if not path.is_file():
        return None
    try:
        old = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:
        return None
    new = OmegaConf.to_container(OmegaConf.create(cfg.to_dict()))

    def flat(d: Any, p: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flat(v, f"{p}{k}."))
            return out
        return {p[:-1]: d}

    a, b = flat(old), flat(new)
    diff = sorted(k for k in set(a) & set(b) if k != "trainer.runs_dir" and a[k] != b[k])
    return (diff[0], a[diff[0]], b[diff[0]]) if diff else None


def _check_same_config(plan: SweepPlan, trial: Trial) -> None:
    """A finished trial must have been run with the config this sweep would use now."""
    d = config_diff(plan.sweep_dir / trial.name / "config.yaml", trial.cfg)
    if d is not None:
        k, old, new = d
        raise ConfigError(
            f"--name {plan.name}: trial {trial.name} in {plan.sweep_dir} was run with {k}={old}, "
            f"this sweep gives {k}={new}; re-run it with the same overrides and --steps, or pick "
            "another --name"
        )


def _move_aside(path: Path) -> Path:
    i = 1
    while True:
        dst = path.with_name(f"{path.name}.incomplete-{i}")
        if not dst.exists():
            path.rename(dst)
            return dst
        i += 1


def _resume_command(plan: SweepPlan, overrides: list[str], jobs: int) -> str:
    args = ["ampctl", "sweep-scale", *overrides]
    if plan.steps is not None:
        args += ["--steps", str(plan.steps)]
    if jobs != 1:
        args += ["--jobs", str(jobs)]
    if plan.baseline is None:
        args.append("--no-baseline")
    if plan.config_dir is not None:
        args += ["--config-dir", str(plan.config_dir)]
    args += ["--name", plan.name]
    return shlex.join(args)


def sweep(
    overrides: list[str],
    *,
    steps: int | None = None,
    jobs: int = 1,
    baseline: bool = True,
    name: str | None = None,
    config_dir: str | Path | None = None,
    diverge_gap: float = DIVERGE_GAP,
    threads: int | None = None,
    console: Console | None = None,
    mode: str = "plain",
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Plan, validate and run a sweep; returns its :class:`SweepResult` (results files written).

    ``name`` of an existing sweep folder resumes it: trials whose ``summary.json`` says ok or
    aborted are kept, other trial folders are renamed ``<trial>.incomplete-N`` and re-run.
    ``threads`` per trial defaults to :func:`threads_per_trial`. ``on_result(row)`` is called after
    each finished trial (a KeyboardInterrupt raised there acts like Ctrl-C). A KeyboardInterrupt
    stops launching, terminates running trials (SIGTERM: they checkpoint; killed after
    ``KILL_GRACE_S``), writes the results so far and returns with ``interrupted=True``.
    Raises UsageError for bad input before anything is written. Host-side only; the trials'
    device work happens in their own processes."""
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: give an integer >= 1")
    if mode not in ("auto", "live", "plain", "quiet"):
        raise ValueError(f"mode must be auto, live, plain or quiet, got {mode!r}")
    console = console or Console()
    plan = plan_sweep(overrides, steps=steps, baseline=baseline, name=name, config_dir=config_dir)
    sdir = plan.sweep_dir
    resuming = sdir.exists()
    if resuming:
        if not (sdir / "sweep.json").is_file():
            raise ConfigError(
                f"--name {plan.name}: {sdir} exists and is not a sweep folder (no sweep.json); pick another --name"
            )
        for t in plan.trials:
            if (read_summary(sdir / t.name) or {}).get("status") in FINISHED:
                _check_same_config(plan, t)
    cores = _cores()
    eff_jobs = min(jobs, cores, len(plan.trials))
    nthreads = threads or threads_per_trial(eff_jobs, cores)
    sdir.mkdir(parents=True, exist_ok=True)
    logs = sdir / "_logs"
    logs.mkdir(exist_ok=True)
    (sdir / "sweep.json").write_text(
        json.dumps(
            {
                "name": plan.name,
                "overrides": list(overrides),
                "steps": plan.steps,
                "baseline": plan.baseline,
                "trials": [
                    {"name": t.name, "kind": t.kind, "overrides": t.overrides} for t in plan.trials
                ],
            },
            indent=2,
        )
        + "\n"
    )
    groups = {t.name: t.group for t in plan.trials if t.kind == "trial"}
    result = SweepResult(plan=plan, rows=[], ranking=[], recommendation=None, s_star=None)
    rows: dict[str, dict[str, Any]] = {}
    todo: deque[Trial] = deque()
    for t in plan.trials:
        tdir = sdir / t.name
        if (read_summary(tdir) or {}).get("status") in FINISHED:
            rows[t.name] = trial_row(plan, t, _stored_exit_code(tdir))
            result.reused.append(t.name)
            continue
        if tdir.exists():
            result.moved_aside.append(_move_aside(tdir).name)
        row = {c: None for c in plan.columns}
        row.update(trial=t.name, kind=t.kind, status="pending", run_dir=str(tdir))
        if t.kind == "trial":
            row.update(
                init_scale=t.cfg.scaler.init_scale, growth_interval=t.cfg.scaler.growth_interval
            )
        for k in plan.extra_keys:
            row[k] = t.swept.get(k)
        rows[t.name] = row
        todo.append(t)

    def refresh_results() -> None:
        result.rows = [rows[t.name] for t in plan.trials]
        done = [r for r in result.rows if r["status"] not in ("pending", "running")]
        result.ranking = finalize_rows(done, diverge_gap, groups)
        result.recommendation = _recommend(plan, result.rows, result.ranking)
        result.s_star = _s_star(plan, result.rows, result.recommendation)
        write_results(result, diverge_gap)

    n_trials = sum(t.kind == "trial" for t in plan.trials)
    n_base = len(plan.trials) - n_trials
    if mode != "quiet":
        console.print(
            f"Sweep {sdir}: {n_trials} trials"
            + (f" + {n_base} {plan.baseline} baseline{'s' if n_base > 1 else ''}" if n_base else "")
            + f", {eff_jobs} at a time, {nthreads} CPU thread{'s' if nthreads > 1 else ''} each"
            + (
                f" (--jobs {jobs} capped at {cores} cores)"
                if eff_jobs < jobs and eff_jobs == cores
                else ""
            ),
            highlight=False,
            markup=False,
        )
        if resuming:
            console.print(
                f"Resuming: {len(result.reused)} finished trial(s) kept, {len(todo)} to run"
                + (f"; moved aside: {', '.join(result.moved_aside)}" if result.moved_aside else ""),
                highlight=False,
                markup=False,
            )
    refresh_results()
    view = _View(plan, console, "plain" if mode == "quiet" else mode)
    quiet = mode == "quiet"
    running: list[_Running] = []
    total = len(plan.trials)
    view.done = len(result.reused)
    old_term = None
    if threading.current_thread() is threading.main_thread():

        def _on_term(signum, frame):  # noqa: ARG001 - treat SIGTERM like Ctrl-C
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, _on_term)
    if not quiet:
        view.start(result.rows)
    try:
        last_refresh = 0.0
        while todo or running:
            while todo and len(running) < eff_jobs:
                t = todo.popleft()
                running.append(_launch(plan, t, nthreads, logs))
                rows[t.name]["status"] = "running"
                result.launched.append(t.name)
                view.refresh()
            time.sleep(0.05)
            for run in list(running):
                code = run.proc.poll()
                if code is None:
                    continue
                running.remove(run)
                rows[run.trial.name] = _collect(plan, run, code)
                refresh_results()
                if not quiet:
                    view.finished(rows[run.trial.name], total)
                if on_result is not None:
                    on_result(rows[run.trial.name])
            if time.perf_counter() - last_refresh > 1.0:
                view.refresh()
                last_refresh = time.perf_counter()
    except KeyboardInterrupt:
        result.interrupted = True
        _stop(running)
        for run in running:
            rows[run.trial.name] = _collect(plan, run, run.proc.returncode, stopped=True)
        running.clear()
        refresh_results()
    finally:
        for run in running:  # an unexpected error: leave no trial process behind
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
        view.stop()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    refresh_results()
    if not quiet:
        _print_report(console, result, overrides, jobs)
    return result


def _print_report(console: Console, result: SweepResult, overrides: list[str], jobs: int) -> None:
    plan = result.plan
    console.print(sweep_table(plan, result.rows, f"sweep {plan.name} (ranked)", ranked=True))
    for r in result.rows:
        if r["status"] in ("diverged", "crashed", "invalid") and r.get("reason"):
            console.print(
                f"{r['trial']}: {r['status']}: {r['reason']}", highlight=False, markup=False
            )
            if r["status"] == "crashed" and r.get("stderr_tail"):
                console.print(
                    "  " + r["stderr_tail"].splitlines()[-1], highlight=False, markup=False
                )
    rec = result.recommendation
    if rec is not None:
        row = next(r for r in result.rows if r["trial"] == rec["trial"])
        console.print(
            f"Recommended: {rec['trial']} (gap {_gap_text(row['loss_gap'])} vs {row['reference']}, "
            f"{row['skipped']} skipped, {fmt_float(row['steps_per_s'], 3)} steps/s):",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        console.print("  " + rec["command"], highlight=False, markup=False, soft_wrap=True)
        ties = [
            r
            for r in result.rows
            if r["rank"] is not None and _rank_key(r)[:2] == _rank_key(row)[:2]
        ]
        if len(ties) > 1:
            speeds = [float(r["steps_per_s"]) for r in ties if _finite(r.get("steps_per_s"))]
            console.print(
                f"  ({len(ties)} trials tie on loss gap (0.1% steps) and skipped steps; steps/s "
                f"orders them ({fmt_float(min(speeds), 3)}-{fmt_float(max(speeds), 3)} here, which "
                "also moves with machine load): any of them is as good for the loss)",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    else:
        console.print(
            "No trial finished ok: nothing to recommend. See the reasons above.",
            highlight=False,
            markup=False,
        )
    s = result.s_star
    if s is not None:
        note = (
            f" (above scaler.max_scale {fmt_scale(s['max_scale'])}: the scaler caps it)"
            if s["above_max_scale"]
            else ""
        )
        console.print(
            f"Data-driven estimate: max|g| = {s['max_grad_amax']:.4g} over {s['rows']} logged fp16 steps of "
            f"{s['trials']} trial(s) -> S* = 65504/max|g| rounded down = {fmt_scale(s['value'])}{note}:",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        console.print("  " + s["command"], highlight=False, markup=False, soft_wrap=True)
    console.print(
        f"Results: {plan.sweep_dir / 'results.csv'}, {plan.sweep_dir / 'results.json'}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if result.interrupted:
        done = sum(r["status"] not in ("pending", "interrupted") for r in result.rows)
        console.print(
            f"Interrupted: {done} of {len(result.rows)} trials finished. Resume with: "
            + _resume_command(plan, overrides, jobs),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def run_sweep(
    overrides: list[str],
    steps: int | None,
    jobs: int,
    baseline: bool,
    name: str | None,
    config_dir: Path | None,
    mode: str,
) -> int:
    """What ``ampctl sweep-scale`` does; returns the exit code (0 a recommendation was made,
    1 no trial finished ok, 130 interrupted). Bad input raises a UsageError (exit 2)."""
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
    )
    return result.exit_code

"""The sweep's results as data: :class:`SweepResult`, the results.csv / results.json documents
and the closing report as plain lines. Pure builders (no rich, no console); :mod:`.render`
draws them and :func:`write_results` writes the files."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampctl.runlog import atomic_write_text, is_finite_number
from ampctl.ui.display import fmt_scale

from .plan import SweepPlan
from .rank import GAP_TIE
from .trial import plan_columns

__all__ = [
    "SweepResult",
    "results_doc",
    "results_csv",
    "write_results",
    "report_lines",
    "gap_text",
    "trial_steps",
]


@dataclass
class SweepResult:
    plan: SweepPlan
    rows: list[dict[str, Any]]  # one per trial, in plan order
    ranking: list[str]
    recommendation: dict[str, Any] | None
    s_star: dict[str, Any] | None
    launched: list[str] = field(default_factory=list)  # trials run by this invocation
    reused: list[str] = field(default_factory=list)  # trials found finished (resume)
    resumed: list[str] = field(default_factory=list)  # trials continued from their checkpoint
    moved_aside: list[str] = field(default_factory=list)
    rungs: list[dict[str, Any]] = field(default_factory=list)  # halving: who was promoted
    interrupted: bool = False
    launcher: str = "local"

    @property
    def sweep_dir(self) -> Path:
        return self.plan.sweep_dir

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 0 if self.recommendation else 1


def trial_steps(rows: list[dict[str, Any]], kind: str = "trial") -> int:
    """Training steps spent by the rows of ``kind`` (``"trial"``, ``"baseline"``)."""
    return sum(int(r.get("steps_spent") or 0) for r in rows if r["kind"] == kind)


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return "" if v is None else v


def _swept_values(plan: SweepPlan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in plan.trials:
        if t.kind == "trial":
            for k, v in t.swept.items():
                out.setdefault(k, [])
                if v not in out[k]:
                    out[k].append(v)
    return out


def results_doc(result: SweepResult, diverge_gap: float) -> dict[str, Any]:
    """results.json: the sweep's settings, one object per trial (the columns), the ranking,
    the recommendation and S*."""
    plan = result.plan
    cols = plan_columns(plan)
    n = sum(t.kind == "trial" for t in plan.trials)
    return {
        "sweep": plan.name,
        "sweep_dir": str(plan.sweep_dir),
        "overrides": plan.fixed,
        "swept": _swept_values(plan),
        "steps": plan.steps,
        "baseline": plan.baseline,
        "diverge_gap": diverge_gap,
        "launcher": result.launcher,
        "halving": plan.halving,
        "rung_steps": plan.budgets,
        "rungs": result.rungs,
        "trial_steps": trial_steps(result.rows),
        "baseline_steps": trial_steps(result.rows, "baseline"),
        "full_grid_trial_steps": n * plan.total_steps,
        "columns": cols,
        "trials": [{k: r.get(k) for k in cols} for r in result.rows],
        "ranking": result.ranking,
        "recommendation": result.recommendation,
        "s_star": result.s_star,
        "interrupted": result.interrupted,
        "complete": all(
            r["status"] not in ("pending", "running", "interrupted") for r in result.rows
        ),
    }


def results_csv(result: SweepResult) -> str:
    cols = plan_columns(result.plan)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in result.rows:
        w.writerow({k: _cell(r.get(k)) for k in cols})
    return buf.getvalue()


def write_results(result: SweepResult, diverge_gap: float) -> None:
    """Write results.csv and results.json into the sweep folder (atomically, each)."""
    sdir = result.plan.sweep_dir
    atomic_write_text(sdir / "results.csv", results_csv(result))
    doc = results_doc(result, diverge_gap)
    atomic_write_text(sdir / "results.json", json.dumps(doc, indent=2, default=str) + "\n")


def gap_text(v: Any) -> str:
    if not is_finite_number(v):
        return "-"
    g = float(v)
    return "0.00%" if abs(g) < 5e-5 else f"{g:+.2%}"


def _problem_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["status"] in ("diverged", "crashed", "invalid") and r.get("reason"):
            out.append(f"{r['trial']}: {r['status']}: {r['reason']}")
            if r["status"] == "crashed" and r.get("stderr_tail"):
                out.append("  " + r["stderr_tail"].splitlines()[-1])
    return out


_TIE_RULES = {
    "s_star": "the init_scale closest (in powers of two) to the data-driven estimate {target} "
    "(S*, below)",
    "default_init_scale": "the init_scale closest (in powers of two) to the conventional default "
    "65536 (2^16){why}",
    "default_growth_interval": "the growth_interval closest to the conventional default 2000",
    "order": "the plan's order (they are equal on every rule)",
}


def _tie_lines(tie: dict[str, Any] | None) -> list[str]:
    """What the recommendation tied with and the rule that broke the tie (never speed)."""
    if not tie:
        return []
    out = []
    tied, rule = tie.get("tied") or [], tie.get("rule")
    if len(tied) > 1 and rule in _TIE_RULES:
        if rule == "default_init_scale" and tie.get("target_source") == "s_star":
            why = " (equally close to the S* estimate)"
        elif rule == "default_init_scale":
            why = " (no S* estimate: no fp16 gradients were logged)"
        else:
            why = ""
        how = _TIE_RULES[rule].format(target=fmt_scale(tie.get("target")), why=why)
        out.append(
            f"  Tie: {len(tied)} trials are equal on loss (gap in whole {GAP_TIE:.1%} steps) and "
            f"skipped steps ({', '.join(tied)}); broken by {how}, not by steps/s (machine load)"
        )
    for name in tie.get("unscaled") or []:
        out.append(
            f"  {name} (fp16 without loss scaling) is as good on loss here, but is recommended "
            "only when strictly best on loss"
        )
    return out


def _recommendation_lines(result: SweepResult) -> list[str]:
    rec = result.recommendation
    if rec is None:
        return ["No trial finished the full steps ok: nothing to recommend. See the reasons above."]
    row = next(r for r in result.rows if r["trial"] == rec["trial"])
    return [
        f"Recommended: {rec['trial']} (gap {gap_text(row['loss_gap'])} vs {row['reference']}, "
        f"{row['skipped']} skipped):",
        "  " + rec["command"],
        *_tie_lines(rec.get("tie")),
    ]


def _s_star_lines(s: dict[str, Any] | None, rec: dict[str, Any] | None) -> list[str]:
    """S* as information under the one recommendation (never a second command): what the
    gradients suggest, and either the trial of the grid that tried it or, when none did, the
    override that adds it to the grid."""
    if s is None:
        return []
    note = (
        f" (above scaler.max_scale {fmt_scale(s['max_scale'])}: the scaler caps it)"
        if s["above_max_scale"]
        else ""
    )
    if not s.get("tried"):
        where = f"not tried: add it to the grid: {s['grid_override']}"
    elif rec is not None and s["tried"] == rec["trial"]:
        where = f"tried: {s['tried']}, the recommended trial"
    else:
        rank = f"ranked {s['tried_rank']}, " if s.get("tried_rank") else ""
        where = f"tried: {s['tried']} ({rank}{s['tried_status']})"
    return [
        f"S* (information, not a recommendation): 65504/max|g| = {s['value']:.6g} "
        f"(2^{s['exponent']:.2f}){note}, max|g| = {s['max_grad_amax']:.4g} over {s['rows']} "
        f"logged fp16 steps of {s['trials']} trial(s); rounded down to a power of two and halved "
        f"for a 2x margin: init_scale {fmt_scale(s['init_scale'])}",
        "  " + where,
    ]


def _halving_lines(result: SweepResult) -> list[str]:
    plan = result.plan
    if plan.halving is None:
        return []
    n = sum(t.kind == "trial" for t in plan.trials)
    spent, full = trial_steps(result.rows), n * plan.total_steps
    base = trial_steps(result.rows, "baseline")
    pct = f" ({spent / full:.0%} of the full grid's {full})" if full else ""
    return [
        f"Successive halving (--halving {plan.halving}, rungs of {', '.join(map(str, plan.budgets))} "
        f"steps): {spent} trial steps{pct}" + (f", plus {base} baseline steps" if base else "")
    ]


def report_lines(result: SweepResult, resume_command: str) -> list[str]:
    """The closing report under the ranked table, as plain lines."""
    plan = result.plan
    out = _problem_lines(result.rows) + _recommendation_lines(result)
    out += _s_star_lines(result.s_star, result.recommendation) + _halving_lines(result)
    out.append(f"Results: {plan.sweep_dir / 'results.csv'}, {plan.sweep_dir / 'results.json'}")
    if result.interrupted:
        done = sum(r["status"] not in ("pending", "interrupted") for r in result.rows)
        out.append(
            f"Interrupted: {done} of {len(result.rows)} trials finished. Resume with: "
            + resume_command
        )
    return out

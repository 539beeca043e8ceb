"""Pure results logic: loss gaps, divergence, ranking, promotion to the next rung, the
recommended command and the data-driven scale estimate. Functions of rows (dicts), no I/O.

Ranking: trials that finished their rung ok, those of the highest rung first; within a rung on
their *merit* (:func:`merit`):

1) the loss gap to the reference counted in whole steps of :data:`GAP_TIE` (0.1%): a gap is
   clipped at 0 (a loss below the reference is on track) and truncated, so any gap under +0.1%
   ties with the reference, +0.1% up to +0.2% is the next step, and so on;
2) fp16 without loss scaling (``init_scale`` <= 1) after every scaled trial of the same gap step:
   it is recommended only when it is strictly best on loss;
3) fewest skipped steps.

Trials of equal merit *tie*. A tie is broken by :func:`closeness`, never by speed (steps/s
moves with machine load): the ``init_scale`` closest, in powers of two, to the data-driven
estimate (:func:`ampctl.amp.formats.recommended_init_scale` of the trials' largest gradient),
or to the conventional default 2^16 without one; then the ``growth_interval`` closest to the
default 2000; then the plan's order. :func:`tie_info` says who tied and which rule broke it.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from ampctl.amp.formats import ideal_scale, recommended_init_scale
from ampctl.runlog import as_number, is_finite_number

from .plan import SCALE_KEYS, SweepPlan, bare

__all__ = [
    "DIVERGE_GAP",
    "STOP_GAP",
    "GAP_TIE",
    "RANKED",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_INTERVAL",
    "merit",
    "unscaled",
    "closeness",
    "rank_key",
    "tie_info",
    "scale_target",
    "finalize_rows",
    "select_promoted",
    "live_divergence",
    "recommend",
    "s_star",
    "grid_override",
    "fmt_value",
]

DIVERGE_GAP = 0.10  # final-loss gap above which a trial that ran the full steps counts as diverged
STOP_GAP = 0.50  # "far above the reference": stopped at once (any logged step, any rung)
GAP_TIE = 1e-3  # loss gaps are compared in whole steps of 0.1% when ranking
RANKED = ("ok", "stopped")  # statuses that are ranked (stopped: not promoted past its rung)


DEFAULT_INIT_SCALE = 2.0**16  # torch.amp.GradScaler's defaults: the tie-break without S*
DEFAULT_GROWTH_INTERVAL = 2000


def _log2_distance(v: Any, to: float) -> float:
    x = as_number(v)
    if x is None or not math.isfinite(x) or x <= 0 or to <= 0:
        return math.inf
    return abs(math.log2(x) - math.log2(to))


def unscaled(row: dict[str, Any]) -> bool:
    """An fp16 trial without loss scaling: ``init_scale`` <= 1 (every sweep trial is fp16)."""
    v = as_number(row.get("init_scale"))
    return row.get("kind", "trial") == "trial" and v is not None and v <= 1


def merit(row: dict[str, Any]) -> tuple[int, int, float]:
    """``(gap step, unscaled, skipped)``, smaller is better; equal merit is a tie (see the module
    docstring). Speed is not part of it."""
    gap = float(row["loss_gap"]) if is_finite_number(row.get("loss_gap")) else 0.0
    skipped = as_number(row.get("skipped"))
    return (
        math.floor(max(gap, 0.0) / GAP_TIE + 1e-6),  # + 1e-6: 0.002 is step 2, not 1.999...
        int(unscaled(row)),
        skipped if skipped is not None else math.inf,
    )


def closeness(row: dict[str, Any], target: float | None = None) -> tuple[float, float, float]:
    """How a tie is broken, smaller first: the init_scale's distance in powers of two to
    ``target`` (the S* estimate; :data:`DEFAULT_INIT_SCALE` when None), then to the default
    2^16, then the growth_interval's to :data:`DEFAULT_GROWTH_INTERVAL`."""
    to = target if target is not None and math.isfinite(target) and target > 0 else None
    init = row.get("init_scale")
    return (
        _log2_distance(init, to or DEFAULT_INIT_SCALE),
        _log2_distance(init, DEFAULT_INIT_SCALE),
        _log2_distance(row.get("growth_interval"), DEFAULT_GROWTH_INTERVAL),
    )


def rank_key(row: dict[str, Any], target: float | None = None) -> tuple[float, ...]:
    """:func:`merit`, then :func:`closeness` to ``target``; smaller is better."""
    return (*merit(row), *closeness(row, target))


def _reference(
    r: dict[str, Any],
    by_name: dict[str, dict[str, Any]],
    trials: list[dict[str, Any]],
    group: str,
    references: dict[str, dict[int, float]],
) -> tuple[float, str] | None:
    """The loss ``r`` is compared with: its baseline's at the same step, else the lowest loss
    among the ranked trials of its group at that step."""
    step = r.get("steps")
    ref = references.get(group, {}).get(step) if step is not None else None
    if is_finite_number(ref):
        return float(ref), group
    b = by_name.get(group)
    if b is not None and b["status"] == "ok" and b.get("steps") == step:
        if is_finite_number(b.get("final_loss")):
            return float(b["final_loss"]), group
    peers = [
        p
        for p in trials
        if p["status"] in RANKED
        and p.get("steps") == step
        and is_finite_number(p.get("final_loss"))
        and p.get("_group", "") == group
    ]
    if not peers:
        return None
    best = min(peers, key=lambda p: float(p["final_loss"]))
    return float(best["final_loss"]), f"best trial ({best['trial']})"


def finalize_rows(
    rows: list[dict[str, Any]],
    diverge_gap: float = DIVERGE_GAP,
    groups: dict[str, str] | None = None,
    *,
    references: dict[str, dict[int, float]] | None = None,
    stop_gap: float = STOP_GAP,
    top_rung: int | None = None,
    target: float | None = None,
) -> list[str]:
    """Fill ``reference``, ``reference_loss``, ``loss_gap`` and ``rank`` in place; mark trials whose
    gap exceeds the limit as diverged (``diverge_gap`` on the last rung -- the full steps --,
    ``stop_gap`` on earlier rungs). Returns the ranked trial names, best first. Idempotent: the
    status a row came with is kept aside and the rule applied again on every call.

    ``references[baseline][step]``: the baselines' logged losses; without one at a trial's step
    the baseline's final loss is used when it ran to that step, else the lowest loss among the
    ranked trials of the same group at that step. ``target``: the init_scale ties are broken
    towards (:func:`scale_target`; None: the conventional default)."""
    groups, references = groups or {}, references or {}
    by_name = {r["trial"]: r for r in rows}
    trials = [r for r in rows if r["kind"] == "trial"]
    for r in rows:
        r["status"] = r.setdefault("_base_status", r["status"])
        r["reason"] = r.setdefault("_base_reason", r.get("reason"))
        r["rank"] = None
        if r["kind"] == "trial":
            r["_group"] = groups.get(r["trial"], "")
            r["reference"] = r["reference_loss"] = r["loss_gap"] = None
    for r in trials:
        if r["status"] not in RANKED or not is_finite_number(r.get("final_loss")):
            continue
        got = _reference(r, by_name, trials, r["_group"], references)
        if got is None:
            continue
        ref, label = got
        r["reference"], r["reference_loss"] = label, ref
        r["loss_gap"] = (float(r["final_loss"]) - ref) / abs(ref) if ref != 0 else None
    for r in trials:
        last = top_rung is None or r.get("rung", 0) == top_rung
        limit = diverge_gap if last else stop_gap
        if r["status"] in RANKED and is_finite_number(r["loss_gap"]) and r["loss_gap"] > limit:
            r["status"] = "diverged"
            where = "final loss" if last else f"loss at step {r.get('steps')}"
            r["reason"] = (
                f"{where} {r['loss_gap']:+.1%} vs {r['reference']} (threshold +{limit:.0%}"
                + ("" if last else " before the last rung")
                + ")"
            )
    ranked = sorted(
        (r for r in trials if r["status"] in RANKED),
        key=lambda r: (-(r.get("rung") or 0), *rank_key(r, target)),
    )
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    return [r["trial"] for r in ranked]


def select_promoted(rows: list[dict[str, Any]], n: int, target: float | None = None) -> list[str]:
    """The best ``n`` ok trials of ``rows`` (one rung, after :func:`finalize_rows`), best first,
    and every further trial of the same :func:`merit` as the last of them: at a cut, a tie
    break never decides who stops."""
    ok = sorted(
        (r for r in rows if r["kind"] == "trial" and r["status"] == "ok"),
        key=lambda r: rank_key(r, target),
    )
    keep = ok[: max(n, 0)]
    if keep:
        cut = merit(keep[-1])
        keep += [r for r in ok[len(keep) :] if merit(r) == cut]
    return [r["trial"] for r in keep]


def live_divergence(
    step: int, loss: Any, reference: float | None, label: str, stop_gap: float = STOP_GAP
) -> str | None:
    """Why a trial must stop at once, from one logged row: its loss is not finite, or more than
    ``stop_gap`` above the reference loss at the same step. None while it is on track (or no
    reference is known yet)."""
    v = as_number(loss)
    if v is None or not math.isfinite(v):
        return f"stopped at step {step}: loss {loss}"
    if reference is None or not math.isfinite(reference) or reference <= 0:
        return None
    gap = (v - reference) / reference
    if gap > stop_gap:
        return (
            f"stopped at step {step}: loss {v:.4g} is {gap:+.0%} vs {label} ({reference:.4g}; "
            f"threshold +{stop_gap:.0%})"
        )
    return None


def fmt_value(v: float | int | str | None) -> str:
    """A number as an override value (integers without a decimal point)."""
    v2 = as_number(v)
    if v2 is None:
        return str(v)
    if v2 == int(v2) and abs(v2) < 1e15:
        return str(int(v2))
    return repr(v2)


def _train_command(plan: SweepPlan, ovr: list[str]) -> str:
    cd = ["--config-dir", str(plan.config_dir)] if plan.config_dir is not None else []
    return shlex.join(["ampctl", "train", *ovr, *cd])


def tie_info(
    rows: list[dict[str, Any]], best: dict[str, Any], target: float | None = None
) -> dict[str, Any]:
    """Who ``best`` (rank 1) tied with and how the tie was broken: ``tied`` (names, best first,
    ``best`` included; one name: no tie), ``rule`` (the :func:`closeness` rule that put ``best``
    first: ``"s_star"``, ``"default_init_scale"``, ``"default_growth_interval"``, ``"order"``, or
    None without a tie), ``target`` (the init_scale the first rule aimed at) and ``unscaled``:
    the fp16 trials without loss scaling that were as good on loss (same gap step) but ranked
    after the scaled ones."""
    peers = sorted(
        (r for r in rows if r.get("rank") is not None and r.get("rung") == best.get("rung")),
        key=lambda r: r["rank"],
    )
    m = merit(best)
    tied = [r for r in peers if merit(r) == m]
    unscaled_too = [
        r["trial"] for r in peers if r is not best and unscaled(r) and merit(r)[0] == m[0]
    ]
    aim = target if target is not None and math.isfinite(target) and target > 0 else None
    rule = None
    if len(tied) > 1:
        a, b = closeness(tied[0], aim), closeness(tied[1], aim)
        i = next((i for i in range(len(a)) if a[i] != b[i]), None)
        rule = (
            "order" if i is None else ("s_star", "default_init_scale", "default_growth_interval")[i]
        )
        if rule == "s_star" and aim is None:
            rule = "default_init_scale"
    return {
        "tied": [r["trial"] for r in tied],
        "rule": rule,
        "target": aim if aim is not None else DEFAULT_INIT_SCALE,
        "target_source": "s_star" if aim is not None else "default",
        "unscaled": unscaled_too,
    }


def recommend(
    plan: SweepPlan,
    rows: list[dict[str, Any]],
    ranking: list[str],
    target: float | None = None,
) -> dict | None:
    """The best trial that ran the full steps, as ``ampctl train`` overrides ready to paste,
    with :func:`tie_info` (``target``: the init_scale ties were broken towards)."""
    by_name = {r["trial"]: r for r in rows}
    best = by_name[ranking[0]] if ranking else None
    if best is None or best["status"] != "ok" or (best.get("rung") or 0) != plan.top_rung:
        return None
    trial = plan.trial(ranking[0])
    ovr = list(plan.fixed)
    for k, v in trial.swept.items():
        ovr.append(f"{k}={v}")
    for k in SCALE_KEYS:
        if not any(bare(t.split("=", 1)[0]) == k for t in ovr):
            ovr.append(f"{k}={fmt_value(getattr(trial.cfg.scaler, k.split('.')[1]))}")
    return {
        "trial": trial.name,
        "overrides": ovr,
        "command": _train_command(plan, ovr),
        "tie": tie_info(rows, best, target),
    }


def scale_target(plan: SweepPlan, rows: list[dict[str, Any]]) -> float | None:
    """The init_scale a tie is broken towards: :func:`s_star`'s recommended init_scale from the
    ranked trials' gradients (rows after :func:`finalize_rows`), None when none was logged."""
    s = s_star(plan, rows, None)
    return None if s is None else float(s["init_scale"])


def s_star(
    plan: SweepPlan, rows: list[dict[str, Any]], recommendation: dict[str, Any] | None
) -> dict[str, Any] | None:
    """``S* = 65504 / max|g|`` over the fp16 rows of the ranked trials, and the init_scale ampctl
    suggests from it (:func:`ampctl.amp.formats.recommended_init_scale`: S* rounded down to a
    power of two, halved for a 2x margin, within the scaler's bounds). Information beside the
    one recommendation, never a second command: ``tried`` names the best-ranked trial of the
    grid with that init_scale (None when the grid has none) and ``grid_override`` is then the
    sweep's init_scale override with it added, to paste into the next sweep (None when tried)."""
    used = [
        r
        for r in rows
        if r["kind"] == "trial"
        and r["status"] in RANKED
        and is_finite_number(r.get("max_grad_amax"))
    ]
    if not used:
        return None
    amax = max(float(r["max_grad_amax"]) for r in used)
    if amax <= 0:
        return None
    value = ideal_scale(amax)
    ref = plan.trial(recommendation["trial"]) if recommendation else plan.trial(used[0]["trial"])
    max_scale = max(t.cfg.scaler.max_scale for t in plan.trials if t.kind == "trial")
    init = recommended_init_scale(
        amax, min_scale=ref.cfg.scaler.min_scale, max_scale=ref.cfg.scaler.max_scale
    )
    tried = _trials_at(plan, rows, init)
    return {
        "value": value,
        "exponent": round(math.log2(value), 2),
        "init_scale": init,
        "max_grad_amax": amax,
        "rows": sum(int(r.get("_amax_rows") or 0) for r in used),
        "trials": len(used),
        "above_max_scale": value > max_scale,
        "max_scale": max_scale,
        "tried": tried[0]["trial"] if tried else None,
        "tried_rank": tried[0].get("rank") if tried else None,
        "tried_status": tried[0]["status"] if tried else None,
        "grid_override": None if tried else grid_override(plan, init),
    }


def _trials_at(plan: SweepPlan, rows: list[dict[str, Any]], init: float) -> list[dict[str, Any]]:
    """The grid's trials whose init_scale is ``init``, best-ranked first (unranked last)."""
    names = {t.name for t in plan.trials if t.kind == "trial" and t.cfg.scaler.init_scale == init}
    at = [r for r in rows if r["trial"] in names]
    return sorted(at, key=lambda r: (r.get("rank") is None, r.get("rank") or 0))


def grid_override(plan: SweepPlan, init: float) -> str:
    """The sweep's init_scale override (the key as the user wrote it) with ``init`` added to its
    values, in ascending order: ``scaler.init_scale=1024,16384,65536``."""
    key = next((k for k in plan.swept_keys if bare(k) == "scaler.init_scale"), "scaler.init_scale")
    values: list[str] = []
    for t in plan.trials:
        if t.kind != "trial":
            continue
        v = t.swept.get(key) or fmt_value(t.cfg.scaler.init_scale)
        if v not in values:
            values.append(v)
    values.append(fmt_value(init))
    values.sort(key=lambda v: (as_number(v) is None, as_number(v) or 0.0))
    return f"{key}={','.join(values)}"

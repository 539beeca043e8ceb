"""One diagnosis, start to end: read -> state health -> history -> replay -> the verdict on the
whole run (and the checkpoint to resume from) -> recommendations -> the report.

The trust rule (:mod:`ampctl.trust`) applies to the one step that could run code, the replay of
an ampctl checkpoint: its saved config goes through :func:`ampctl.config.config_from_saved`, so a
``_target_`` that does not ship with ampctl is imported only with ``--trust-code`` and an
interpolation is never evaluated. Without consent the state health and history are still
reported, and the replay is skipped with one line naming the target and the flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ampctl.amp import PRECISIONS, bf16_supported
from ampctl.errors import UsageError, first_line
from ampctl.runlog import RunLayout

from . import readers
from .common import STATE_KINDS, finite
from .course import CheckpointFacts
from .findings import replay_problems
from .fp8 import fp8_problems
from .health import applied_updates, state_health
from .history import branch_of, foreign_history, run_history, unreadable_history
from .loops import loop_problems
from .readers.base import Found, ReaderError
from .readers.histories import history_beside
from .recommend import Settings, apply_probe, fresh_overrides, recommend, resume_command
from .replay import ReplaySkipped, ampctl_input, hf_input, run_replay, skipped
from .report import build_report, report_json
from .stages import (
    Branch,
    Fp8Section,
    History,
    Problem,
    Replay,
    Report,
    Resume,
    ScalerState,
    StateHealth,
)
from .verdict import judge

__all__ = ["diagnose", "diagnose_report", "check_options"]


def check_options(batches: Any, precision: str | None, device: str) -> torch.device:
    """Validate the options; the device to replay on. Raises :class:`UsageError`."""
    from ampctl.train.builders import resolve_device

    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise UsageError(f"--batches {batches!r} is not allowed: give an integer >= 1")
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(
            f"--precision {precision!r} is not allowed: use one of {', '.join(PRECISIONS)}"
        )
    allowed = f"--device {device!r} is not allowed: use auto, cpu, cuda or cuda:N"
    try:
        dev = resolve_device(device)
    except UsageError:
        raise
    except (RuntimeError, ValueError):
        raise UsageError(allowed) from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(allowed)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(
            f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


# ---------------------------------------------------------------------------- config (trust)
def _trusted_config(found: Found, trust_code: bool) -> tuple[Any, str | None]:
    """An ampctl checkpoint's config through the trust rule: ``(cfg, None)`` or ``(None, why
    the replay is skipped)``. Nothing in the saved config is imported or evaluated here."""
    from ampctl.config import ConfigError, config_from_saved
    from ampctl.trust import UntrustedConfigError

    if found.config is None:
        return None, _unrecorded_model(found)
    try:
        return config_from_saved(
            found.config, [], source=str(found.path), trust_code=trust_code
        ), None
    except UntrustedConfigError as e:
        if "_target_" in e.key:
            return None, (
                f"the checkpoint's config names {e.key}={e.value!r}, which does not ship with "
                "ampctl: it is not imported (a checkpoint is data); add --trust-code to replay"
            )
        return None, (
            f"the checkpoint's config holds an interpolation at {e.key} ({e.value!r}): a saved "
            "config is data and nothing in it is evaluated, so the replay is skipped"
        )
    except ConfigError as e:
        return None, f"the checkpoint's config is not valid: {first_line(e)}"


#: Integration names in config.yaml -> the format whose terms the user's own setup speaks.
_INTEGRATION_TERMS = {"lightning": "lightning", "transformers": "hf-trainer"}


def integration_of(found: Found) -> str | None:
    """The ampctl integration that wrote the run folder (``config.yaml``'s ``integration``)."""
    who = (found.run_config or {}).get("integration")
    return who if isinstance(who, str) else None


def _unrecorded_model(found: Found) -> str:
    """Why a run without an ampctl config (no checkpoint, or one without config, e.g. a loop
    under ProtectedRun) cannot be replayed: the model is the user's code."""
    model = (found.run_config or {}).get("model")
    target = model.get("_target_") if isinstance(model, dict) else None
    who = integration_of(found)
    by = f"written by ampctl's '{who}' integration" if who else "with no ampctl config"
    head = (
        "no checkpoint in this run folder"
        if found.raw is None and not found.weights
        else "its checkpoint holds no config ampctl can rebuild the model from"
    )
    if isinstance(target, str):
        return (
            f"a run {by} and {head}: the model is your code (model._target_={target!r} in "
            f"{RunLayout.CONFIG}), imported only from a checkpoint's ampctl config with "
            "--trust-code; save the run's config in its checkpoints to replay"
        )
    return (
        f"a run {by} and {head}: the model is your code and the run does not record it "
        "(no model._target_), so ampctl cannot rebuild it"
    )


def _saved_number(config: dict[str, Any] | None, group: str, key: str) -> float | None:
    node = (config or {}).get(group)
    v = node.get(key) if isinstance(node, dict) else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _logged_lr(hist: History | None) -> float | None:
    """The largest learning rate the run logged (its peak: the one to lower)."""
    lrs = [r.learning_rate for r in (hist.rows if hist else []) if finite(r.learning_rate)]
    return max(lrs) if lrs else None


def _settings(found: Found, cfg: Any, scaler: ScalerState | None, hist: History | None) -> Settings:
    gi = scaler.growth_interval if scaler is not None else None
    scaled = found.scaler is not None or found.format == "ampctl"
    if found.format == "ampctl":
        if cfg is not None:
            return Settings(
                lr=cfg.optim.lr,
                clip=cfg.optim.clip_grad_norm,
                clip_known=True,
                fp32_modules=list(cfg.precision.fp32_modules),
                growth_interval=gi,
                warmup_steps=cfg.optim.warmup_steps,
            )
        mods = ((found.config or {}).get("precision") or {}).get("fp32_modules")
        warm = _saved_number(found.config, "optim", "warmup_steps")
        return Settings(
            lr=_saved_number(found.config, "optim", "lr") or _logged_lr(hist),
            clip=_saved_number(found.config, "optim", "clip_grad_norm"),
            clip_known=found.config is not None,
            fp32_modules=[str(m) for m in mods] if isinstance(mods, list) else [],
            growth_interval=gi,
            warmup_steps=int(warm) if warm is not None else None,
        )
    lr = None
    groups = (found.optimizer or {}).get("param_groups") or []
    if groups and isinstance(groups[0], dict):
        v = groups[0].get("initial_lr", groups[0].get("lr"))
        lr = float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
    return Settings(
        lr=lr or _logged_lr(hist), clip=None, clip_known=False, growth_interval=gi, scaled=scaled
    )


# ---------------------------------------------------------------------------- replay
def _replay(
    found: Found,
    cfg: Any,
    cfg_reason: str | None,
    problems: list[Problem],
    scaler: ScalerState | None,
    *,
    precision: str,
    dev: torch.device,
    batches: int,
    data_file: Path | None,
    trust_code: bool,
) -> tuple[Replay, Fp8Section | None]:
    if any(p.kind in ("nonfinite_weights", "nonfinite_master") for p in problems):
        return skipped(
            "the weights are already non-finite: a replay would only propagate the NaN/inf "
            "(meaningless)",
            precision,
            dev,
        ), _no_fp8(precision, None)
    try:
        if precision == "fp8":
            _require_torchao()
        common = {
            "precision": precision,
            "device": dev,
            "batches": batches,
            "data_file": data_file,
            "scaler": scaler,
        }
        if found.format == "ampctl":
            if cfg is None:
                raise ReplaySkipped(cfg_reason)
            inp = ampctl_input(found, cfg, trust_code=trust_code, **common)
        elif found.model_dir is not None:
            inp = hf_input(found, **common)
        elif found.run_dir is not None:
            raise ReplaySkipped(_unrecorded_model(found))
        else:
            raise ReplaySkipped(
                f"{found.format}: the checkpoint stores weights but not the model's class, so "
                "the model cannot be rebuilt without running your code (replay needs an ampctl "
                "checkpoint or a Hugging Face folder with config.json)"
            )
        rep, fp8 = run_replay(inp)
        return rep, fp8 or _no_fp8(precision, rep)
    except ReplaySkipped as e:
        rep = skipped(str(e), precision, dev)
        return rep, _no_fp8(precision, rep)


def _no_fp8(precision: str, rep: Replay | None) -> Fp8Section | None:
    """The report's ``fp8`` section when an fp8 replay did not produce one: why."""
    if precision != "fp8":
        return None
    why = rep.reason if rep is not None and rep.reason else "no fp8 layer was replayed"
    if rep is None:
        why = "the weights are already non-finite: a replay would only propagate the NaN/inf (meaningless)"
    return Fp8Section(ran=False, reason=why)


def _require_torchao() -> None:
    """The fp8 replay needs torchao: skip it with the install hint when it is missing."""
    from ampctl.amp import fp8

    try:
        fp8.require_torchao()
    except fp8.Fp8Unavailable as e:
        raise ReplaySkipped(str(e)) from None


# ---------------------------------------------------------------------------- checkpoints
def _facts(found: Found, state: StateHealth, problems: list[Problem]) -> CheckpointFacts:
    bad = sorted({p.kind for p in problems if p.kind in STATE_KINDS})
    if _written_at_stop(found):
        bad.append(WRITTEN_AT_STOP)
    sc = state.scaler
    return CheckpointFacts(
        path=str(found.path),
        step=found.step,
        bad=bad,
        scale=sc.scale if sc is not None and sc.enabled else None,
        applied=applied_updates(found.optimizer),
        weight_amax=state.weights.amax if state.weights.tensors else None,
    )


#: A checkpoint ampctl's trainer wrote when the guard stopped the run: its weights may be fine
#: but its scaler and optimizer hold what the trouble left (a collapsed scale), so it is never
#: a resume point, whatever its step.
WRITTEN_AT_STOP = "written when the guard stopped the run"


def _written_at_stop(found: Found) -> bool:
    raw = found.raw if found.format == "ampctl" and isinstance(found.raw, dict) else {}
    tr = raw.get("trainer")
    return isinstance(tr, dict) and tr.get("stopped") is True


def _sibling_facts(found: Found, trust_code: bool) -> list[CheckpointFacts]:
    """The other checkpoints of the same run written before this one, newest first."""
    out = []
    for p in found.siblings:
        try:
            other = readers.read(p, found.format, trust_code=trust_code)
        except (ReaderError, UsageError) as e:
            out.append(CheckpointFacts(str(p), None, [first_line(e)]))
            continue
        if found.step is not None and other.step is not None and other.step > found.step:
            continue
        st = state_health(other)
        out.append(_facts(other, st, st.problems + other.problems))
    return out


def _has_checkpoint(found: Found) -> bool:
    return (
        found.raw is not None
        or bool(found.weights)
        or found.optimizer is not None
        or (found.scaler is not None)
    )


# ---------------------------------------------------------------------------- the diagnosis
def diagnose(path: str | Path, **options: Any) -> dict[str, Any]:
    """Diagnose a checkpoint file or folder of any supported format; returns the report as
    JSON values (the ``--json`` content, schema in :mod:`ampctl.commands.diagnose.report`).
    ``options`` are :func:`diagnose_report`'s (``batches``, ``precision``, ``device``, ``fmt``,
    ``trust_code``, ``data``, ``max_memory``), which returns the report typed.

    Raises :class:`UsageError` for bad input (see :func:`diagnose_report`). **Syncs** (an
    offline tool: it reads every tensor)."""
    return report_json(diagnose_report(path, **options))


def diagnose_report(
    path: str | Path,
    *,
    batches: int = 2,
    precision: str | None = None,
    device: str = "auto",
    fmt: str | None = None,
    trust_code: bool = False,
    data: str | Path | None = None,
    max_memory: int | None = None,
    probe: bool = True,
    rebuild: str | None = None,
) -> Report:
    """Diagnose a checkpoint file or folder of any supported format; returns the report typed
    (:class:`~.stages.Report`; :func:`diagnose` returns it as JSON values).

    ``data``: what to replay instead of synthetic batches (a path the user names; one that the
    checkpoint names is opened only with ``trust_code``). ``max_memory``: bytes the checkpoint
    may take (default: :func:`ampctl.trust.memory_limit`). ``probe``: try the advice first;
    ``rebuild``: the user's ``MODULE:FUNCTION`` that builds the model for it (:mod:`.probe_loop`).

    Raises :class:`UsageError` for bad input: a missing path, nothing readable, a refused pickle,
    a file or a memory estimate over the limits of :mod:`ampctl.trust`, ``batches < 1``, an
    unknown ``precision``, ``device`` or ``fmt``. **Syncs** (an offline tool: it reads every
    tensor)."""
    from ampctl import trust

    with trust.max_memory(max_memory):
        return _diagnose(path, batches, precision, device, fmt, trust_code, data, (probe, rebuild))


def _read(path: str | Path, fmt: str | None, trust_code: bool, data_file: Path | None) -> Found:
    found = readers.read(path, fmt, trust_code=trust_code)
    if data_file is not None and found.model_dir is None and found.format != "ampctl":
        found.notes.append(
            f"--data is used for Hugging Face and ampctl checkpoints; a {found.format} "
            "checkpoint is not replayed"
        )
    return found


def _history(
    found: Found, state: StateHealth, branch: Branch | None
) -> tuple[History | None, list[Problem]]:
    hist = None
    if found.run_dir is not None:
        hist = run_history(found.run_dir, found.step, state.scaler, branch)
    elif (fh := found.history or history_beside(found)) is not None:
        hist = foreign_history(fh, found.step)  # another tool's log, found beside (#40)
    return hist, unreadable_history(found, hist)


def _at_the_end(j: Any, cfg: Any, recs: list) -> bool:
    """Whether the resume checkpoint is an ampctl run's last step (``trainer.max_steps``) and
    none of the changes takes effect on ``--resume`` (scaler, precision): resuming it would
    train nothing with nothing changed, so the change is tried and given as a fresh start."""
    from .recommend import resume_overrides

    if j.resume is None or cfg is None or not j.problems or not recs or resume_overrides(recs):
        return False
    step = next((c.step for c in j.checkpoints if c.path == j.resume), None)
    return step is not None and step >= cfg.trainer.max_steps


def _probe(found, cfg, cfg_reason, j, recs, trust_code: bool, dev, probe, origin, lr):
    """The advice tried before it is printed (:mod:`.probe`) from ``origin`` (None: afresh).
    ``probe``: (whether to, the user's rebuild factory or None); ``lr``: the run's."""
    from .probe import ProbeOutcome, probe_advice
    from .recommend import resume_overrides

    if not probe[0]:
        return ProbeOutcome(False, "--no-probe")
    has_lr = any(r.key == "optim.lr" for r in recs)
    ladder = list(j.lr.ladder) if has_lr and j.lr is not None else []
    overrides = resume_overrides(recs) if origin else [r.override for r in recs]
    return probe_advice(
        fmt=found.format,
        cfg=cfg,
        cfg_reason=cfg_reason,
        resume=origin,
        overrides=overrides,
        ladder=ladder,
        trust_code=trust_code,
        device=dev,
        found=found,
        rebuild=probe[1],
        run_lr=lr,
    )


def _diagnose(
    path: str | Path,
    batches: int,
    precision: str | None,
    device: str,
    fmt: str | None,
    trust_code: bool,
    data: str | Path | None,
    probe: tuple[bool, str | None] = (True, None),
) -> Report:
    dev = check_options(batches, precision, device)
    data_file = Path(data) if data is not None else None
    if data_file is not None and not data_file.exists():
        raise UsageError(f"--data {str(data)!r} does not exist: give a text file or folder")
    # 1. read, and the state's health
    found = _read(path, fmt, trust_code, data_file)
    replay_precision = precision or found.precision or "fp32"
    if replay_precision == "bf16" and not bf16_supported(dev):
        raise UsageError(f"--precision bf16 is not supported on {dev}: use fp16 or fp32")
    state = state_health(found)
    problems = list(found.problems) + list(state.problems)
    cfg, cfg_reason = (None, None)
    if found.format == "ampctl":
        cfg, cfg_reason = _trusted_config(found, trust_code)
    # 2. history
    branch = branch_of(found.path, found.run_dir) if found.format == "ampctl" else None
    hist, unread = _history(found, state, branch)
    if found.precision is None and hist is not None and hist.scale_trajectory and not precision:
        # weights alone (save_pretrained), beside a history that logs a loss scale: fp16
        found.precision, found.precision_source = "fp16", "the history logs a loss scale"
        replay_precision = "fp16"
    # 3. replay
    rep, fp8_section = _replay(
        found,
        cfg,
        cfg_reason,
        problems,
        state.scaler,
        precision=replay_precision,
        dev=dev,
        batches=batches,
        data_file=data_file,
        trust_code=trust_code,
    )
    if rep.ran:
        problems += replay_problems(rep) + fp8_problems(fp8_section)
    # 4. the verdict on the whole run: history, the other checkpoints, the scaler's record,
    # and the loop's own mistakes (in its terms)
    who = integration_of(found)
    terms = _INTEGRATION_TERMS.get(who or "", "state-dict") if who else found.format
    problems += loop_problems(found, state, hist, terms)
    settings = _settings(found, cfg, state.scaler, hist)
    own = _facts(found, state, problems) if _has_checkpoint(found) else None
    j = judge(
        own=own,
        siblings=_sibling_facts(found, trust_code),
        problems=problems,  # an unreadable history is named (a note), never judged
        h=hist,
        scaler=state.scaler,
        rep=rep if rep.ran else None,
        lr=settings.lr,
        scaled=settings.scaled,
    )
    # 5. what to change, and where to resume
    recs = recommend(
        terms,
        settings,
        found.precision,
        list(found.fp32_modules),
        state,
        hist,
        rep if rep.ran else None,
        j,
        bf16_supported(dev),
        fp8=fp8_section,
    )
    healthy = any(c.healthy for c in j.checkpoints)
    before = j.verdict.first_bad_step if healthy else None
    checked = None
    origin = None if _at_the_end(j, cfg, recs) else j.resume  # a run's last step resumes nothing
    if j.problems and (recs or origin):  # a change, or resuming unchanged, is tried first
        outcome = _probe(
            found, cfg, cfg_reason, j, recs, trust_code, dev, probe, origin, settings.lr
        )
        recs = apply_probe(recs, outcome, terms)
        checked = outcome.line()
    fresh = fresh_overrides(found.config) if found.format == "ampctl" and cfg is not None else None
    command = resume_command(terms, origin, recs, len(j.checkpoints), before, fresh)
    if origin is None and j.resume is not None and recs:
        command = command.split("   #", 1)[0] + (
            "   # the healthy checkpoint is the run's last step: rerun it with the changes"
        )
    if who is not None and not j.checkpoints:
        command = (
            f"no checkpoint in the run folder: rerun your loop ({who} integration) from your "
            "own last checkpoint, with the changes above"
        )
    return build_report(
        found,
        state=state,
        history=hist,
        replay=rep,
        fp8=fp8_section,
        problems=j.problems + unread,
        recommendations=recs,
        checkpoints=j.checkpoints,
        resume=Resume(j.resume, command, j.resume_why, checked),
        branch=branch,
        verdict=j.verdict,
    )

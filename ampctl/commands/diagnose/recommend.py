"""Part 4 of a diagnosis (the report's "4. Recommendations", after the verdict): what to change, in
ampctl's terms and in the user's own.

Each recommendation is an ampctl override (``optim.lr=0.0005``) with its reason and, for a
checkpoint written by another tool, the same change in that tool's terms (``yours``):
``TrainingArguments`` names for the HF Trainer, the ``Trainer``/plugin arguments for Lightning,
``Accelerator``/``GradScaler`` arguments for Accelerate and plain loops, ``ds_config`` keys for
DeepSpeed. Which changes follow from the verdict's cause (:mod:`.verdict`): an lr divergence
uses the lr the history gives (:func:`.verdict.lr_change`: the lr at which the loss last fell,
no fixed factor; warmup or clipping too) and changes no precision, a module whose forward
or backward leaves fp16's range runs in fp32 (or the run in bf16), a collapsed scale gets the fix
of its cause, an overflow storm of unknown cause the guard's rollback. The recommended
``init_scale`` is :func:`ampctl.amp.formats.recommended_init_scale` (S* = 65504 / max|g| rounded
down to a power of two, halved as a margin), the one definition ``sweep-scale`` uses too. Pure
functions of the stages' records.
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ampctl.amp.scaler import ScalerConfig

from .common import plain
from .fp8 import fp8_findings
from .stages import Fp8Section, History, Recommendation, Replay, StateHealth
from .verdict import Judgement

DEFAULT_MAX_SCALE = ScalerConfig.max_scale  # LossScaler's default ceiling (2^24)

__all__ = [
    "apply_probe",
    "fresh_overrides",
    "recommend",
    "yours",
    "resume_command",
    "resume_overrides",
    "Settings",
]


@dataclass
class Settings:
    """The run's settings that recommendations start from (None: not recorded)."""

    lr: float | None
    clip: float | None
    clip_known: bool
    fp32_modules: list[str] = field(default_factory=list)
    growth_interval: int | None = None
    warmup_steps: int | None = None
    scaled: bool = True  # the run had a loss scaler (fp16), or a check of non-finite steps


# ---------------------------------------------------------------------------- user's terms
def _gradscaler(arg: str) -> str:
    return f"torch.amp.GradScaler({arg})"


def yours(fmt: str, override: str) -> str | None:
    """The override in the terms of the tool that wrote the checkpoint (None for ampctl)."""
    key, _, value = override.partition("=")
    if fmt == "ampctl":
        return None
    if key == "optim.lr":
        return {
            "hf-trainer": f"TrainingArguments(learning_rate={value})",
            "lightning": f"lr={value} in your LightningModule.configure_optimizers",
            "deepspeed": f'ds_config "optimizer": {{"params": {{"lr": {value}}}}}',
        }.get(fmt, f"torch.optim.AdamW(params, lr={value})")
    if key == "optim.clip_grad_norm":
        return {
            "hf-trainer": f"TrainingArguments(max_grad_norm={value})",
            "lightning": f"Trainer(gradient_clip_val={value})",
            "accelerate": f"accelerator.clip_grad_norm_(model.parameters(), {value})",
            "deepspeed": f'ds_config "gradient_clipping": {value}',
        }.get(fmt, f"torch.nn.utils.clip_grad_norm_(model.parameters(), {value})")
    if key == "precision" and value == "bf16":
        return {
            "hf-trainer": "TrainingArguments(bf16=True, fp16=False)",
            "lightning": 'Trainer(precision="bf16-mixed")',
            "accelerate": 'Accelerator(mixed_precision="bf16")',
            "deepspeed": 'ds_config "bf16": {"enabled": true} (and drop "fp16")',
        }.get(fmt, "torch.autocast(device_type, dtype=torch.bfloat16), without a GradScaler")
    if key == "scaler.init_scale":
        power = int(math.log2(float(value))) if float(value) > 0 else 0
        return {
            "hf-trainer": f"{_gradscaler(f'init_scale={value}')} (Trainer: through Accelerate's "
            f"GradScalerKwargs(init_scale={value}))",
            "lightning": f'MixedPrecision("16-mixed", device, scaler={_gradscaler(f"init_scale={value}")})',
            "accelerate": f"Accelerator(kwargs_handlers=[GradScalerKwargs(init_scale={value})])",
            "deepspeed": f'ds_config "fp16": {{"initial_scale_power": {power}}}',
        }.get(fmt, _gradscaler(f"init_scale={value}"))
    if key == "scaler.growth_interval":
        return {
            "accelerate": f"Accelerator(kwargs_handlers=[GradScalerKwargs(growth_interval={value})])",
            "deepspeed": f'ds_config "fp16": {{"loss_scale_window": {value}}}',
        }.get(fmt, _gradscaler(f"growth_interval={value}"))
    if key == "optim.warmup_steps":
        return {
            "hf-trainer": f"TrainingArguments(warmup_steps={value})",
            "lightning": "a warmup scheduler in configure_optimizers: torch.optim.lr_scheduler."
            f"LinearLR(optimizer, start_factor=0.01, total_iters={value}), interval 'step'",
            "deepspeed": f'ds_config "scheduler": {{"type": "WarmupLR", "params": '
            f'{{"warmup_num_steps": {value}}}}}',
        }.get(
            fmt,
            f"torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters={value})",
        )
    if key == "guard.rollback_after":
        return {
            "hf-trainer": f'protect_trainer(trainer, run_dir=..., guard={{"rollback_after": {value}}})'
            " (ampctl.integrations.transformers)",
            "lightning": f'AmpctlCallback(run_dir, precision="fp16", guard={{"rollback_after": '
            f"{value}}}) (ampctl.integrations.lightning)",
            "accelerate": "install_scaler(accelerator) and protected_run(accelerator, model, "
            f'optimizer, guard={{"rollback_after": {value}}}) (ampctl.integrations.accelerate)',
        }.get(
            fmt,
            f'ProtectedRun(model, optimizer, LossScaler(), guard={{"rollback_after": {value}}}) '
            "around your loop (ampctl.integrations): a storm rolls back to the last good state",
        )
    if key == "guard.enabled":
        return {
            "hf-trainer": "protect_trainer(trainer) (ampctl.integrations.transformers): its "
            "LossScaler skips a step whose gradients are not finite, in bf16 and fp32 too",
            "lightning": "AmpctlCallback(run_dir) (ampctl.integrations.lightning): its "
            "LossScaler skips a step whose gradients are not finite, in bf16 and fp32 too",
            "accelerate": "install_scaler(accelerator) (ampctl.integrations.accelerate): a "
            "LossScaler that skips a step whose gradients are not finite, in bf16 and fp32 too",
        }.get(
            fmt,
            "ampctl.amp.LossScaler(enabled=False) around optimizer.step (scaler.step(optimizer); "
            "scaler.update()): no scaling in bf16/fp32, but a step whose gradients are not "
            "finite is skipped",
        )
    if key == "precision.fp32_modules":
        mods = value.strip("[]")
        return (
            f"run {mods} in fp32: wrap its forward in torch.autocast(device_type, enabled=False) "
            "with float32 inputs (or train under ampctl's guard, which does it for you)"
        )
    if key == "precision.fp8_exclude":
        return (
            f"keep {value.strip('[]')} out of torchao's convert_to_float8_training "
            "(module_filter_fn returns False for them)"
        )
    if key == "precision":
        return f"train in {value}"
    return None


# ---------------------------------------------------------------------------- rules
def _module_of(param: str) -> str:
    """The module a parameter belongs to (``a.b.weight`` -> ``a.b``)."""
    return param.rsplit(".", 1)[0] if "." in param else param


def _fp32_modules(
    rep: Replay | None, hist: History | None, in_fp32: list[str], j: Judgement
) -> tuple[list[str], bool]:
    """Modules to move to fp32 -- the replay's first overflowing one (forward or backward), what
    the guard promoted, the modules of the parameters an overflow storm named -- and whether the
    overflow persists whatever runs in fp32."""
    new: list[str] = []
    persistent = False
    kinds = {p.kind for p in j.problems}
    fb = rep.forward_first_bad if rep else None
    if fb is not None and fb.fp32_finite:
        if fb.module == "<model>" or fb.module in in_fp32:
            persistent = True  # the module cannot be isolated, or is fp32 already
        else:
            new.append(fb.module)
    bb = rep.backward_first_bad if rep else None
    if bb is not None and "backward_nonfinite" in kinds and bb.module not in in_fp32:
        if bb.module == "<model>":
            persistent = True
        else:
            new.append(bb.module)
    if hist is not None:
        undone = {
            str(e.data.get("module")) for e in hist.guard_events if e.kind == "promotion_undone"
        }
        new += [m for m in hist.promotions if m not in new and m not in undone]
    if "overflow_storm" in kinds and rep is None and not new and j.storm_params:
        new += list(dict.fromkeys(_module_of(p) for p in j.storm_params))
    return new, persistent


@dataclass
class _Recs:
    fmt: str
    out: list[Recommendation] = field(default_factory=list)

    def add(self, override: str, reason: str) -> None:
        key = override.split("=", 1)[0]
        if all(r.key != key for r in self.out):
            self.out.append(Recommendation(override, reason, yours(self.fmt, override)))


def recommend(
    fmt: str,
    settings: Settings,
    precision: str | None,
    in_fp32: list[str],
    state: StateHealth,
    hist: History | None,
    rep: Replay | None,
    j: Judgement,
    bf16_ok: bool,
    *,
    fp8: Fp8Section | None = None,
) -> list[Recommendation]:
    """The recommendations, rule by rule (numbered below), from the verdict ``j``."""
    recs = _Recs(fmt)
    kinds = {p.kind for p in j.problems}
    if "unchecked_update" in kinds:  # the loop applied gradients its GradScaler never checked:
        return []  # neither the lr nor the precision, its fix is in the loop (.loops)
    # 1) lr: a divergence of the loss gives it from the history; exploding updates are clipped
    _lr_rules(recs, settings, kinds, j)
    # an lr divergence is the cause: the overflows it led to are its effect, so no precision
    # change (the module overflowed because the weights blew up, not for fp16's range)
    lr_cause = j.problems and j.problems[0].kind == "lr_divergence"
    # 2) fp32 modules: the replay's first overflowing module (forward or backward), what the
    #    guard promoted, the modules of the parameters a storm named
    new, persistent = _fp32_modules(rep, hist, in_fp32, j) if not lr_cause else ([], False)
    if new:
        mods = list(dict.fromkeys(settings.fp32_modules + in_fp32 + new))
        one = len(new) == 1
        where = "backward" if "backward_nonfinite" in kinds and not rep.forward_first_bad else ""
        add_reason = (
            f"{', '.join(new)} overflow{'s' if one else ''} in fp16"
            + (f" (in the {where} pass)" if where else "")
            + f": run {'it' if one else 'them'} in fp32, keep the rest in fp16"
        )
        recs.add(f"precision.fp32_modules=[{','.join(mods)}]", add_reason)
    # 3) bf16: forward overflows that fp32 modules do not cure, a backward that leaves fp16's
    #    range, a scale that collapsed on persistent overflow, or that cannot go lower
    if not lr_cause:
        _bf16_rules(recs, rep, hist, state, kinds, j, precision, bf16_ok, persistent)
    if not lr_cause and hist is not None and hist.fallbacks and hist.fallbacks[-1].to:
        last = hist.fallbacks[-1]
        recs.add(f"precision={last.to}", f"the guard fell back to {last.to} at step {last.step}")
    # 4) fp8: keep the layers with too little headroom out of fp8 (the config key the plugin
    #    excludes layers with); bf16 when a cast went non-finite or half the layers are tight
    _fp8_rules(fp8, recs.add, bf16_ok)
    # 5) loss scale: underflow / overflow at the checkpoint's scale (not when the scale
    #    collapsed: the run resumes from before it)
    _scale_rules(recs, rep, kinds, j, settings)
    # 6) a storm whose cause the record does not show, or steps the run applied although they
    #    were not finite: the guard (rollback after overflows in a row; skip non-finite steps)
    if "overflow_storm" in kinds and not new and fmt != "ampctl":
        recs.add(
            "guard.rollback_after=3",
            "roll back to the last good state after 3 overflows in a row (and cut the scale), "
            "instead of skipping on at a falling scale",
        )
    if kinds & {"nonfinite_weights", "nonfinite_master"} and not settings.scaled:
        recs.add(
            "guard.enabled=true",
            "the run applied an update whose gradients were not finite (no scaler checked them): "
            "skip such steps",
        )
    return recs.out


def _lr_rules(recs: _Recs, settings: Settings, kinds: set[str], j: Judgement) -> None:
    """1) the lr the history gives (:func:`.verdict.lr_change`; a probe may replace it with the
    best candidate that held, :mod:`.probe`), a warmup when the loss rose from the first
    updates, and clipping. No lr without a divergence of the loss: updates that blew up while
    the loss kept its course show no lr to go back to (clipping bounds them), and non-finite
    values no update explains are no lr problem (:func:`.verdict.judge` says so)."""
    exploding = {
        "nonfinite_optimizer_state",
        "extreme_optimizer_state",
        "grad_norm_explosion",
        "forward_nonfinite_fp32",
        "backward_nonfinite_fp32",
    }
    lr_first = bool(j.problems) and j.problems[0].kind == "lr_divergence"
    unchecked = (
        kinds & {"nonfinite_weights", "nonfinite_master"} and not settings.scaled and not lr_first
    )
    ch = j.lr
    if ch is not None and ch.lr is not None and not unchecked:
        what = (
            "the learning rate made the run diverge"
            if "lr_divergence" in kinds
            else "updates diverged (optimizer state, grad norm, or non-finite in fp32 too)"
        )
        since = f" (from {plain(_round(settings.lr))})" if settings.lr else ""
        recs.add(
            f"optim.lr={plain(_round(ch.lr))}",
            f"{what}: {ch.why}; use lr {plain(_round(ch.lr))}{since}"
            + ("" if ch.known else " (not known to hold: the probe tries it)"),
        )
        d = j.course.departure
        if d is not None and d.never_improved and not settings.warmup_steps:
            recs.add(
                f"optim.warmup_steps={max(10, 2 * d.step)}",
                "the loss rose at the first updates: ramp the learning rate up",
            )
    if (
        kinds & (exploding | {"lr_divergence"})
        and (settings.lr is not None or j.lr)
        and not unchecked
        and not j.unexplained
    ):
        if not settings.clip_known:
            recs.add(
                "optim.clip_grad_norm=1.0", "clip the gradient norm to 1.0 if you do not already"
            )
        elif settings.clip is None or settings.clip > 1.0:
            recs.add(
                "optim.clip_grad_norm=1.0", "clip the gradient norm to 1.0 (the BERT-Large recipe)"
            )


def _round(x: float) -> float:
    """Two significant digits: 0.03, 0.00015."""
    if not (math.isfinite(x) and x > 0):
        return x
    digits = 1 - math.floor(math.log10(x))
    return round(x, digits)


def _bf16_rules(
    recs: _Recs,
    rep: Replay | None,
    hist: History | None,
    state: StateHealth,
    kinds: set[str],
    j: Judgement,
    precision: str | None,
    bf16_ok: bool,
    persistent: bool,
) -> None:
    scaler = state.scaler
    fwd_count = max(
        (scaler.forward_overflows if scaler else 0) or 0, hist.forward_overflows if hist else 0
    )
    fb = rep.forward_first_bad if rep else None
    why = None
    if (fb is not None and fb.fp32_finite and fwd_count >= 2) or "nonfinite_loss" in kinds:
        persistent = True
    if persistent:
        why = "forward overflows persist in fp16: bf16 has fp32's range (no loss scaling needed)"
    elif "backward_nonfinite" in kinds:
        why = "or run in bf16: it has fp32's range, so the backward stays finite"
    elif j.collapse == "overflow" and "lr_divergence" not in kinds:
        why = (
            "the scale collapsed on persistent overflow: bf16 has fp32's range (no loss "
            "scaling needed)"
        )
    if why and precision in ("fp16", "fp16-pure") and bf16_ok:
        recs.add("precision=bf16", why)


def _scale_rules(
    recs: _Recs, rep: Replay | None, kinds: set[str], j: Judgement, settings: Settings
) -> None:
    g = rep.gradients if rep else None
    if j.collapse == "floor" and g is not None:
        recs.add(
            f"scaler.min_scale={plain(min(1.0, g.recommended_init_scale))}",
            f"the floor is above S* = {g.ideal_scale:.4g}: let the scale go low enough",
        )
    if g is not None and ({"gradient_underflow", "backward_overflow"} & kinds):
        why = (
            "gradients underflow at the current scale"
            if "gradient_underflow" in kinds
            else "gradients overflow at the current scale"
        )
        # past the run's ceiling only for underflow (overflow never needs a larger scale)
        rec = g.recommended_init_scale
        if "gradient_underflow" in kinds and g.recommended_init_scale_unbounded > g.max_scale:
            rec = g.recommended_init_scale_unbounded
        if j.collapse == "floor":  # the floor is the problem: below it
            rec = g.recommended_init_scale_unbounded
        recs.add(
            f"scaler.init_scale={plain(rec)}",
            f"{why}: S* = 65504 / max|g| = 65504 / {g.max_abs:.4g} = {g.ideal_scale:.4g}, "
            "rounded down to a power of two and halved",
        )
        if rec > g.max_scale:
            recs.add(
                f"scaler.max_scale={plain(max(rec, DEFAULT_MAX_SCALE))}",
                f"the run's max_scale {g.max_scale:g} holds the scale below S*",
            )
    if "scale_at_ceiling" in kinds and (settings.growth_interval or 0) < 2000:
        recs.add(
            "scaler.growth_interval=2000",
            "the scale grew without bound: GradScaler's default interval lets it grow only after "
            "2000 steps without an overflow",
        )
    if "overflow_after_growth" in kinds and settings.growth_interval:
        recs.add(
            f"scaler.growth_interval={settings.growth_interval * 4}",
            "the scale keeps growing into overflow: grow 4x less often",
        )


def _fp8_rules(fp8: Fp8Section | None, add: Callable[[str, str], None], bf16_ok: bool) -> None:
    bad = fp8_findings(fp8)
    if not bad:
        return
    names = [m.name for m in bad]
    patterns = list(dict.fromkeys([*fp8.exclude, *names]))
    first = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    add(
        f"precision.fp8_exclude=[{','.join(patterns)}]",
        f"{first.name}{more}: {first.findings[0]}; keep {'it' if len(bad) == 1 else 'them'}"
        " out of fp8 (bf16, as the guard's demotion does), the other layers stay in fp8",
    )
    if bf16_ok and (any(m.nonfinite for m in bad) or 2 * len(bad) >= len(fp8.layers)):
        add(
            "precision=bf16",
            "fp8 casts went non-finite or half the fp8 layers lack headroom: fall back to bf16 "
            "if excluding them does not cure it",
        )


def apply_probe(recs: list[Recommendation], outcome, fmt: str = "ampctl") -> list[Recommendation]:
    """The recommendations with the lr the probe chose (:class:`.probe.ProbeOutcome`): the best
    candidate that held replaces the history's ``optim.lr``; with none held, the reason says so."""
    out = []
    for r in recs:
        if r.key == "optim.lr" and outcome.ran:
            chosen = outcome.chosen
            if chosen is not None and chosen.lr is not None:
                override = f"optim.lr={plain(chosen.lr)}"
                r = Recommendation(
                    override,
                    f"{r.reason.split('; use lr')[0]}; the probe tried "
                    f"{len(outcome.trials)} lr(s) and lr {plain(chosen.lr)} held best",
                    yours(fmt, override),
                )
            elif chosen is None:
                r = Recommendation(r.override, f"{r.reason}; the probe: it did not hold", r.yours)
        out.append(r)
    return out


def resume_overrides(recs: list[Recommendation]) -> list[str]:
    """Overrides that take effect on ``ampctl train --resume`` (precision and scaler state come
    from the checkpoint there)."""
    return [
        r.override
        for r in recs
        if r.override.startswith(("precision.fp32_modules=", "precision.fp8_exclude=", "optim."))
    ]


def _value(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | tuple):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, float):
        return plain(v)
    return str(v)


def _leaves(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def fresh_overrides(saved: dict | None) -> list[str] | None:
    """The ``key=value`` overrides that make ``ampctl train``'s default config the run's saved
    one (``+key=`` for a key the default lacks, ``~key`` for one the run dropped; ``name`` left
    out so that the fresh run gets a folder of its own): a fresh start of the same run. Plain
    data only (the saved config is not evaluated). None: no config, or not one of ampctl's."""
    if not isinstance(saved, dict) or _packaged(None) is None:
        return None
    default, mine = dict(_packaged(None)), _leaves(saved)
    out = []
    for group in _GROUP_NAMES:  # a group that is mostly another option: that option, then diffs
        choice = _group_choice(group, mine, default)
        if choice is not None:
            out.append(f"{group}={choice[0]}")
            default.update(choice[1])
    for k, v in mine.items():
        if k == "name" or isinstance(v, dict):
            continue
        if k not in default:
            out.append(f"+{k}={_value(v)}")
        elif default[k] != v:
            out.append(f"{k}={_value(v)}")
    out += [f"~{k}" for k in default if k not in mine and k != "name"]
    return out


_GROUP_NAMES = ("model", "data", "optim", "precision", "scaler", "guard")
#: A group of the saved config is matched against the packaged options only when it differs from
#: the default option in more keys than this (composing each option costs a Hydra compose).
_GROUP_DIFFS = 5


def _group_choice(
    group: str, mine: dict[str, object], default: dict[str, object]
) -> tuple[str, dict[str, object]] | None:
    """The packaged option of ``group`` (``conf/<group>/*.yaml``) closest to the saved config,
    when it is closer than the default, and its leaves."""
    from ampctl.config import packaged_conf_dir

    def diffs(leaves: dict[str, object]) -> int:
        keys = {k for k in (*leaves, *mine) if k.startswith(f"{group}.")}
        return sum(leaves.get(k) != mine.get(k) for k in keys)

    best = (diffs(default), None, None)
    if best[0] <= _GROUP_DIFFS:
        return None
    for opt in sorted(p.stem for p in (packaged_conf_dir() / group).glob("*.yaml")):
        if (leaves := _packaged(f"{group}={opt}")) is None:
            continue
        n = diffs(leaves)
        if n < best[0]:
            best = (n, opt, {k: v for k, v in leaves.items() if k.startswith(f"{group}.")})
    return None if best[1] is None else (best[1], best[2])


@functools.cache
def _packaged(option: str | None) -> dict[str, object] | None:
    """The leaves of ampctl's default config, with one packaged group option or none (None: it
    does not compose). A Hydra compose each, the same for every diagnosis: composed once a
    process (the caller copies before changing it)."""
    from ampctl.config import ConfigError, load_config

    try:
        return _leaves(load_config([option] if option else []).to_dict())
    except ConfigError:
        return None


def resume_command(
    fmt: str,
    checkpoint: str | None,
    recs: list[Recommendation],
    checked: int = 1,
    before: int | None = None,
    fresh: list[str] | None = None,
) -> str:
    """How to continue from ``checkpoint`` in the user's own tool (ampctl: a command line, each
    word quoted for a POSIX shell: a list value such as ``[*ln_*]`` is a glob to bash and zsh).
    ``before``: the first sign of trouble, when no checkpoint was written before it."""
    none = (
        f"no checkpoint was written before the first sign of trouble (step {before})"
        if before is not None
        else f"no healthy checkpoint among the {checked} checked"
    )
    if fmt == "ampctl":
        if checkpoint is None:
            short = "none before the trouble" if before is not None else "no healthy checkpoint"
            changes = [r.override for r in recs if r.override]
            keys = {c.split("=", 1)[0] for c in changes}
            # the run's own config (fresh), its keys that a change sets left to the change
            base = [o for o in fresh or [] if o.lstrip("+~").split("=", 1)[0] not in keys]
            return shlex.join(["ampctl", "train", *base, *changes]) + f"   # {short}: start afresh"
        return shlex.join(["ampctl", "train", "--resume", checkpoint, *resume_overrides(recs)])
    if checkpoint is None:
        return f"{none}: start afresh with the changes above"
    return {
        "hf-trainer": f'trainer.train(resume_from_checkpoint="{checkpoint}")',
        "lightning": f'trainer.fit(model, ckpt_path="{checkpoint}")',
        "accelerate": f'accelerator.load_state("{checkpoint}")',
        "dcp": f'torch.distributed.checkpoint.load(state_dict, checkpoint_id="{checkpoint}")',
        "deepspeed": f'engine.load_checkpoint("{_parent(checkpoint)}", tag="{_name(checkpoint)}")',
        "safetensors": f'model.load_state_dict(safetensors.torch.load_file("{checkpoint}"))',
    }.get(fmt, f'torch.load("{checkpoint}", weights_only=True) and load_state_dict')


def _parent(p: str) -> str:
    return p.rsplit("/", 1)[0] if "/" in p else "."


def _name(p: str) -> str:
    return p.rsplit("/", 1)[-1]

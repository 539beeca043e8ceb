"""Part 4 of a diagnosis: what to change, in ampctl's terms and in the user's own.

Each recommendation is an ampctl override (``optim.lr=0.0005``) with its reason and, for a
checkpoint written by another tool, the same change in that tool's terms (``yours``):
``TrainingArguments`` names for the HF Trainer, the ``Trainer``/plugin arguments for Lightning,
``Accelerator``/``GradScaler`` arguments for Accelerate and plain loops, ``ds_config`` keys for
DeepSpeed. The recommended ``init_scale`` is :func:`ampctl.amp.formats.recommended_init_scale`
(S* = 65504 / max|g| rounded down to a power of two, halved as a margin), the one definition
``sweep-scale`` uses too. Pure functions of the report's parts.
"""

from __future__ import annotations

import math
from typing import Any

from ampctl.amp.scaler import ScalerConfig

from .common import plain
from .fp8 import fp8_findings

DEFAULT_MAX_SCALE = ScalerConfig.max_scale  # LossScaler's default ceiling (2^24)

__all__ = ["recommend", "yours", "resume_command", "resume_overrides", "Settings"]


class Settings:
    """The run's settings that recommendations start from (None: not recorded)."""

    def __init__(
        self,
        *,
        lr: float | None,
        clip: float | None,
        clip_known: bool,
        fp32_modules: list[str],
        growth_interval: int | None,
    ) -> None:
        self.lr = lr
        self.clip = clip
        self.clip_known = clip_known
        self.fp32_modules = fp32_modules
        self.growth_interval = growth_interval


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
def _fp32_modules(
    rep: dict[str, Any] | None, hist: dict[str, Any] | None, exempted: list[str]
) -> tuple[list[str], bool]:
    """Modules to move to fp32 (the replay's first overflowing one, what the guard promoted)
    and whether the overflow persists whatever is exempted."""
    new: list[str] = []
    persistent = False
    fb = rep["forward_first_bad"] if rep else None
    if fb is not None and fb["fp32_finite"]:
        if fb["module"] == "<model>" or fb["module"] in exempted:
            persistent = True  # the module cannot be isolated, or is fp32 already
        else:
            new.append(fb["module"])
    if hist is not None:
        new += [m for m in hist["promotions"] if m not in new]
    return new, persistent


def recommend(
    fmt: str,
    settings: Settings,
    precision: str | None,
    exempted: list[str],
    state: dict[str, Any],
    hist: dict[str, Any] | None,
    rep: dict[str, Any] | None,
    problems: list[dict[str, Any]],
    bf16_ok: bool,
    *,
    fp8: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The recommendations, rule by rule (numbered below); ``fp8``: the report's fp8 section."""
    recs: list[dict[str, Any]] = []
    kinds = {p["kind"] for p in problems}
    scaler = state["scaler"]

    def add(override: str, reason: str) -> None:
        key = override.split("=", 1)[0]
        if all(r["override"].split("=", 1)[0] != key for r in recs):
            recs.append({"override": override, "reason": reason, "yours": yours(fmt, override)})

    # 1) fp32 modules: the replay's first overflowing module, and what the guard promoted
    new, persistent = _fp32_modules(rep, hist, exempted)
    if new:
        mods = list(dict.fromkeys(settings.fp32_modules + exempted + new))
        one = len(new) == 1
        add(
            f"precision.fp32_modules=[{','.join(mods)}]",
            f"{', '.join(new)} overflow{'s' if one else ''} in fp16: run {'it' if one else 'them'}"
            " in fp32, keep the rest in fp16",
        )
    # 2) bf16: forward overflows that fp32 modules do not cure, or a scale that cannot go lower
    fwd_count = max(
        (scaler or {}).get("forward_overflows") or 0, hist["forward_overflows"] if hist else 0
    )
    fb = rep["forward_first_bad"] if rep else None
    if (fb is not None and fb["fp32_finite"] and fwd_count >= 2) or "nonfinite_loss" in kinds:
        persistent = True
    low_range = precision in ("fp16", "fp16-pure")
    if (persistent or kinds & {"scale_at_floor", "scale_collapsed"}) and low_range and bf16_ok:
        add(
            "precision=bf16",
            "forward overflows persist in fp16: bf16 has fp32's range (no loss scaling needed)",
        )
    if hist is not None and hist["fallbacks"] and hist["fallbacks"][-1]["to"]:
        last = hist["fallbacks"][-1]
        add(
            f"precision={last['to']}", f"the guard fell back to {last['to']} at step {last['step']}"
        )
    # 2b) fp8: keep the layers with too little headroom out of fp8 (the config key the plugin
    #     excludes layers with); bf16 when a cast went non-finite or half the layers are tight
    _fp8_rules(fp8, add, bf16_ok)
    # 3) loss scale
    g = rep["gradients"] if rep else None
    if g is not None and ({"gradient_underflow", "backward_overflow"} & kinds):
        why = (
            "gradients underflow at the current scale"
            if "gradient_underflow" in kinds
            else "gradients overflow at the current scale"
        )
        # past the run's ceiling only for underflow (overflow never needs a larger scale)
        rec = g["recommended_init_scale"]
        if "gradient_underflow" in kinds and g["recommended_init_scale_unbounded"] > g["max_scale"]:
            rec = g["recommended_init_scale_unbounded"]
        add(
            f"scaler.init_scale={plain(rec)}",
            f"{why}: S* = 65504 / max|g| = 65504 / {g['max_abs']:.4g} = {g['ideal_scale']:.4g}, "
            "rounded down to a power of two and halved",
        )
        if rec > g["max_scale"]:
            add(
                f"scaler.max_scale={plain(max(rec, DEFAULT_MAX_SCALE))}",
                f"the run's max_scale {g['max_scale']:g} holds the scale below S*",
            )
    if "overflow_after_growth" in kinds and settings.growth_interval:
        add(
            f"scaler.growth_interval={settings.growth_interval * 4}",
            "the scale keeps growing into overflow: grow 4x less often",
        )
    # 4) optimizer: exploding updates
    diverged = {
        "nonfinite_optimizer_state",
        "extreme_optimizer_state",
        "grad_norm_explosion",
        "forward_nonfinite_fp32",
        "scale_at_floor",
        "nonfinite_grad_norm",
        "scale_collapsed",
    }
    if kinds & diverged and settings.lr is not None:
        add(
            f"optim.lr={plain(settings.lr / 2)}",
            "updates diverged (optimizer state, grad norm, or overflow at the scale's floor): "
            "halve the learning rate",
        )
        if not settings.clip_known:
            add("optim.clip_grad_norm=1.0", "clip the gradient norm to 1.0 if you do not already")
        elif settings.clip is None or settings.clip > 1.0:
            add("optim.clip_grad_norm=1.0", "clip the gradient norm to 1.0 (the BERT-Large recipe)")
    return recs


def _fp8_rules(fp8: dict[str, Any] | None, add: Any, bf16_ok: bool) -> None:
    bad = fp8_findings(fp8)
    if not bad:
        return
    names = [m["name"] for m in bad]
    patterns = list(dict.fromkeys([*fp8["exclude"], *names]))
    first = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    add(
        f"precision.fp8_exclude=[{','.join(patterns)}]",
        f"{first['name']}{more}: {first['findings'][0]}; keep {'it' if len(bad) == 1 else 'them'}"
        " out of fp8 (bf16, as the guard's demotion does), the other layers stay in fp8",
    )
    if bf16_ok and (any(m["nonfinite"] for m in bad) or 2 * len(bad) >= len(fp8["layers"])):
        add(
            "precision=bf16",
            "fp8 casts went non-finite or half the fp8 layers lack headroom: fall back to bf16 "
            "if excluding them does not cure it",
        )


def resume_overrides(recs: list[dict[str, Any]]) -> list[str]:
    """Overrides that take effect on ``ampctl train --resume`` (precision and scaler state come
    from the checkpoint there)."""
    return [
        r["override"]
        for r in recs
        if r["override"].startswith(("precision.fp32_modules=", "precision.fp8_exclude=", "optim."))
    ]


def resume_command(
    fmt: str, checkpoint: str | None, recs: list[dict[str, Any]], checked: int = 1
) -> str:
    """How to continue from ``checkpoint`` in the user's own tool (ampctl: a command line)."""
    if fmt == "ampctl":
        if checkpoint is None:
            return (
                " ".join(["ampctl train", *[r["override"] for r in recs]])
                + "   # no healthy checkpoint: start afresh"
            )
        return " ".join(["ampctl train --resume", checkpoint, *resume_overrides(recs)])
    if checkpoint is None:
        return (
            f"no healthy checkpoint among the {checked} checked: start afresh with the changes "
            "above"
        )
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

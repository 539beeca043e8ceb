"""The labelled corpus: for each failure kind a broken run and its healthy twin, written by the
real libraries, and the verdict ``ampctl diagnose`` must give (exit code, the first problem's
kind, the checkpoint to resume from or none, the keys the advice must set).

``python -m tests.commands.diagnose.corpus.table`` writes every run, diagnoses every case and
prints the README table (kinds x formats); ``tests/commands/diagnose/test_corpus.py`` asserts
each verdict.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import accelerate_runs, ampctl_runs, hf, lightning_runs, torch_runs, upstream_runs

KINDS = (
    "isolated skipped steps",
    "overflow storm",
    "scale collapse",
    "lr divergence",
    "forward overflow in a module",
    "NaN in the backward pass",
    "gradient underflow",
    "fp8 saturation",
    "NaN in the weights",
    "inf in the optimizer state",
    "recovered run",
    # reported upstream (#40): each run named after the issue it reproduces
    "T5 FFN `wo` past 65504 (transformers #5651)",
    "lr scheduler on skipped steps (pytorch #55585, transformers #11106)",
    "scale grown to float32's ceiling (pytorch #98828)",
    "NaN past the GradScaler across ranks, scale to 5.3e-23 (pytorch #157436)",
    "fp16 weights under a GradScaler (LLaVA #363, bitsandbytes #945)",
    "success reported, checkpoint poisoned by a NaN backward (marin #7271)",
    "bf16 loss spike from one bad batch",
)
FORMATS = ("HF Trainer", "Lightning", "Accelerate", "plain torch", "ampctl train", "ProtectedRun")

#: The library each run needs, by the run's writer module (skipped without it).
_NEEDS = {
    hf: "transformers",
    lightning_runs: "lightning",
    accelerate_runs: "accelerate",
    ampctl_runs: None,
    torch_runs: None,
    upstream_runs: None,  # tensorboard, which [test] installs (their own needs: _RUN_NEEDS)
}


@dataclass(frozen=True)
class Expect:
    exit: int
    kind: str | None  # the first problem's kind; None: no problem
    status: str  # healthy | recovered | broken
    resume: str | None  # the resume checkpoint, relative to the run's path; None: none
    advice: frozenset[str] = frozenset()  # override keys the recommendations must set
    says: str | None = None  # a phrase the verdict's summary holds


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # one of KINDS
    fmt: str  # one of FORMATS
    run: str  # the run it diagnoses (a key of RUNS or HAND_WRITTEN)
    expect: Expect
    path: str = ""  # what is diagnosed, relative to the run's path ("": the run itself)
    twin: str | None = None  # the healthy twin's case name (for a broken case)
    trust_code: bool = False
    slow: bool = False
    note: str = ""


def _ok(resume: str | None, says: str | None = None) -> Expect:
    return Expect(0, None, "healthy", resume, frozenset(), says)


def _back(resume: str | None, says: str, advice: set[str] | None = None) -> Expect:
    return Expect(0, None, "recovered", resume, frozenset(advice or ()), says)


def _bad(kind: str, resume: str | None, *advice: str, says: str | None = None) -> Expect:
    return Expect(1, kind, "broken", resume, frozenset(advice), says)


LIT = "checkpoints/"
CASES: tuple[Case, ...] = (
    # --------------------------------------------------------------- HF Trainer (GPT-2)
    Case("hf/healthy", KINDS[0], FORMATS[0], "hf-healthy", _ok("checkpoint-30", "isolated skipped step")),
    Case("hf/healthy-ckpt20", KINDS[0], FORMATS[0], "hf-healthy", _ok("checkpoint-20"), path="checkpoint-20"),
    Case("hf/lr-1.0", KINDS[3], FORMATS[0], "hf-lr-1.0",
         _bad("lr_divergence", None, "optim.lr", "optim.warmup_steps", "optim.clip_grad_norm",
              says="to 32.81 (step 5) at the first updates, before it ever fell, before the "
              "gradients went non-finite at step 7"), twin="hf/healthy"),
    Case("hf/lr-0.3", KINDS[3], FORMATS[0], "hf-lr-0.3",
         _bad("lr_divergence", None, "optim.lr", "optim.warmup_steps"), twin="hf/healthy"),
    Case("hf/lr-0.3-ckpt20", KINDS[3], FORMATS[0], "hf-lr-0.3",
         _bad("lr_divergence", None, "optim.lr"), path="checkpoint-20", twin="hf/healthy-ckpt20",
         note="checkpoint-20 given alone: its own history says the trouble began before it"),
    Case("hf/backward-nan", KINDS[5], FORMATS[0], "hf-backward-nan",
         _bad("backward_nonfinite", "checkpoint-10", "precision.fp32_modules"), twin="hf/healthy"),
    Case("hf/backward-nan-ckpt30", KINDS[5], FORMATS[0], "hf-backward-nan",
         _bad("backward_nonfinite", "checkpoint-10", "precision.fp32_modules"),
         path="checkpoint-30", twin="hf/healthy",
         note="checkpoint-30 given alone: its tensors look fine, its folder's history shows the break at 16"),
    Case("hf/forward-overflow", KINDS[4], FORMATS[0], "hf-forward-overflow",
         _bad("forward_overflow", "checkpoint-10", "precision.fp32_modules"), twin="hf/healthy",
         slow=True),
    # --------------------------------------------------------------- Lightning
    Case("lightning/healthy", KINDS[2], FORMATS[1], "lightning-healthy", _ok(f"{LIT}stepstep=200.ckpt")),
    Case("lightning/scale-0", KINDS[2], FORMATS[1], "lightning-collapse",
         _bad("scale_collapsed", f"{LIT}stepstep=25.ckpt", "precision", says="persistent overflow"),
         twin="lightning/healthy"),
    Case("lightning/scale-0-ckpt", KINDS[2], FORMATS[1], "lightning-collapse",
         _bad("scale_collapsed", f"{LIT}stepstep=25.ckpt", "precision"),
         path=f"{LIT}stepstep=200.ckpt", twin="lightning/healthy",
         note="the .ckpt given alone is judged with the checkpoints beside it"),
    Case("lightning/callback-resumed", KINDS[0], FORMATS[1], "lightning-callback-resumed", _ok(None),
         note="ampctl's AmpctlCallback run folder, resumed once from its newest checkpoint"),
    Case("lightning/callback-recovered", KINDS[10], FORMATS[1], "lightning-callback-recovered",
         _back(None, "3 overflows at 21–23 (non-finite gradients in net.2.weight), rolled back to "
               "20, clean since"), twin="lightning/callback-resumed",
         note="AmpctlCallback's run folder: the overflowed parameter named from events.jsonl"),
    Case("lightning/fp32-healthy", KINDS[9], FORMATS[1], "lightning-fp32-healthy", _ok(f"{LIT}stepstep=60.ckpt")),
    Case("lightning/optimizer-inf", KINDS[9], FORMATS[1], "lightning-optimizer-inf",
         _bad("nonfinite_optimizer_state", f"{LIT}stepstep=20.ckpt", "optim.clip_grad_norm",
              says="likely cause"),
         twin="lightning/fp32-healthy"),
    # --------------------------------------------------------------- Accelerate
    Case("accelerate/healthy", KINDS[0], FORMATS[2], "accelerate-healthy", _ok("checkpoints/checkpoint_2")),
    Case("accelerate/bf16-healthy", KINDS[8], FORMATS[2], "accelerate-bf16-healthy", _ok("checkpoints/checkpoint_2")),
    Case("accelerate/nan-weights", KINDS[8], FORMATS[2], "accelerate-nan-weights",
         _bad("nonfinite_weights", "checkpoints/checkpoint_1", "guard.enabled"),
         twin="accelerate/bf16-healthy"),
    # --------------------------------------------------------------- plain torch
    Case("torch/healthy", KINDS[0], FORMATS[3], "torch-healthy", _ok("ckpt_40.pt"), path="ckpt_40.pt"),
    Case("torch/storm", KINDS[1], FORMATS[3], "torch-storm",
         _bad("overflow_storm", "ckpt_20.pt", "guard.rollback_after"), path="ckpt_40.pt",
         twin="torch/healthy"),
    Case("torch/scale-0", KINDS[2], FORMATS[3], "torch-collapse",
         _bad("scale_collapsed", "ckpt_10.pt", "precision"), path="ckpt_210.pt",
         twin="torch/healthy"),
    Case("torch/bare-scaler", KINDS[2], FORMATS[3], "torch-collapse", _ok("scaler_10.pt"),
         path="scaler_10.pt", note="torch.save(scaler.state_dict()) alone"),
    Case("torch/bare-scaler-0", KINDS[2], FORMATS[3], "torch-collapse",
         _bad("scale_collapsed", "scaler_10.pt", "precision"), path="scaler_210.pt",
         twin="torch/bare-scaler"),
    Case("torch/bf16-healthy", KINDS[8], FORMATS[3], "torch-bf16-healthy", _ok("ckpt_30.pt"), path="ckpt_30.pt"),
    Case("torch/nan-weights", KINDS[8], FORMATS[3], "torch-nan-weights",
         _bad("nonfinite_weights", "ckpt_20.pt", "guard.enabled"), path="ckpt_30.pt",
         twin="torch/bf16-healthy"),
    # --------------------------------------------------------------- ampctl train
    Case("ampctl/healthy", KINDS[0], FORMATS[4], "ampctl-healthy",
         _ok("checkpoints/step_00000024.pt", "isolated skipped step")),
    Case("ampctl/guard-off-healthy", KINDS[3], FORMATS[4], "ampctl-guard-off-healthy",
         _ok("checkpoints/step_00000030.pt")),
    Case("ampctl/lr", KINDS[3], FORMATS[4], "ampctl-lr",
         _bad("lr_divergence", None, "optim.lr",
              says="before it ever fell, as the lr grew from 0.075 to 0.3 (step 8)"),
         twin="ampctl/guard-off-healthy"),
    Case("ampctl/forward-overflow", KINDS[4], FORMATS[4], "ampctl-forward-overflow",
         _bad("forward_overflow", "checkpoints/step_00000006.pt", "precision.fp32_modules"),
         twin="ampctl/guard-off-healthy"),
    Case("ampctl/floor", KINDS[2], FORMATS[4], "ampctl-floor",
         _bad("scale_at_floor", None, "scaler.min_scale", "scaler.init_scale", says="floor"),
         twin="ampctl/guard-off-healthy", note="a bad floor, not persistent overflow"),
    Case("ampctl/underflow-twin", KINDS[6], FORMATS[4], "ampctl-underflow-twin",
         _ok("checkpoints/step_00000004.pt")),
    Case("ampctl/underflow", KINDS[6], FORMATS[4], "ampctl-underflow",
         _bad("gradient_underflow", "checkpoints/step_00000004.pt", "scaler.init_scale",
              "scaler.max_scale"),
         twin="ampctl/underflow-twin"),
    Case("ampctl/fp8-healthy", KINDS[7], FORMATS[4], "ampctl-fp8-healthy", _ok("checkpoints/step_00000008.pt")),
    Case("ampctl/fp8-saturated", KINDS[7], FORMATS[4], "ampctl-fp8-saturated",
         _bad("fp8_headroom", "checkpoints/step_00000004.pt", "precision.fp8_exclude"),
         twin="ampctl/fp8-healthy"),
    Case("ampctl/promoted", KINDS[10], FORMATS[4], "ampctl-promoted",
         _back("checkpoints/step_00000024.pt", "to fp32", {"precision.fp32_modules"}),
         twin="ampctl/healthy"),
    Case("ampctl/rerun-transient", KINDS[10], FORMATS[4], "ampctl-rerun-transient",
         _back("checkpoints/step_00000024.pt", "step 10 did not reproduce on rerun: "
               "hardware/transient, clean since"), twin="ampctl/healthy"),
    # --------------------------------------------------------------- ProtectedRun
    Case("own/healthy", KINDS[0], FORMATS[5], "own-healthy", _ok(None)),
    Case("own/storm", KINDS[1], FORMATS[5], "own-storm",
         _bad("overflow_storm", None, "precision.fp32_modules"), twin="own/healthy"),
    Case("own/recovered", KINDS[10], FORMATS[5], "own-recovered",
         _back(None, "3 overflows at 21–23 (non-finite gradients in "
               "bert.encoder.layer.0.output.dense.weight), rolled back to 20, clean since"),
         twin="own/healthy"),
    Case("own/spikes", KINDS[0], FORMATS[5], "own-spikes", _ok(None, "1 spike skipped at 30"),
         note="a skipped spike on a clean course is healthy (#36): listed as a note"),
    Case("own/divergence-stop", KINDS[3], FORMATS[5], "own-divergence-stop",
         _bad("lr_divergence", None, "optim.lr",
              says="stopped the run at step 24"), twin="own/healthy"),
    Case("own/divergence-rollback", KINDS[10], FORMATS[5], "own-divergence-rollback",
         _back(None, "the loss diverged at step 30 (1.53x its lowest, 3.696): rolled back to 20, "
               "lr x0.5, clean since", {"optim.lr"}), twin="own/healthy"),
    Case("own/rerun-reproducible", KINDS[10], FORMATS[5], "own-rerun-reproducible",
         _back(None, "data or numerics at step 28"), twin="own/healthy",
         note="hand-written #27 events"),
    Case("own/promotion-undone", KINDS[10], FORMATS[5], "own-promotion-undone",
         _back(None, "not the cause"), twin="own/healthy", note="hand-written #27 events"),
    Case("own/discarded", KINDS[10], FORMATS[5], "own-discarded",
         _back(None, "2 overflow(s) on steps a rollback discarded"), twin="own/healthy",
         note="hand-written #27 events"),
    # --------------------------------------------------------------- reported upstream (#40)
    Case("torch/t5-healthy", KINDS[11], FORMATS[3], "t5-healthy", _ok("checkpoint-12"),
         path="checkpoint-12", note="transformers' T5, fp16 autocast, save_pretrained"),
    Case("torch/t5-wo-overflow", KINDS[11], FORMATS[3], "t5-wo-overflow",
         _bad("forward_overflow", "checkpoint-4", "precision.fp32_modules",
              says="encoder.block.1.layer.1.DenseReluDense.wo is the first module"),
         path="checkpoint-12", twin="torch/t5-healthy"),
    Case("torch/scheduler-gated", KINDS[12], FORMATS[3], "scheduler-gated", _ok("ckpt.pt"),
         path="ckpt.pt"),
    Case("torch/scheduler-on-skips", KINDS[12], FORMATS[3], "scheduler-on-skips",
         _bad("scheduler_on_skipped_steps", "ckpt.pt",
              says="if scaler.get_scale() >= scale_before: scheduler.step()"),
         path="ckpt.pt", twin="torch/scheduler-gated"),
    Case("torch/growth-2000", KINDS[13], FORMATS[3], "scale-growth-default", _ok("ckpt.pt"),
         path="ckpt.pt"),
    Case("torch/growth-1", KINDS[13], FORMATS[3], "scale-growth-1",
         _bad("scale_at_ceiling", "ckpt.pt", "scaler.growth_interval", says="(2^127)"),
         path="ckpt.pt", twin="torch/growth-2000"),
    Case("torch/ranks-averaged-first", KINDS[14], FORMATS[3], "ranks-averaged-first",
         _ok("ckpt_101.pt"), path="ckpt_101.pt", note="2 ranks, gloo"),
    Case("torch/ranks-averaged-after-unscale", KINDS[14], FORMATS[3],
         "ranks-unscaled-before-average",
         _bad("unchecked_update", None, says="131072 to 5.29e-23: 91 halvings"),
         path="ckpt_101.pt", twin="torch/ranks-averaged-first"),
    Case("lightning/fp16-base-fp32-head", KINDS[15], FORMATS[1], "fp16-base-fp32-head",
         _ok("checkpoints/epoch=0-step=6.ckpt"), path="checkpoints/epoch=0-step=6.ckpt"),
    Case("lightning/fp16-trained", KINDS[15], FORMATS[1], "fp16-trainable",
         _bad("fp16_weights_under_scaler", "checkpoints/on_exception.ckpt",
              says='Trainer(precision="16-mixed")'),
         path="checkpoints/on_exception.ckpt", twin="lightning/fp16-base-fp32-head",
         note="OnExceptionCheckpoint's .ckpt"),
    Case("torch/no-padding", KINDS[16], FORMATS[3], "no-padding", _ok("ckpt_20.pt"),
         path="ckpt_20.pt"),
    Case("torch/nan-backward-saved", KINDS[16], FORMATS[3], "nan-backward-saved",
         _bad("poisoned_checkpoint", "ckpt_10.pt", "guard.enabled",
              says="error_if_nonfinite=True"),
         path="ckpt_14.pt", twin="torch/no-padding"),
    Case("torch/bf16-no-spike", KINDS[17], FORMATS[3], "bf16-no-spike", _ok("ckpt.pt"),
         path="ckpt.pt"),
    Case("torch/bf16-spike", KINDS[17], FORMATS[3], "bf16-spike",
         _back("ckpt.pt", "a single loss of"), path="ckpt.pt", twin="torch/bf16-no-spike"),
)  # fmt: skip

BY_NAME = {c.name: c for c in CASES}
RUNS: dict[str, Any] = {
    **hf.RUNS,
    **lightning_runs.RUNS,
    **accelerate_runs.RUNS,
    **torch_runs.RUNS,
    **ampctl_runs.RUNS,
    **upstream_runs.RUNS,
}
_MODULE = {
    name: mod
    for mod in (hf, lightning_runs, accelerate_runs, torch_runs, ampctl_runs, upstream_runs)
    for name in mod.RUNS
}
#: Hand-written runs and the run each is made from.
_BASE = {name: "own-recovered" if "promotion" in name else "own-healthy"
         for name in ampctl_runs.HAND_WRITTEN}  # fmt: skip


#: Runs that need an optional library beyond their writer's (fp8 runs: torchao, the fp8 extra;
#: the upstream runs of transformers and Lightning).
_RUN_NEEDS = {
    "ampctl-fp8-healthy": "torchao",
    "ampctl-fp8-saturated": "torchao",
    **upstream_runs.NEEDS,
}


def missing_library(run: str) -> str | None:
    """The library a run needs that is not installed (None: none missing)."""
    base = _BASE.get(run, run)
    lib = _RUN_NEEDS.get(base) or _NEEDS[_MODULE[base]]
    return lib if lib is not None and importlib.util.find_spec(lib) is None else None


@dataclass
class Corpus:
    """The runs of one corpus folder, written on first use."""

    root: Path
    paths: dict[str, Path] = field(default_factory=dict)
    reports: dict[tuple[str, ...], tuple[int, dict[str, Any] | None, str]] = field(
        default_factory=dict
    )

    def diagnose(
        self, path: Path, *args: str, probe: bool = False
    ) -> tuple[int, dict[str, Any] | None, str]:
        """``ampctl diagnose PATH --json`` in-process (tests/commands/diagnose/conftest.py's
        ``diagnose_cli``), once per path and arguments: (exit code, report, stderr). The
        report is shared: read it, do not change it. ``probe``: try the advice (off: the
        verdicts do not depend on it, and test_closed_loop.py follows the advice)."""
        from tests.commands.diagnose.conftest import diagnose_cli

        args = args if probe else (*args, "--no-probe")
        key = (str(path), *args)
        if key not in self.reports:
            self.reports[key] = diagnose_cli(path, *args)
        return self.reports[key]

    def run(self, name: str) -> Path:
        """The run ``name``, written on first use (a run written into ``root`` before, by
        another process, is used as it is: ``NAME.path`` names what its writer returned)."""
        if name not in self.paths:
            out, note = self.root / name, self.root / f"{name}.path"
            if note.is_file():
                self.paths[name] = self.root / note.read_text()
                return self.paths[name]
            torch.set_num_threads(1)
            if name in ampctl_runs.HAND_WRITTEN:
                self.run(_BASE[name])
                path = ampctl_runs.HAND_WRITTEN[name](out, self.root)
            else:
                path = RUNS[name](out)
            note.write_text(str(path.relative_to(self.root)))
            self.paths[name] = path
        return self.paths[name]

    def target(self, case: Case) -> Path:
        base = self.run(case.run)
        return base / case.path if case.path else base

    def resolve(self, case: Case, rel: str | None) -> str | None:
        return None if rel is None else str(self.run(case.run) / rel)


def verdict_of(report: dict[str, Any]) -> dict[str, Any]:
    """What a case is judged on, from a ``--json`` report."""
    return {
        "kind": report["problems"][0]["kind"] if report["problems"] else None,
        "status": report["verdict"]["status"],
        "resume": report["resume"]["checkpoint"],
        "advice": {r["override"].split("=", 1)[0] for r in report["recommendations"]},
        "summary": report["verdict"]["summary"],
    }


def mismatches(case: Case, code: int, report: dict[str, Any], corpus: Corpus) -> list[str]:
    """How a diagnosis differs from the case's expected verdict ([]: it is right)."""
    e, v = case.expect, verdict_of(report)
    out = []
    if code != e.exit:
        out.append(f"exit {code}, expected {e.exit}")
    if v["kind"] != e.kind:
        out.append(f"first problem {v['kind']}, expected {e.kind}")
    if v["status"] != e.status:
        out.append(f"status {v['status']}, expected {e.status}")
    want = corpus.resolve(case, e.resume)
    if v["resume"] != want:
        out.append(f"resume {v['resume']}, expected {want}")
    if not e.advice <= v["advice"]:
        out.append(f"advice {sorted(v['advice'])} lacks {sorted(e.advice - v['advice'])}")
    if e.kind == "lr_divergence" and any(k.startswith("precision.") for k in v["advice"]):
        out.append(f"advice {sorted(v['advice'])} changes the precision of an lr divergence")
    if e.status == "healthy" and v["advice"]:
        out.append(f"advice {sorted(v['advice'])} on a healthy run")
    if e.says is not None and e.says not in v["summary"]:
        out.append(f"summary {v['summary']!r} lacks {e.says!r}")
    return out

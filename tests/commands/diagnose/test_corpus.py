"""The labelled corpus (corpus/cases.py): real runs written by HF Trainer, Lightning, Accelerate,
plain torch, ampctl train and ProtectedRun, each broken run with its healthy twin, and the
verdict ``ampctl diagnose --json`` must give for each. 100% of the verdicts right, no advice and
exit 0 on every healthy twin. README's corpus table is the corpus's."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ampctl.cli import app

from .corpus import table as corpus_table
from .corpus.cases import BY_NAME, CASES, KINDS, mismatches, missing_library

README = Path(__file__).resolve().parents[3] / "README.md"


def _param(case):
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_verdict(case, corpus):
    lib = missing_library(case.run)
    if lib is not None:  # "could not import": CI's second pass runs it (tests/extras_ci.py)
        pytest.importorskip(lib)
    code, report, err = corpus.diagnose(
        corpus.target(case), *(["--trust-code"] if case.trust_code else [])
    )
    assert report is not None, err
    assert mismatches(case, code, report, corpus) == []
    # never a resume point written at or after the first sign of trouble
    first_bad = report["verdict"]["first_bad_step"]
    chosen = [c for c in report["checkpoints"] if c["path"] == report["resume"]["checkpoint"]]
    if first_bad is not None and chosen and chosen[0]["step"] is not None:
        assert chosen[0]["step"] < first_bad
    # the healthy and the recovered carry no problem; a broken run names a cause
    assert report["healthy"] is (case.expect.exit == 0)
    if case.expect.exit == 1:
        assert report["verdict"]["cause"] == report["problems"][0]["message"]
    # a run folder's learning rate is read from its metrics (ampctl's rows call it "lr")
    h = report["history"]
    if h is not None and h["source"] == "run folder" and h["before_break"]:
        assert all(r["learning_rate"] is not None for r in h["before_break"])


def test_every_kind_has_a_broken_run_and_its_twin_in_the_default_suite():
    fast = [c for c in CASES if not c.slow]
    for kind in KINDS:
        mine = [c for c in fast if c.kind == kind]
        assert mine, kind
        if kind != "isolated skipped steps":  # the healthy kind: every case is a twin
            broken = [c for c in mine if c.expect.status != "healthy"]
            assert broken, kind
    for c in CASES:
        if c.twin is not None:
            twin = BY_NAME[c.twin]
            assert twin.expect.status == "healthy" and twin.expect.exit == 0, c.name
            assert not twin.slow or c.slow, c.name


def test_a_healthy_fp16_run_with_skipped_steps_is_no_false_alarm(corpus):
    """The HF Trainer logs ``grad_norm: inf`` for a step its GradScaler skipped: that alone is
    how dynamic loss scaling works, not a problem (and no lr advice)."""
    pytest.importorskip("transformers")
    code, rep, _ = corpus.diagnose(corpus.run("hf-healthy"))
    assert code == 0 and rep["problems"] == [] and rep["recommendations"] == []
    h = rep["history"]
    (skip,) = h["skipped_steps"]
    assert h["first_nonfinite_grad_norm_step"] == skip and h["break_step"] is None
    assert rep["verdict"]["summary"].startswith(f"healthy: 1 isolated skipped step ({skip})")


def test_the_resume_point_is_before_the_break_not_the_newest_sane_checkpoint(corpus):
    """lr 0.3: checkpoints 10-30 hold finite tensors and a sane scale, but the loss left its
    course at the first updates: none of them is a resume point, given the folder or one of
    them (checkpoint-30 too: never itself), and the lr is the one the loss fell again at once
    the schedule brought it down (0.03 at step 28; 0.12 in the history up to checkpoint-20)."""
    pytest.importorskip("transformers")
    run = corpus.run("hf-lr-0.3")
    for target, want in (
        (run, "0.03"),
        (run / "checkpoint-20", "0.12"),
        (run / "checkpoint-30", "0.03"),
    ):
        code, rep, _ = corpus.diagnose(target)
        assert code == 1 and rep["resume"]["checkpoint"] is None
        assert all(c["after_trouble"] for c in rep["checkpoints"] if c["healthy"])
        assert rep["resume"]["command"].startswith(
            "no checkpoint was written before the first sign of trouble (step 1)"
        )
        lr = next(r for r in rep["recommendations"] if r["override"].startswith("optim.lr="))
        assert lr["override"] == f"optim.lr={want}"
        assert "the loss fell again at step" in lr["reason"] and f"at lr {want}," in lr["reason"]
        assert lr["yours"] == f"TrainingArguments(learning_rate={want})"


def test_a_backward_nan_names_the_module_and_moves_it_to_fp32(corpus):
    pytest.importorskip("transformers")
    code, rep, _ = corpus.diagnose(corpus.run("hf-backward-nan"))
    bb = rep["replay"]["backward_first_bad"]
    assert rep["replay"]["forward_first_bad"] is None
    assert bb["module"] == "transformer.h.1.mlp.act" and bb["fp32_finite"] is True
    p = rep["problems"][0]
    assert p["kind"] == "backward_nonfinite" and p["module"] == "transformer.h.1.mlp.act"
    fp32 = rep["recommendations"][0]
    assert fp32["override"] == "precision.fp32_modules=[transformer.h.1.mlp.act]"
    assert "torch.autocast(device_type, enabled=False)" in fp32["yours"]
    assert "forward overflows persist" not in " ".join(r["reason"] for r in rep["recommendations"])


def test_the_corpus_table_in_readme_is_the_corpus():
    assert corpus_table.readme_block(README.read_text()) == corpus_table.table()


def test_a_resumed_lightning_run_folder_says_it_was_resumed(corpus):
    """AmpctlCallback's run folder, the fit resumed from its newest checkpoint: nothing was set
    aside (no branch), and the folder's resume event is counted and named."""
    pytest.importorskip("lightning")
    code, rep, _ = corpus.diagnose(corpus.run("lightning-callback-resumed"))
    assert code == 0 and rep["branch"]["resumes"] == 1 and rep["branch"]["branches"] == []
    assert rep["branch"]["text"] == (
        "main line; resumed 1 time(s), at step 40, each from the newest checkpoint (nothing set "
        "aside)"
    )
    assert rep["history"]["resumes"][0]["step"] == 40


def test_a_checkpoint_after_the_break_given_alone_resumes_from_before_it(corpus):
    """The backward goes NaN at step 16 and every later step is skipped: checkpoint-30's own
    tensors and scale look fine, but its folder's history shows the break, so given alone it
    recommends checkpoint-10 (written before it), never itself, and names the module."""
    pytest.importorskip("transformers")
    run = corpus.run("hf-backward-nan")
    code, rep, _ = corpus.diagnose(run / "checkpoint-30")
    assert code == 1 and rep["verdict"]["first_bad_step"] == 16
    own = next(c for c in rep["checkpoints"] if c["path"] == str(run / "checkpoint-30"))
    assert own["healthy"] is True and own["after_trouble"] is True
    assert rep["resume"]["checkpoint"] == str(run / "checkpoint-10")
    assert rep["problems"][0]["module"] == "transformer.h.1.mlp.act"


@pytest.mark.parametrize(
    ("run", "param"),
    [
        ("own-recovered", "bert.encoder.layer.0.output.dense.weight"),  # ProtectedRun
        ("lightning-callback-recovered", "net.2.weight"),  # AmpctlCallback
    ],
)
def test_an_integration_run_folder_names_the_overflowed_parameters_and_its_lr(corpus, run, param):
    """The run folders ProtectedRun and the Lightning callback write: the parameters whose
    gradients overflowed (events.jsonl) are named in the history, the verdict and the text;
    the learning rate of every row is read from metrics.jsonl's ``lr``."""
    if missing_library(run):
        pytest.importorskip(missing_library(run))
    path = corpus.run(run)
    code, rep, _ = corpus.diagnose(path)
    assert code == 0 and rep["history"]["overflow_params"] == [param]
    assert f"non-finite gradients in {param}" in rep["verdict"]["summary"]
    rows = rep["history"]["before_break"]
    assert rows and all(isinstance(r["learning_rate"], float) for r in rows)
    res = CliRunner().invoke(app, ["diagnose", str(path)], env={"COLUMNS": "200"})
    text = " ".join(res.stdout.replace("│", " ").split())
    assert f"non-finite gradients in {param}" in text


def test_a_run_diverged_by_its_lr_is_told_to_lower_it_first(corpus):
    """lr 1.0: the loss rises 8x at the first updates, then the gradients go non-finite. The lr
    is the cause (the first problem, the first advice: the lr the loss fell again at, 0.033 at
    step 30, with a warmup), and the precision is left alone: the NaN backward the replay saw
    came after the lr blew the weights up, so no module is moved to fp32 (#36)."""
    pytest.importorskip("transformers")
    code, rep, _ = corpus.diagnose(corpus.run("hf-lr-1.0"))
    assert code == 1 and [p["kind"] for p in rep["problems"]][:2] == [
        "lr_divergence",
        "backward_nonfinite",
    ]
    recs = [r["override"] for r in rep["recommendations"]]
    assert recs[:2] == ["optim.lr=0.033", "optim.warmup_steps=10"]
    assert not [r for r in recs if r.startswith("precision")]
    assert not any("ln_" in r or "LayerNorm" in r for r in recs)


def test_a_lightning_scale_of_0_gets_its_cause_and_advice_under_a_header(corpus):
    """Lightning fp16, the GradScaler's scale 0.0 in the newest .ckpt: not a bare "bad scale"
    but a collapsed scale with its cause, the advice under its numbered header in the user's
    Lightning terms, and the resume point before the collapse; the same given that .ckpt
    alone (compared with the checkpoints beside it)."""
    pytest.importorskip("lightning")
    run = corpus.run("lightning-collapse")
    newest = run / "checkpoints" / "stepstep=200.ckpt"
    for target in (run, newest):
        code, rep, _ = corpus.diagnose(target)
        p = rep["problems"][0]
        assert code == 1 and p["kind"] == "scale_collapsed"
        assert p["message"].startswith("the GradScaler scale fell to 0; cause: persistent overflow")
        assert rep["resume"]["checkpoint"] == str(run / "checkpoints" / "stepstep=25.ckpt")
    res = CliRunner().invoke(app, ["diagnose", str(newest)], env={"COLUMNS": "200"})
    out = res.stdout
    assert res.exit_code == 1
    assert "4. Recommendations (paste into ampctl train, and in your own setup):" in out
    head, advice = out.split("4. Recommendations", 1)
    assert "precision=bf16" in advice and 'yours: Trainer(precision="bf16-mixed")' in advice

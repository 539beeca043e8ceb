"""The labelled corpus (corpus/cases.py): real runs written by HF Trainer, Lightning, Accelerate,
plain torch, ampctl train and ProtectedRun, each broken run with its healthy twin, and the
verdict ``ampctl diagnose --json`` must give for each. 100% of the verdicts right, no advice and
exit 0 on every healthy twin. README's corpus table is the corpus's."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import diagnose_cli
from .corpus import table as corpus_table
from .corpus.cases import BY_NAME, CASES, KINDS, Corpus, mismatches, missing_library

README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    """The corpus's runs, each written once per session, when a case first needs it."""
    return Corpus(tmp_path_factory.mktemp("corpus"))


def _param(case):
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_verdict(case, corpus):
    lib = missing_library(case.run)
    if lib is not None:
        pytest.skip(f"the run is written by {lib}: pip install {lib}")
    code, report, err = diagnose_cli(
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
    code, rep, _ = diagnose_cli(corpus.run("hf-healthy"))
    assert code == 0 and rep["problems"] == [] and rep["recommendations"] == []
    h = rep["history"]
    (skip,) = h["skipped_steps"]
    assert h["first_nonfinite_grad_norm_step"] == skip and h["break_step"] is None
    assert rep["verdict"]["summary"].startswith(f"healthy: 1 isolated skipped step ({skip})")


def test_the_resume_point_is_before_the_break_not_the_newest_sane_checkpoint(corpus):
    """lr 0.3: checkpoints 10-30 hold finite tensors and a sane scale, but the loss left its
    course at the first updates: none of them is a resume point, given the folder or one of
    them, and the lr is lowered 10x (the loss never fell before it rose)."""
    pytest.importorskip("transformers")
    run = corpus.run("hf-lr-0.3")
    for target in (run, run / "checkpoint-20"):
        code, rep, _ = diagnose_cli(target)
        assert code == 1 and rep["resume"]["checkpoint"] is None
        assert all(c["after_trouble"] for c in rep["checkpoints"] if c["healthy"])
        assert rep["resume"]["command"].startswith(
            "no checkpoint was written before the first sign of trouble (step 1)"
        )
        lr = next(r for r in rep["recommendations"] if r["override"].startswith("optim.lr="))
        assert lr["override"] == "optim.lr=0.03"
        assert lr["yours"] == "TrainingArguments(learning_rate=0.03)"


def test_a_backward_nan_names_the_module_and_moves_it_to_fp32(corpus):
    pytest.importorskip("transformers")
    code, rep, _ = diagnose_cli(corpus.run("hf-backward-nan"))
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
    code, rep, _ = diagnose_cli(corpus.run("lightning-callback-resumed"))
    assert code == 0 and rep["branch"]["resumes"] == 1 and rep["branch"]["branches"] == []
    assert rep["branch"]["text"] == (
        "main line; resumed 1 time(s), at step 40, each from the newest checkpoint (nothing set "
        "aside)"
    )
    assert rep["history"]["resumes"][0]["step"] == 40

"""The protection's replays, pieces the other unit tests leave open (mutation survivors of issue
#31): the fp8 cast replay driven through a stand-in plugin (no torchao needed: the plugin's
``demotable`` / ``replay_casts`` / ``demote`` planted on a bf16 one) -- unused parameters, no
figures, a short table, ranks -- a dist context without ``enabled``, and the rerun's message
when no grad-norm threshold was in force."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from tests.protect.recorded import Ranks, row
from tests.protect.test_protection_unit import BATCH, Loop

INF, NAN = math.inf, math.nan
OK = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # one layer's cast figures, all finite
BAD_INPUT = [INF, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # its input cast went non-finite


class NoFlag:
    """A dist context of an older shape: no ``enabled``, nothing to gather with."""


def _planted(rows: list[list[float]] | None, names=("amp.lin", "head"), **protection):
    """A bf16 loop whose plugin claims fp8 layers ``names``; its cast replay runs the step and
    returns ``rows`` (None: no figures). Returns the loop and the list of demotions made."""
    loop = Loop("bf16", protection=protection or None)
    prec = loop.prot.precision
    demoted: list[tuple[str, str]] = []
    ran: list[int] = []

    def replay_casts(model, run):
        run()
        ran.append(1)
        return None if rows is None else (list(names), torch.tensor(rows, dtype=torch.float64))

    prec.demotable = lambda model, under="": list(names)
    prec.replay_casts = replay_casts
    prec.demote = lambda model, name, reason: demoted.append((name, reason)) or True
    return loop, demoted, ran


def test_the_cast_replay_runs_over_a_model_with_an_unused_parameter():
    loop, demoted, ran = _planted([BAD_INPUT, OK])
    loop.model.spare = nn.Parameter(torch.ones(1))  # never used by the forward
    loop.prot._replay_casts(3, [BATCH], None)
    assert ran == [1]
    assert demoted == [("amp.lin", "non-finite input (amax inf) on the replay of the skipped step")]
    assert [(e["kind"], e["module"]) for e in loop.prot.events] == [("demotion", "amp.lin")]
    assert loop.model.spare.grad is None  # the replay's gradients are discarded


def test_a_cast_replay_without_figures_demotes_nothing():
    loop, demoted, ran = _planted(None)
    loop.prot._replay_casts(3, [BATCH], 2)
    assert ran == [1] and demoted == [] and loop.prot.events == []


def test_a_cast_table_shorter_than_its_names_is_refused():
    loop, demoted, _ = _planted([BAD_INPUT], names=("amp.lin", "head"))
    with pytest.raises(ValueError):
        loop.prot._replay_casts(3, [BATCH], None)
    assert demoted == []


def test_a_dist_context_without_enabled_is_a_single_process_for_the_cast_replay():
    loop, demoted, _ = _planted([OK, BAD_INPUT], dist=NoFlag())
    loop.prot._replay_casts(3, [BATCH], 1)
    assert demoted == [
        ("head", "non-finite input (amax inf) on the replay of the skipped step (replayed on "
         "the weights of step 4)")
    ]  # fmt: skip


def test_ranks_demote_what_this_rank_found_too():
    loop, demoted, _ = _planted([BAD_INPUT, OK], dist=Ranks([None, {"head": "theirs"}]))
    loop.prot._replay_casts(3, [BATCH], None)
    assert demoted == [
        ("head", "theirs on the replay of the skipped step"),
        ("amp.lin", "non-finite input (amax inf) on the replay of the skipped step"),
    ]


# ------------------------------------------------------------------ rerun
def test_a_dist_context_without_enabled_is_a_single_process_for_the_rerun():
    loop = Loop(rerun=True, protection={"dist": NoFlag()})
    loop.step(plant=("head.weight",))
    ev = loop.prot.events[0]
    assert ev["kind"] == "rerun" and ev["verdict"] == "transient" and ev["rank"] is None
    assert ev["message"].startswith("rerun of step 1 (overflow): clean (loss ")


def test_the_rerun_says_nothing_of_the_grad_norm_without_a_threshold():
    loop = Loop(rerun=True)
    loop.step()
    record = row(skipped=True, loss=5.0, loss_thr=1e6, gnorm=3.0, gnorm_thr=INF)
    assert loop.prot._rerun(2, [BATCH], record, rec.SPIKE) == "transient"
    msg = loop.prot.events[-1]["message"]
    assert msg.endswith("a transient fault, the step was retried") and "grad norm" not in msg

"""The findings of issue #27, measured again: ``python scripts/guard_findings.py spike|hf``.

- ``spike``: a loss multiplied by 10^4 on one batch (step 150 of 300; the default tiny BERT, bf16,
  clipping off, the planted model of ``tests/protect/planted.py``): the clean run, the guarded run
  (the spike rule on, the default) and the unguarded one (``guard.spike=false``), final losses and
  events side by side.
- ``hf``: the HF Trainer under ``protect_trainer`` (the tiny GPT-2 of
  ``tests/integrations/test_transformers.py``, fp16, 40 steps) at lr 1e-3, 1.0 and 30: status,
  steps, skipped steps, events and the divergence message. Needs ``ampctl[hf]``.

Run from the repository root, one thread (``OMP_NUM_THREADS=1``); a few minutes on a CPU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def spike() -> None:
    from ampctl.config import load_config
    from ampctl.runlog import new_run_dir
    from ampctl.train.builders import build_data_source
    from ampctl.train.trainer import train
    from tests.protect.planted import fingerprint

    root = tempfile.mkdtemp(prefix="ampctl-spike-")
    base = [
        "precision=bf16",
        "optim.clip_grad_norm=null",
        "logging.plot=false",
        f"trainer.runs_dir={root}",
        "model._target_=tests.protect.planted.Faulty",
    ]
    cfg = load_config(base)
    src = build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)
    bad = fingerprint(src.batch_at(149)["input_ids"])  # the batch of step 150
    planted = [f"+model.spike_batches=[{bad}]"]
    final = {}
    for name, extra in (
        ("clean", []),
        ("guarded", planted),
        ("unguarded", [*planted, "guard.spike=false"]),
    ):
        res = train(load_config(base + extra), new_run_dir(root, name))
        s = res.summary
        final[name] = s["final_loss"]
        events = [(e["kind"], e["step"]) for e in _events(res.run_dir)]
        print(
            f"{name:9s} final_loss {s['final_loss']:.4f}  skipped {s['skipped']}  "
            f"spikes {s.get('spikes')}  status {s['status']}  events {events}",
            flush=True,
        )
    for name in ("guarded", "unguarded"):
        print(f"{name} vs clean: {100 * (final[name] - final['clean']) / final['clean']:+.2f}%")


def hf() -> None:
    from ampctl.amp import LossScaler
    from tests.integrations.test_transformers import _trainer

    for lr in (1e-3, 1.0, 30.0):
        d = Path(tempfile.mkdtemp(prefix="ampctl-hf-"))
        trainer, _, _, _ = _trainer(
            d / "out", 40, set(), lr=lr, run_dir=d / "run", scaler=LossScaler(init_scale=1024.0)
        )
        trainer.train()
        s = json.loads((d / "run" / "summary.json").read_text())
        ev = _events(d / "run")
        kinds = dict(Counter(e["kind"] for e in ev))
        print(
            f"lr {lr}: status {s['status']}, steps {trainer.state.global_step}, skipped "
            f"{s.get('skipped')}, events {kinds}",
            flush=True,
        )
        for e in ev:
            if e["kind"] in ("divergence", "promotion"):
                print(f"    {e['kind']} at {e['step']}: {e['message']}")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("spike", "hf"):
        print("usage: python scripts/guard_findings.py spike|hf", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    {"spike": spike, "hf": hf}[which]()

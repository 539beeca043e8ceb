"""The plain loop of ampctl.protect.protection's module docstring, over a tiny model with faults
to plant (an inf in a gradient, a module that overflows in the forward, a loss that overflows in
no module): what the protection's own tests and its replays' tests drive by hand."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ampctl.amp.precision import make_precision
from ampctl.protect.protection import Protection
from ampctl.protect.settings import GuardConfig

INF = float("inf")


class Amp(nn.Module):
    """Fine in fp32; with ``boost`` 1000 its square overflows fp16 (65504), with 1e20 fp32 too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.boost = 1.0
        self.flaky = 0  # overflow on this many more calls only (a fault that does not replay)

    def forward(self, x):
        boost = self.boost
        if self.flaky > 0:
            self.flaky -= 1
            boost = 1e20
        h = self.lin(x) * boost
        return 0.1 * (h * h) / (boost * boost)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.amp = Amp()
        self.head = nn.Linear(4, 1)
        self.gain = 1.0  # INF: the loss itself overflows, in no module

    def forward(self, x, y):
        h = x + self.amp(x)
        return ((self.head(h).float() - y) ** 2).mean() * self.gain


_g = torch.Generator().manual_seed(1)


BATCH = {"x": torch.randn(8, 4, generator=_g), "y": torch.randn(8, 1, generator=_g)}


class Progress:
    """The owner's position that a rollback rewinds."""

    def __init__(self) -> None:
        self.step = 0
        self.seen = 0

    def state_dict(self):
        return {"step": self.step, "seen": self.seen}

    def load_state_dict(self, state):
        self.step, self.seen = state["step"], state["seen"]


class Loop:
    """The module docstring's loop, with faults to plant."""

    def __init__(
        self,
        precision: str = "fp16",
        *,
        fused: bool = False,
        scaler: dict | None = None,
        progress: bool = True,
        start: bool = True,
        protection: dict | None = None,
        **guard,
    ) -> None:
        self.model = Tiny()
        prec = make_precision(precision, scaler_args={"init_scale": 1024.0, **(scaler or {})})
        prec.prepare(self.model)
        opt = torch.optim.AdamW(prec.optimizer_params(self.model), lr=1e-2, fused=fused)
        self.progress = Progress() if progress else None
        self.emitted: list[dict] = []
        self.prot = Protection(
            self.model,
            opt,
            prec,
            config=GuardConfig(**guard),
            emit=self.emitted.append,
            progress_state=self.progress.state_dict if self.progress is not None else None,
            **(protection or {}),
        )
        if start:
            self.prot.start()
        self.n = 0

    def step(self, plant: tuple[str, ...] = (), batches: list | None = None):
        prot = self.prot
        if self.progress is not None:
            self.progress.step += 1
            self.progress.seen += 8
            self.n = self.progress.step
        else:
            self.n += 1
        prot.optimizer.zero_grad()
        prot.precision.zero_grad()
        with prot.precision.autocast():
            loss = self.model(**BATCH)
        prot.precision.backward(loss)
        prot.precision.after_backward()
        params = dict(prot.precision.named_optimizer_params(self.model))
        for name in plant:
            params[name].grad.view(-1)[0] = INF
        prot.precision.unscale_(prot.optimizer)
        skipped = prot.precision.optimizer_step(prot.optimizer)
        self.apply(
            prot.after_step(
                self.n, skipped=skipped, batches=[BATCH] if batches is None else batches
            )
        )
        return skipped

    def apply(self, rewind) -> None:
        """The loop owns its position: a rollback hands it back and the loop restores it."""
        if rewind is not None and self.progress is not None and rewind.progress is not None:
            self.progress.load_state_dict(rewind.progress)

    def sync(self):
        self.apply(self.prot.sync())

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.prot.events]

    def state(self) -> dict:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.prot.optimizer.state_dict()),
            "progress": None if self.progress is None else self.progress.state_dict(),
        }

"""fp8: torchao float8 training for the eligible ``nn.Linear`` layers, bf16 autocast for the
rest, no loss scaling (non-finite steps are still detected and skipped, as in bf16).

:meth:`FP8Precision.prepare` converts the layers that :func:`ampctl.amp.fp8.plan` allows and
the ``exclude`` patterns (and ``fp32_modules``) leave in, and keeps the reason for every
``nn.Linear`` left out. The plugin watches its layers through :class:`Fp8CastProbe`, a log-step
probe: on log steps only, the per-layer cast health of :func:`ampctl.amp.fp8.record_casts` rides on
the loop's one read, goes to metrics.jsonl as the worst layer's figures, and is kept
(:meth:`Fp8CastProbe.take_sample`) for the guard's demotion rules
(:class:`ampctl.amp.fp8.Fp8Health`, applied by :class:`ampctl.protect.protection.Protection`).
On a step skipped for non-finite gradients the guard replays the step through
:meth:`FP8Precision.replay_casts` (the same probe, once) to find the layer whose cast went
non-finite first, and demotes it at once.

A demoted layer (:meth:`FP8Precision.demote`) is a plain ``nn.Linear`` again, holding the same
Parameters, and computes in bf16 under the autocast. Exempting a module to fp32 demotes the fp8
layers inside it first (a ``Float8Linear`` would ignore the fp32 wrapper and stay in fp8).
:meth:`FP8Precision.release` demotes every layer: a precision fallback fp8 -> bf16 keeps the
parameters and the optimizer state.

torchao is imported when a model is prepared, not with this module; without it
:meth:`FP8Precision.prepare` raises :class:`ampctl.amp.fp8.Fp8Unavailable` (the install hint).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ampctl.amp import fp8

from .base import Precision, match_modules

__all__ = ["FP8Precision", "Fp8CastProbe", "ROW_KEYS"]

# The keys the probe adds to a metrics row (None when no fp8 layer ran on the sampled step).
ROW_KEYS = (
    "fp8_layers",  # fp8 layers that ran on the sampled step
    "fp8_sat",  # the worst layer's saturation: share of a cast's values at the format's max
    "fp8_sat_layer",
    "fp8_under",  # the worst layer's underflow: share of nonzero values its casts flush to 0
    "fp8_under_layer",
    "fp8_nonfinite_layers",  # layers with a non-finite amax in any cast
)


class FP8Precision(Precision):
    """See the module docstring.

    Args:
        recipe: torchao's ``tensorwise`` or ``rowwise`` scaling recipe.
        exclude: fnmatch patterns of module names kept out of fp8 (default
            :data:`ampctl.amp.fp8.DEFAULT_EXCLUDE`: embeddings, the LM head, classifiers).
        fp32_modules, device_type, scaler: as for every plugin (:class:`Precision`).
    """

    name = "fp8"
    compute_dtype = torch.bfloat16
    option_keys = ("recipe", "exclude")

    def __init__(
        self,
        *,
        recipe: str = "tensorwise",
        exclude: Iterable[str] = fp8.DEFAULT_EXCLUDE,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        fp8._check_recipe(recipe)
        exclude = fp8._check_patterns(exclude)
        self.recipe = recipe
        self.exclude = exclude
        self.converted: list[str] = []  # converted by prepare, in module order
        self.skipped: dict[str, str] = {}  # nn.Linear layers left out by prepare: name -> why
        self.demoted: dict[str, str] = {}  # demoted since: name -> why
        self._probe = Fp8CastProbe()

    def __repr__(self) -> str:
        return (
            f"FP8Precision(recipe={self.recipe}, converted={len(self.converted)}, "
            f"demoted={list(self.demoted)}, in_fp32={self.in_fp32})"
        )

    # ------------------------------------------------------------------ applying
    def prepare(self, model: nn.Module) -> nn.Module:
        """Convert the eligible layers to fp8 (torchao), then move the fp32 modules to fp32.

        Layers inside an ``fp32_modules`` module stay out of fp8. Raises
        :class:`~ampctl.amp.fp8.Fp8Unavailable` without torchao (before changing anything)."""
        fp8.require_torchao()
        in_fp32 = match_modules(model, self.fp32_modules)
        plan = fp8.plan(model, exclude=self.exclude)
        skipped = dict(plan.skip)
        for name in plan.convert:
            owner = next((m for m in in_fp32 if name == m or name.startswith(m + ".")), None)
            if owner is not None:
                skipped[name] = f"inside '{owner}', kept in fp32 by precision.fp32_modules"
        wanted = [n for n in plan.convert if n not in skipped]
        # literal names as patterns: convert exactly the chosen layers
        keep_out = [n for n in plan.convert if n in skipped] + self.exclude
        self.converted = fp8.convert(model, recipe=self.recipe, exclude=keep_out)
        if self.converted != wanted:  # an invariant of fp8.convert, checked where it matters
            raise RuntimeError(f"fp8: converted {self.converted}, planned {wanted}")
        self.skipped = {n: why for n, why in skipped.items() if n not in self.converted}
        return super().prepare(model)

    def release(self, model: nn.Module) -> list[str]:
        """Demote every fp8 layer (same Parameters: the optimizer state stays valid), then undo
        the fp32 modules. Returns the names of the modules that were in fp32."""
        for name in fp8.converted_layers(model):
            fp8.demote(model, name)
        return super().release(model)

    def to_fp32(self, model: nn.Module, name: str) -> bool:
        """Run module ``name`` in fp32; the fp8 layers at or inside it are demoted first."""
        if name in self.in_fp32 or any(name.startswith(e + ".") for e in self.in_fp32):
            return False
        for layer in self.demotable(model, name):
            self.demote(model, layer, f"inside '{name}', which now runs in fp32")
        return super().to_fp32(model, name)

    # ------------------------------------------------------------------ fp8 layers
    def demotable(self, model: nn.Module, under: str = "") -> list[str]:
        return [
            n
            for n in fp8.converted_layers(model)
            if not under or n == under or n.startswith(under + ".")
        ]

    def demote(self, model: nn.Module, name: str, reason: str) -> bool:
        """Replace fp8 layer ``name`` by a plain ``nn.Linear`` with the same Parameters (bf16
        under the autocast). Returns False when ``name`` is not an fp8 layer now."""
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            return False
        if not fp8.is_fp8_layer(layer):
            return False
        fp8.demote(model, name)
        self.demoted[name] = reason
        return True

    def replay_casts(self, model: nn.Module, run: Any) -> tuple[list[str], torch.Tensor] | None:
        if not self.demotable(model):
            return None
        with fp8.record_casts(model) as p:
            run()
        return list(p.names), p.rows()

    def probes(self) -> list[Any]:
        return [self._probe]

    @property
    def probe(self) -> Fp8CastProbe:
        return self._probe

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["fp8"] = {
            "recipe": self.recipe,
            "converted": list(self.converted),
            "demoted": dict(self.demoted),
        }
        return sd

    def restore(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Demote again the layers a checkpoint of an fp8 run had demoted."""
        if state.get("name") != self.name:
            return
        for name, reason in (state.get("fp8") or {}).get("demoted", {}).items():
            if not self.demote(model, name, reason):
                self.demoted.setdefault(name, reason)  # e.g. now excluded: still not fp8

    def summary(self, model: nn.Module) -> dict[str, Any]:
        return {
            "fp8_recipe": self.recipe,
            "fp8_layers": fp8.converted_layers(model),
            "fp8_excluded": dict(self.skipped),
            "fp8_demoted": dict(self.demoted),
        }


class Fp8CastProbe:
    """fp8 cast health on log steps (the :class:`ampctl.protect.figures.Probe` protocol).

    ``sampling(model, True)`` opens :func:`ampctl.amp.fp8.record_casts` on the eager model for the
    step's forward and backward; ``figures`` adds the per-layer rows to the log read (max over
    ranks, so every rank takes the same decisions); ``row`` turns them into the worst layer's
    figures (:data:`ROW_KEYS`) and keeps the per-layer sample for :meth:`take_sample`. Nothing
    is installed and nothing is read on other steps.
    """

    def __init__(self) -> None:
        self._open: fp8.CastRecord | None = None
        self._sample: tuple[list[str], list[list[float]]] | None = None

    @contextlib.contextmanager
    def sampling(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        self._open = None
        if not enabled:
            yield
            return
        self._sample = None
        with fp8.record_casts(model, enabled=True) as p:
            self._open = p
            yield

    def figures(self, fig: Any) -> None:
        """Add the sampled rows (no host read)."""
        if self._open is None:
            return
        rows = self._open.rows()
        # NaN -> inf: a max-reduce over ranks keeps it, and it still reads as non-finite
        rows = torch.where(torch.isnan(rows), math.inf, rows)
        fig.add("fp8_rows", rows, "max", vector=True)

    def row(self, values: dict[str, Any]) -> dict[str, Any]:
        """The worst layer's figures from the read ``values`` (host numbers)."""
        p, self._open = self._open, None
        if p is None:
            return {}
        flat = values.get("fp8_rows") or []
        width = len(fp8.FIELDS)
        rows = [list(flat[i : i + width]) for i in range(0, len(flat), width)]
        names = list(p.names)[: len(rows)]
        self._sample = (names, rows)
        return worst_layer(names, rows)

    def take_sample(self) -> tuple[list[str], list[list[float]]] | None:
        """The last sample's ``(layer names, rows)``, once (None when there is none)."""
        s, self._sample = self._sample, None
        return s


def worst_layer(names: list[str], rows: list[list[float]]) -> dict[str, Any]:
    """The :data:`ROW_KEYS` figures of host rows (one per layer, ordered as ``fp8.FIELDS``)."""
    out: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    out["fp8_layers"] = len(rows)
    if not rows:
        return out
    samples = [fp8.LayerSample.from_row(r) for r in rows]

    def key(v: float) -> float:
        return v if math.isfinite(v) else math.inf

    i = max(range(len(samples)), key=lambda j: key(samples[j].sat))
    k = max(range(len(samples)), key=lambda j: key(samples[j].under))
    out.update(
        fp8_sat=samples[i].sat,
        fp8_sat_layer=names[i],
        fp8_under=samples[k].under,
        fp8_under_layer=names[k],
        fp8_nonfinite_layers=sum(1 for s in samples if not (s.forward_finite and s.grad_finite)),
    )
    return out

"""Precision plugins, one file per precision, behind one small interface (:class:`Precision`).

* ``fp32``       no autocast, no loss scaling (non-finite steps are still skipped).
* ``bf16``       autocast to bfloat16; fp32 weights and optimizer state; no loss scaling.
* ``fp16``       autocast to float16; fp32 weights and optimizer state; dynamic loss scaling.
* ``fp16-pure``  fp16 weights with fp32 masters owned by the optimizer (Apex O2); loss scaling.
* ``fp8``        torchao float8 for the eligible Linear layers, bf16 autocast for the rest; no
                 loss scaling; layers demotable to bf16 (needs the ``fp8`` extra, torchao).

:func:`make_precision` builds one by name; each owns its :class:`~ampctl.amp.LossScaler`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ampctl.amp.checks import check, one_of
from ampctl.amp.formats import FP16_MAX, FP16_SUBNORMAL, FP16_TINY, dtype_max
from ampctl.amp.fp8 import DEFAULT_EXCLUDE, RECIPES
from ampctl.amp.scaler import LossScaler

from .base import Precision, bf16_supported, match_modules, saved_in_fp32
from .bf16 import BF16Precision
from .fp8 import FP8Precision
from .fp16 import FP16Precision
from .fp16_pure import FP16PurePrecision, MasterWeights
from .fp32 import FP32Precision

__all__ = [
    "saved_in_fp32",
    "PRECISIONS",
    "PrecisionConfig",
    "PLUGINS",
    "Precision",
    "FP32Precision",
    "BF16Precision",
    "FP16Precision",
    "FP16PurePrecision",
    "FP8Precision",
    "MasterWeights",
    "make_precision",
    "PrecisionPolicy",
    "bf16_supported",
    "match_modules",
    "FP16_MAX",
    "FP16_TINY",
    "FP16_SUBNORMAL",
    "dtype_max",
]

PLUGINS: dict[str, type[Precision]] = {
    p.name: p
    for p in (FP32Precision, BF16Precision, FP16Precision, FP16PurePrecision, FP8Precision)
}
PRECISIONS: tuple[str, ...] = tuple(PLUGINS)


@dataclass(kw_only=True)
class PrecisionConfig:
    """``precision.*``: the precision plugin, the modules it keeps in fp32, and the fp8
    plugin's recipe and the layers it keeps out of fp8 (used by precision=fp8 only)."""

    name: str = "fp16"
    fp32_modules: list[str] = field(default_factory=list)  # fnmatch patterns of module names
    # fp8: tensorwise (one dynamic scale per tensor) | rowwise (per row, e4m3 only)
    fp8_recipe: str = "tensorwise"
    # fp8: kept out of fp8 (a module's pattern covers the layers inside it): embeddings, the LM
    # head / MLM decoder and classifiers, whose outputs are the most sensitive
    fp8_exclude: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))

    def __post_init__(self) -> None:
        check(self, _RULES)
        self.fp8_exclude = list(self.fp8_exclude)

    def options(self) -> dict[str, Any]:
        """The plugins' own constructor arguments (see :func:`make_precision`)."""
        return {"recipe": self.fp8_recipe, "exclude": list(self.fp8_exclude)}


_RULES = (
    ("name", one_of(PRECISIONS), f"one of {', '.join(PRECISIONS)} (select with precision=NAME)"),
    ("fp8_recipe", one_of(RECIPES), f"one of {', '.join(RECIPES)}"),
    (
        "fp8_exclude",
        lambda v, _: all(isinstance(p, str) and p for p in v),
        "a list of non-empty fnmatch patterns over module names, e.g. ['*lm_head*']",
    ),
)


def make_precision(
    name: str,
    *,
    fp32_modules: Iterable[str] = (),
    device_type: str = "cpu",
    scaler: LossScaler | None = None,
    scaler_args: dict[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Precision:
    """The plugin for precision ``name``. Its scaler is ``scaler``, or a new
    ``LossScaler(**scaler_args)`` with scaling enabled when the precision needs it.

    ``options``: plugin arguments (e.g. :meth:`PrecisionConfig.options`); each plugin takes the
    keys it names in ``option_keys`` (fp8: ``recipe``, ``exclude``) and keeps all of them in
    ``.options`` for the next plugin of a fallback."""
    cls = PLUGINS.get(name)
    if cls is None:
        raise ValueError(f"precision: '{name}' is not one of {', '.join(PRECISIONS)}")
    if scaler is None:
        scaler = LossScaler(**(scaler_args or {}), enabled=cls.needs_scaler)
    opts = dict(options or {})
    own = {k: v for k, v in opts.items() if k in cls.option_keys}
    plugin = cls(fp32_modules=fp32_modules, device_type=device_type, scaler=scaler, **own)
    plugin.options = opts
    return plugin


def PrecisionPolicy(  # noqa: N802 - the name the first release exported
    *,
    name: str = "fp16",
    fp32_modules: Iterable[str] = (),
    device_type: str = "cpu",
    options: Mapping[str, Any] | None = None,
) -> Precision:
    """``make_precision`` under the name of ampctl 0.1's policy class."""
    return make_precision(name, fp32_modules=fp32_modules, device_type=device_type, options=options)

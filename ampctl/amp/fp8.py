"""FP8 training core: torchao float8 conversion, per-layer cast health, demotion rules.

The fp8 precision plugin sits on this module; nothing here knows about configs or the loop.

* :func:`convert` swaps the eligible ``nn.Linear`` layers for torchao's ``Float8Linear``
  (``torchao.float8.convert_to_float8_training``); :func:`plan` says which layers are eligible
  and why the others are not; :func:`demote` turns one converted layer back into a plain
  ``nn.Linear`` holding the same Parameter objects (so optimizer state stays valid). The fp8
  plugin runs the whole forward under bf16 autocast, so a demoted layer computes in bf16.
* :func:`record_casts` installs hooks for one sampled step and computes, per converted layer and on
  the device, the amax of the input, weight and output-gradient and what torchao's cast does to
  each: the fraction of values the cast puts at the format's max (``sat``) and the fraction of
  the nonzero finite values it flushes to zero (``under``).
* :func:`decide_demotions` is the pure rule that picks layers to demote from those figures;
  :class:`Fp8Health` keeps the recent samples and applies it.

What the figures mean under torchao's scaling (torchao 0.18, ``float8_utils.py``): every cast
is *dynamic*: ``scale = fmax / max(amax, 1e-12)`` is computed from the very tensor being cast
(per tensor for ``tensorwise``; per row, rounded down to a power of two, for ``rowwise``), then
``clamp(x * scale, -fmax, fmax).to(fp8)``. So the clamp never cuts a finite value by more than
fp32 rounding (measured: at most 1.2e-7 relative, on the amax element only): values are not
clipped, saturation in the Transformer-Engine sense (a stale scale) cannot happen. ``sat`` is
therefore the share of the top rounding bin: under tensorwise scaling everything above 432/448
= 96.4% of the amax (e4m3) or above 53248/57344 = 92.9% (e5m2), with a floor of one element
per tensor (the amax itself always lands on the max); under rowwise the power-of-two scale puts
a row's amax anywhere in (max/2, max], so the floor is 0. It is what torchao's own
``fp8_tensor_statistics`` counts as ``num_max``. A high ``sat`` means magnitudes crowd at the
top (clipped or near-binary tensors); it costs no accuracy by itself. What dynamic scaling does cost is ``under``: one outlier sets the scale and
every value below ``amax * 2**-10 / 448`` (e4m3) or ``amax * 2**-17 / 57344`` (e5m2) becomes 0.
A non-finite value poisons the cast: ``amax`` is inf or NaN, the scale is 0 or NaN, and the
whole tensor becomes 0 and NaN, so a non-finite ``amax`` is the fp8 form of an overflow.

torchao is an optional extra, imported inside the functions that need it; without it they raise
:class:`Fp8Unavailable` with the install hint. Nothing here reads a device value on the host
unless its docstring says so.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ampctl.errors import UsageError

__all__ = [
    "HINT",
    "RECIPES",
    "DEFAULT_EXCLUDE",
    "E4M3_MAX",
    "E5M2_MAX",
    "FIELDS",
    "SUMMARY_FIELDS",
    "Fp8Unavailable",
    "Fp8Error",
    "Plan",
    "require_torchao",
    "eligible",
    "plan",
    "convert",
    "converted_layers",
    "is_fp8_layer",
    "demote",
    "cast_formats",
    "CastRecord",
    "record_casts",
    "summarize",
    "LayerSample",
    "DemoteRules",
    "decide_demotions",
    "Fp8Health",
]

HINT = 'fp8 needs torchao: pip install "ampctl[fp8]"'
RECIPES = ("tensorwise", "rowwise")
# Layers kept out of fp8 by default (fnmatch over qualified module names; a pattern that names
# a module also covers the layers inside it): embeddings and input projections of them, and
# the LM head / decoder, whose outputs (logits) are the most precision-sensitive tensors of a
# language model. torchao's own examples and torchtitan leave the output projection out too.
DEFAULT_EXCLUDE = ("*embed*", "*lm_head*", "*decoder", "*classifier*")
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max
DIM_MULTIPLE = 16  # torch._scaled_mm on CUDA: both dims of every fp8 operand

# One row per converted layer, from :meth:`CastRecord.rows`; three casts x three figures.
FIELDS = (
    "in_amax",  # input: max |x| (inf/NaN when the input was not finite)
    "in_sat",  # input: fraction of elements the e4m3 cast puts at +-max
    "in_under",  # input: fraction of the nonzero finite elements the cast flushes to zero
    "w_amax",
    "w_sat",
    "w_under",
    "go_amax",  # gradient of the layer's output (0 until a backward has run through it)
    "go_sat",
    "go_under",
)
_ROLES = ("in", "w", "go")
# From :func:`summarize`: the worst layer's figures over the forward casts (input and weight)
# and the gradient cast, the number of layers with a non-finite amax, and the row index of the
# layer with the largest sat and with the largest under (over all its casts).
SUMMARY_FIELDS = (
    "fwd_sat",
    "fwd_under",
    "grad_sat",
    "grad_under",
    "nonfinite_layers",
    "worst_sat_layer",
    "worst_under_layer",
)


class Fp8Unavailable(UsageError, ImportError):
    """torchao is not installed; the message is the one-line install hint."""


class Fp8Error(UsageError):
    """Bad fp8 input: an unknown recipe, a bad exclusion list, a layer that is not fp8."""


def require_torchao() -> Any:
    """Import ``torchao.float8`` (once) and return it, or raise :class:`Fp8Unavailable`.

    torchao logs a warning at import for each prebuilt CUDA extension it cannot load (mxfp8,
    CUTLASS sm90a kernels) and torch warns about one of its enums; float8 training uses
    neither, so those two loggers are quieted for the duration of the import only.
    """
    quiet = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    try:
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_scaling_utils import (
            get_maybe_axiswise_dim,
            hp_tensor_to_float8_dynamic,
        )
        from torchao.float8.float8_training_tensor import GemmInputRole
    except ImportError:
        raise Fp8Unavailable(HINT) from None
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)
    return SimpleNamespace(
        float8=float8,
        Float8Linear=Float8Linear,
        hp_tensor_to_float8_dynamic=hp_tensor_to_float8_dynamic,
        get_maybe_axiswise_dim=get_maybe_axiswise_dim,
        GemmInputRole=GemmInputRole,
    )


# ---------------------------------------------------------------------------------- conversion
def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise Fp8Error(f"fp8 recipe '{recipe}' is not one of {', '.join(RECIPES)}")


def _check_patterns(exclude: Iterable[str]) -> list[str]:
    if isinstance(exclude, str):
        raise Fp8Error(
            "fp8 exclude must be a list of fnmatch patterns over module names, "
            f"e.g. ['*lm_head*'], got the string {exclude!r}"
        )
    pats = list(exclude)
    for p in pats:
        if not isinstance(p, str) or not p:
            raise Fp8Error(f"fp8 exclude patterns must be non-empty strings, got {p!r}")
    return pats


def is_fp8_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` (False when torchao is absent)."""
    return any(c.__name__ == "Float8Linear" for c in type(module).__mro__) and hasattr(
        module, "linear_mm_config"
    )


def eligible(linear: nn.Module) -> str | None:
    """Why torchao's float8 cannot take this layer, or None when it can.

    The rule is torchao's own (``float8_linear_utils._auto_filter_for_tensorwise`` and
    ``_rowwise``): both ``in_features`` and ``out_features`` multiples of 16, which
    ``torch._scaled_mm`` requires of its operands on CUDA (the CPU kernel does not check, so a
    model converted here must still run on a GPU). torchao's auto-filter also skips layers it
    deems too small to be faster on an H100 (e.g. ``in <= 4096 and out <= 1024`` for
    tensorwise); that is a speed heuristic, not a requirement, and is not applied here.
    Subclasses of ``nn.Linear`` are left alone: their forward may not be ``F.linear`` (e.g.
    ``nn.MultiheadAttention.out_proj`` is never called as a module), and swapping them would
    replace it silently.
    """
    if is_fp8_layer(linear):
        return "already fp8"
    if type(linear) is not nn.Linear:
        return f"a {type(linear).__name__}, not a plain nn.Linear"
    k, n = linear.in_features, linear.out_features
    if k % DIM_MULTIPLE or n % DIM_MULTIPLE:
        return f"dims {k}x{n} are not multiples of {DIM_MULTIPLE}"
    return None


@dataclass(frozen=True)
class Plan:
    """Which ``nn.Linear`` layers :func:`convert` takes (``convert``, in module order) and why
    it leaves each of the others (``skip``: name -> reason)."""

    convert: list[str]
    skip: dict[str, str]


def plan(model: nn.Module, *, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> Plan:
    """Decide, without changing the model, which Linear layers would be converted.

    A layer is excluded when its qualified name or the name of a module containing it matches
    one of the fnmatch patterns ``exclude``. Does not need torchao.
    """
    pats = _check_patterns(exclude)
    take: list[str] = []
    skip: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if not name:
            skip[name] = "the model itself is a Linear: convert a model that contains it"
            continue
        parts = name.split(".")
        scopes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        hit = next((p for s in scopes for p in pats if fnmatch.fnmatchcase(s, p)), None)
        if hit is not None:
            skip[name] = f"excluded by pattern '{hit}'"
            continue
        why = eligible(module)
        if why is not None:
            skip[name] = why
            continue
        take.append(name)
    return Plan(convert=take, skip=skip)


def _config(recipe: str) -> Any:
    ao = require_torchao()
    return ao.float8.Float8LinearConfig.from_recipe_name(recipe)


def convert(
    model: nn.Module, *, recipe: str = "tensorwise", exclude: Iterable[str] = DEFAULT_EXCLUDE
) -> list[str]:
    """Swap the eligible ``nn.Linear`` layers of ``model`` for torchao ``Float8Linear``, in place.

    Args:
        recipe: ``tensorwise`` (one dynamic scale per tensor; e4m3 forward, e5m2 gradients) or
            ``rowwise`` (one scale per row, rounded down to a power of two; e4m3 everywhere).
        exclude: fnmatch patterns of module names to keep out (see :func:`plan`).

    Returns the names of the converted layers. The layers keep their Parameter objects, so an
    optimizer built before the conversion stays valid. Raises :class:`Fp8Error` for a bad
    recipe or pattern list and :class:`Fp8Unavailable` without torchao.
    """
    _check_recipe(recipe)
    chosen = plan(model, exclude=exclude).convert
    if not chosen:
        return []
    ao = require_torchao()
    wanted = set(chosen)
    ao.float8.convert_to_float8_training(
        model,
        config=_config(recipe),
        module_filter_fn=lambda _m, fqn: fqn in wanted,
    )
    return [n for n, m in model.named_modules() if n in wanted and is_fp8_layer(m)]


def converted_layers(model: nn.Module) -> list[str]:
    """Names of the ``Float8Linear`` layers of ``model``, in module order."""
    return [n for n, m in model.named_modules() if is_fp8_layer(m)]


def demote(model: nn.Module, name: str) -> nn.Linear:
    """Replace the fp8 layer ``name`` by a plain ``nn.Linear`` holding the same Parameters.

    The weight and bias Parameter objects move over unchanged (optimizer state keyed by them
    stays valid, and the state-dict keys are the same), as do ``training`` and
    ``requires_grad``. Forward and backward hooks registered on the old module are not
    carried over. Under the fp8 plugin's bf16 autocast the new layer computes in bf16.
    Returns the new module. Raises :class:`Fp8Error` when ``name`` is not an fp8 layer.
    """
    try:
        old = model.get_submodule(name)
    except AttributeError:
        raise Fp8Error(f"fp8: no module named '{name}' in the model") from None
    if not is_fp8_layer(old):
        raise Fp8Error(f"fp8: '{name}' is a {type(old).__name__}, not an fp8 layer to demote")
    if not name:
        raise Fp8Error("fp8: the model itself is the fp8 layer; demote a layer inside a model")
    if type(old.weight) is not nn.Parameter:  # FSDP float8 all-gather wraps the weight
        raise Fp8Error(f"fp8: '{name}' holds a wrapped weight ({type(old.weight).__name__})")
    with torch.device("meta"):
        new = nn.Linear(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    new.bias = old.bias
    new.train(old.training)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
    return new


def cast_formats(layer: nn.Module) -> dict[str, str]:
    """The fp8 format of each of the layer's casts: ``{"in": "e4m3", "w": ..., "go": ...}``."""
    c = layer.config
    out = {}
    for role, cc in zip(
        _ROLES, (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output), strict=True
    ):
        out[role] = _fmt(cc.target_dtype) if cc.scaling_type.value != "disabled" else "hp"
    return out


def _fmt(dtype: torch.dtype) -> str:
    return "e5m2" if "e5m2" in str(dtype) else "e4m3"


# ---------------------------------------------------------------------------------- cast record
class CastRecord:
    """Per-layer cast health of one sampled step, accumulated on the device.

    Built by :func:`record_casts`; while it is open every call of a converted layer adds its input and
    weight figures, and a hook on the layer's output adds the output-gradient figures when the
    backward reaches it. A layer called several times (gradient accumulation, weight sharing)
    keeps the max of each figure. Nothing is read on the host.
    """

    def __init__(self, model: nn.Module) -> None:
        self._ao = require_torchao()
        self.names: list[str] = []  # converted layers, in the order of their first call
        self._rows: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._layers = [(n, m) for n, m in model.named_modules() if is_fp8_layer(m)]

    # -- hooks
    def _open(self) -> None:
        for name, layer in self._layers:
            self._handles.append(layer.register_forward_hook(self._forward_hook(name)))

    def _close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, name: str):
        def hook(layer: nn.Module, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
                return
            c = layer.config
            # Float8Linear.forward casts its input to the CUDA autocast dtype first; so do we.
            if torch.is_autocast_enabled("cuda"):
                x = x.to(torch.get_autocast_dtype("cuda"))
            with torch.no_grad(), _no_autocast(x):
                fin = self._stats(x, c.cast_config_input, c, layer, "INPUT", -1)
                fw = self._stats(layer.weight.t(), c.cast_config_weight, c, layer, "WEIGHT", 0)
                self._add(name, x, 0, torch.cat([fin, fw]))
            if output.requires_grad:
                output.register_hook(self._grad_hook(name, layer))

        return hook

    def _grad_hook(self, name: str, layer: nn.Module):
        def hook(grad: torch.Tensor) -> None:
            c = layer.config
            with torch.no_grad(), _no_autocast(grad):
                g = grad.reshape(-1, grad.shape[-1])
                self._add(
                    name,
                    grad,
                    6,
                    self._stats(g, c.cast_config_grad_output, c, layer, "GRAD_OUTPUT", -1),
                )

        return hook

    def _stats(self, x, cast_config, config, layer, role: str, axis: int) -> torch.Tensor:
        """[amax, sat, under] of torchao's cast of ``x`` (the same call torchao makes)."""
        amax = x.detach().abs().amax().float()
        if cast_config.scaling_type.value == "disabled":
            zero = amax.new_zeros(())
            return torch.stack([amax, zero, zero])
        ao = self._ao
        cast = ao.hp_tensor_to_float8_dynamic(
            x.detach(),
            cast_config.target_dtype,
            layer.linear_mm_config,
            gemm_input_role=getattr(ao.GemmInputRole, role),
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=ao.get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        q = cast._data.float()
        fmax = torch.finfo(cast_config.target_dtype).max
        sat = (q.abs() == fmax).float().mean()
        nz = (x != 0) & torch.isfinite(x)
        under = ((q == 0) & nz).sum().float() / nz.sum().clamp(min=1).float()
        return torch.stack([amax, sat, under])

    def _add(self, name: str, like: torch.Tensor, start: int, vals: torch.Tensor) -> None:
        row = self._rows.get(name)
        if row is None:
            self.names.append(name)
            row = torch.zeros(len(FIELDS), dtype=torch.float32, device=like.device)
        end = start + vals.numel()
        row = row.clone()  # a fresh tensor: rows() handed out earlier keep their values
        # torch.maximum keeps NaN: a non-finite amax seen once stays in the row
        row[start:end] = torch.maximum(row[start:end], vals.to(row.device))
        self._rows[name] = row

    # -- results
    def rows(self) -> torch.Tensor:
        """A ``[layers, len(FIELDS)]`` float32 device tensor, one row per layer in
        ``self.names`` (call order); empty when no converted layer ran. No host read."""
        if not self._rows:
            return torch.zeros(0, len(FIELDS))
        return torch.stack([self._rows[n] for n in self.names])


@contextlib.contextmanager
def _no_autocast(t: torch.Tensor) -> Iterator[None]:
    with torch.autocast(device_type=t.device.type, enabled=False):
        yield


@contextlib.contextmanager
def record_casts(model: nn.Module, *, enabled: bool = True) -> Iterator[CastRecord | None]:
    """Sample fp8 cast health for the forward and backward run inside the block.

    ``with record_casts(model, enabled=is_log_step) as p:`` -- run forward and backward inside; then
    ``p.rows()`` (or ``summarize(p.rows())``) for the log read. Disabled, it yields None and
    installs nothing: the step costs exactly what an unprobed step costs. On exit the forward
    hooks are removed; the output-gradient hooks live on that step's autograd graph and go
    with it. No host read.

    Under ``torch.compile`` run the sampled step through the eager module (``compiled._orig_mod``,
    same parameters): a compiled graph does not see hooks added after it was traced (dynamo
    skips hook guards by default), and tracing them instead costs graph breaks and recompiles.
    Passing the compiled wrapper here raises :class:`Fp8Error`.
    """
    if not enabled:
        yield None
        return
    if hasattr(model, "_orig_mod"):
        raise Fp8Error(
            "fp8 probe: pass the eager module (compiled._orig_mod) and run the sampled step "
            "through it; a torch.compile graph does not run hooks added after compiling"
        )
    p = CastRecord(model)
    p._open()
    try:
        yield p
    finally:
        p._close()


def summarize(rows: torch.Tensor) -> torch.Tensor:
    """The worst layer's figures: a device tensor ordered as ``SUMMARY_FIELDS``. No host read.

    ``fwd_*`` take the max over the input and weight casts of every layer, ``grad_*`` over the
    output-gradient casts; ``nonfinite_layers`` counts the layers with a non-finite amax;
    ``worst_*_layer`` is the row of the layer with the largest figure (-1 with no rows).
    """
    if rows.shape[0] == 0:
        z = torch.zeros(len(SUMMARY_FIELDS), device=rows.device)
        z[-2:] = -1
        return z
    col = {f: rows[:, i] for i, f in enumerate(FIELDS)}
    sat = torch.stack([col["in_sat"], col["w_sat"], col["go_sat"]], dim=1).amax(dim=1)
    under = torch.stack([col["in_under"], col["w_under"], col["go_under"]], dim=1).amax(dim=1)
    amax = torch.stack([col["in_amax"], col["w_amax"], col["go_amax"]], dim=1)
    return torch.stack(
        [
            torch.maximum(col["in_sat"], col["w_sat"]).amax(),
            torch.maximum(col["in_under"], col["w_under"]).amax(),
            col["go_sat"].amax(),
            col["go_under"].amax(),
            (~torch.isfinite(amax)).any(dim=1).sum().float(),
            sat.argmax().float(),
            under.argmax().float(),
        ]
    )


# ---------------------------------------------------------------------------------- decisions
@dataclass(frozen=True, kw_only=True)
class LayerSample:
    """One layer's figures from one sampled step, as plain numbers (a row of FIELDS)."""

    in_amax: float = 0.0
    in_sat: float = 0.0
    in_under: float = 0.0
    w_amax: float = 0.0
    w_sat: float = 0.0
    w_under: float = 0.0
    go_amax: float = 0.0
    go_sat: float = 0.0
    go_under: float = 0.0

    @classmethod
    def from_row(cls, row: Sequence[float]) -> LayerSample:
        if len(row) != len(FIELDS):
            raise ValueError(f"a layer row has {len(FIELDS)} figures ({FIELDS}), got {len(row)}")
        return cls(**{f: float(v) for f, v in zip(FIELDS, row, strict=True)})

    @property
    def forward_finite(self) -> bool:
        return math.isfinite(self.in_amax) and math.isfinite(self.w_amax)

    @property
    def grad_finite(self) -> bool:
        return math.isfinite(self.go_amax)

    @property
    def sat(self) -> float:
        return max(self.in_sat, self.w_sat, self.go_sat)

    @property
    def under(self) -> float:
        return max(self.in_under, self.w_under, self.go_under)


@dataclass(kw_only=True)
class DemoteRules:
    """Thresholds of :func:`decide_demotions`.

    Args:
        sat_threshold: a layer whose largest ``sat`` is above this in each of the last
            ``patience`` samples is demoted.
        under_threshold: the same for ``under`` (the share of nonzero values flushed to zero).
        patience: samples in a row that must exceed a threshold.

    The defaults sit an order of magnitude above what healthy training shows: over 300 steps
    of the default tiny BERT task (30 samples, 13 fp8 layers, tensorwise and rowwise) the
    largest ``sat`` seen was 0.86% and the largest ``under`` 0.039%.
    """

    sat_threshold: float = 0.10
    under_threshold: float = 0.01
    patience: int = 3

    def __post_init__(self) -> None:
        for f in ("sat_threshold", "under_threshold"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ValueError(f"fp8 {f} must be a fraction in [0, 1], got {v!r}")
        p = self.patience
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"fp8 patience must be an integer >= 1, got {p!r}")


def decide_demotions(
    history: Mapping[str, Sequence[LayerSample]], rules: DemoteRules
) -> dict[str, str]:
    """Which fp8 layers to demote to bf16, and why: ``{name: reason}``.

    ``history`` maps each fp8 layer, in forward call order, to its recent samples, oldest
    first. A pure function of the numbers.
    """
    out: dict[str, str] = {}
    latest = {n: s[-1] for n, s in history.items() if s}
    # 1) a non-finite forward cast (input or weight): the first such layer in call order is
    #    where the bad values entered fp8; the layers after it only see what it passed on.
    bad_fwd = [n for n, s in latest.items() if not s.forward_finite]
    if bad_fwd:
        s = latest[bad_fwd[0]]
        what = "input" if not math.isfinite(s.in_amax) else "weight"
        out[bad_fwd[0]] = f"non-finite {what} (amax {s.in_amax if what == 'input' else s.w_amax})"
    # 2) non-finite only in the gradient casts: backward runs in reverse, so the last such
    #    layer in call order is the first the bad gradient reached.
    bad_grad = [n for n, s in latest.items() if s.forward_finite and not s.grad_finite]
    if bad_grad and not bad_fwd:
        s = latest[bad_grad[-1]]
        out[bad_grad[-1]] = f"non-finite output gradient (amax {s.go_amax})"
    for name, samples in history.items():
        recent = list(samples)[-rules.patience :]
        if name in out or len(recent) < rules.patience:
            continue
        # 3) persistent saturation: too many values at the format's max, sample after sample.
        if all(s.sat > rules.sat_threshold for s in recent):
            out[name] = (
                f"saturation above {rules.sat_threshold:.1%} in {rules.patience} samples in a "
                f"row (last {recent[-1].sat:.1%})"
            )
        # 4) persistent underflow: too many nonzero values flushed to zero by the cast.
        elif all(s.under > rules.under_threshold for s in recent):
            out[name] = (
                f"underflow above {rules.under_threshold:.1%} in {rules.patience} samples in a "
                f"row (last {recent[-1].under:.1%})"
            )
        # 5) otherwise the layer stays in fp8.
    return out


@dataclass
class Fp8Health:
    """Keeps the last ``rules.patience`` samples of each fp8 layer and applies
    :func:`decide_demotions` after each log read (host numbers only)."""

    rules: DemoteRules = field(default_factory=DemoteRules)

    def __post_init__(self) -> None:
        self.history: dict[str, deque[LayerSample]] = {}

    def observe(self, names: Sequence[str], rows: Sequence[Sequence[float]]) -> dict[str, str]:
        """Add one sample per layer (``rows`` already on the host, e.g. ``rows.tolist()`` of
        the loop's single log read) and return the layers to demote with their reasons."""
        if len(names) != len(rows):
            raise ValueError(f"{len(names)} layer names for {len(rows)} rows")
        for n, r in zip(names, rows, strict=True):
            self.history.setdefault(n, deque(maxlen=self.rules.patience)).append(
                LayerSample.from_row(r)
            )
        ordered = {n: self.history[n] for n in names}
        return decide_demotions(ordered, self.rules)

    def forget(self, name: str) -> None:
        """Drop a layer's history (after it was demoted)."""
        self.history.pop(name, None)

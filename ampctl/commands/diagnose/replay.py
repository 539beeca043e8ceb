"""Part 3 of a diagnosis: replay a few batches forward and backward with hooks on every module.

Each batch runs once in fp32 (the reference: true, unscaled gradients; tells whether a
non-finite forward is a precision problem at all) and once in the run's precision with the loss
scaled as the run scaled it: per-module activation headroom, the first module with a non-finite
output in forward and in backward (intentional ``-inf`` attention masks are not faults), gradient
underflow at the current scale and the headroom of the largest scaled gradient.

What is replayed (:class:`ReplayInput`) comes from the checkpoint without running foreign code:

* ampctl: the model and data rebuilt from the saved config, *after* the trust rule
  (:func:`ampctl.config.config_from_saved`: a ``_target_`` that does not ship with ampctl needs
  ``--trust-code``; an interpolation is never evaluated); the batches the run was about to see;
* Hugging Face: the model rebuilt from ``config.json`` by transformers' Auto classes
  (``trust_remote_code=False``, local files only), synthetic token batches within the
  vocabulary (labelled as such), or ``--data FILE`` tokenized by the tokenizer saved beside it.

Other formats store weights without the model's class: their replay is skipped with the reason.

Gradient figures: an element underflows when ``|g| * scale < 2**-24``; ``S* = 65504 / max|g|``
and the recommended ``init_scale`` is :func:`ampctl.amp.formats.recommended_init_scale`.
``max|g|`` covers the parameter gradients and the gradients flowing between modules that run in
fp16. The fp16 pass also counts its activation gradients below fp16's normal range and at zero
(:mod:`ampctl.amp.actgrad`), the underflow loss scaling exists to prevent. **Syncs** once per
batch and pass.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import Precision, make_precision, nonfinite_tensor_names
from ampctl.amp.actgrad import ActGradCounter
from ampctl.amp.formats import (
    FP16_MAX,
    FP16_SUBNORMAL,
    dtype_max,
    ideal_scale,
    recommended_init_scale,
)
from ampctl.amp.locate import ModuleTrace, first_bad, trace_modules
from ampctl.errors import UsageError, first_line

from .common import finite
from .fp8 import fp8_layers
from .stages import FirstBad, Fp8Section, Gradients, ModuleRow, Replay, ScalerState

__all__ = ["ReplayInput", "ReplaySkipped", "run_replay", "skipped", "replay_scale"]

_HIST_OFFSET = 160  # frexp exponents of finite fp32 values lie in [-148, 128]
_HIST_BINS = 300


class ReplaySkipped(Exception):
    """The replay cannot run; the message is the one-line reason."""


@dataclass
class ReplayInput:
    """Everything a replay needs, built from a checkpoint without running foreign code."""

    model: nn.Module  # fp32, weights loaded, on ``device``
    batches: list[dict[str, torch.Tensor]]
    positions: list[int]
    precision: str
    device: torch.device
    scale: float
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    accum: int = 1
    seed: int = 0
    fp32_modules: list[str] = field(default_factory=list)
    in_fp32: list[str] = field(default_factory=list)  # the modules the checkpoint ran in fp32
    data: str = "the run's next batches"
    options: dict[str, Any] = field(default_factory=dict)  # plugin options (fp8 recipe ...)
    precision_state: dict[str, Any] | None = None  # the checkpoint's (fp8 demotions)
    fp8_sat_threshold: float = 0.10  # the guard's demotion thresholds (the run's config)
    fp8_under_threshold: float = 0.01


def skipped(reason: str, precision: str | None, device: torch.device | str) -> Replay:
    return Replay(ran=False, reason=reason, precision=precision, device=str(device))


# ---------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The same dropout masks for the fp32 and the low-precision replay of a batch; the caller's
    RNG state is left as it was. Also quiets torch's note that hooks on modules returning a
    model-output object see no backward (those modules are covered by their children)."""
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        torch.manual_seed(seed)
        yield


def _grad_figures(grads: list[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
    """[elements, zeros, nonfinite, max |g|, underflow at ``scale`` (zeros included), exponent
    histogram...] of unscaled gradients, on the device (no host read)."""
    elems = torch.zeros((), dtype=torch.float64, device=device)
    zeros, bad, under = elems.clone(), elems.clone(), elems.clone()
    amax = torch.zeros((), dtype=torch.float32, device=device)
    hist = torch.zeros(_HIST_BINS, dtype=torch.float64, device=device)
    threshold = FP16_SUBNORMAL / scale
    for g in grads:
        g = g.detach().float().reshape(-1).to(device)
        fin = torch.isfinite(g)
        mag = torch.where(fin, g, torch.zeros((), device=device)).abs()
        elems += g.numel()
        zeros += (g == 0).sum()
        bad += (~fin).sum()
        under += ((mag < threshold) & fin).sum()
        amax = torch.maximum(amax, mag.max())
        nz = mag[(mag > 0)]
        if nz.numel():
            _, exp = torch.frexp(nz)
            hist += torch.bincount(
                (exp.long() + _HIST_OFFSET).clamp(0, _HIST_BINS - 1), minlength=_HIST_BINS
            ).double()
    return torch.cat([torch.stack([elems, zeros, bad, amax.double(), under]), hist])


def _lost_at(hist: list[float], nonzero: float, scale: float) -> float:
    """Fraction of non-zero elements with |g| * scale < 2**-24, for a power-of-two scale."""
    if nonzero <= 0:
        return 0.0
    k = -24 - math.log2(scale)  # |g| < 2**k  <=>  frexp exponent <= k (k an integer)
    return sum(hist[: max(0, min(_HIST_BINS, math.floor(k) + _HIST_OFFSET + 1))]) / nonzero


def _bad_backward(t: ModuleTrace) -> bool:
    return t.nan or t.posinf or t.neginf  # no gradient is -inf on purpose


def _where(t: ModuleTrace, batch: int, position: int, fp32_finite: bool | None = None) -> FirstBad:
    return FirstBad(t.name, batch, position, t.nan, t.posinf, t.neginf, t.dtype, fp32_finite)


def _params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _loss(model: nn.Module, b: dict[str, torch.Tensor], autocast: Any, out: list, accum: int):
    from ampctl.protect.loss import extract_loss

    with autocast():
        o = model(**b)
    loss = extract_loss(o).float()
    out.append(loss.detach())
    return loss / accum  # a micro-batch, as the trainer backpropagates it


# ---------------------------------------------------------------------------- the passes
@dataclass
class _Reference:
    """What the fp32 pass found, per batch (device values until the one read)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    module_bad: list[bool] = field(default_factory=list)
    bwd: list[list[ModuleTrace]] = field(default_factory=list)
    figs: list[torch.Tensor] = field(default_factory=list)
    # zeros among the fp32 activation gradients: structural (e.g. unlabelled masked-LM
    # positions), the baseline the fp16 pass's underflow is measured against
    act_zeros: ActGradCounter = field(
        default_factory=lambda: ActGradCounter(dtypes=(torch.float32,))
    )


@dataclass
class _LowPass:
    """What the pass in the run's precision found, over every batch."""

    losses: list[torch.Tensor] = field(default_factory=list)
    modules: dict[str, ModuleRow] = field(default_factory=dict)
    masked: list[str] = field(default_factory=list)
    fwd_first: tuple[ModuleTrace, int] | None = None
    bwd_first: FirstBad | None = None
    low_grad_modules: set[str] = field(default_factory=set)
    act_scaled_max: float = 0.0
    figs: list[torch.Tensor] = field(default_factory=list)
    nonfinite_params: list[str] = field(default_factory=list)
    act: ActGradCounter = field(default_factory=ActGradCounter)  # fp16 activation gradients
    fp8_probe: Any = None


def _reference_pass(inp: ReplayInput) -> _Reference:
    """fp32: true gradients, and whether the forward is finite without low precision."""
    model, ref = inp.model, _Reference()
    params = [p for _, p in _params(model)]
    for i, b in enumerate(inp.batches):
        model.zero_grad(set_to_none=True)
        with _seeded(inp.seed + inp.positions[i], inp.device), ref.act_zeros.hooks(model):
            fwd, bwd = trace_modules(
                model,
                lambda b=b: _loss(model, b, contextlib.nullcontext, ref.losses, inp.accum),
                backward=True,
            )
        ref.module_bad.append(first_bad(fwd) is not None)
        ref.bwd.append(bwd)
        ref.figs.append(
            _grad_figures([p.grad for p in params if p.grad is not None], inp.scale, inp.device)
        )
    model.zero_grad(set_to_none=True)
    return ref


def _prepare_policy(inp: ReplayInput) -> tuple[Precision, list[str]]:
    policy = make_precision(
        inp.precision,
        fp32_modules=list(inp.fp32_modules),
        device_type=inp.device.type,
        options=inp.options,
    )
    in_fp32: list[str] = []
    try:
        if inp.precision == "fp8":  # as the trainer: convert, demote again, then fp32
            policy.prepare(inp.model)
            policy.restore(inp.model, inp.precision_state or {})
            in_fp32 = [n for n in inp.in_fp32 if policy.to_fp32(inp.model, n)]
        else:
            for n in inp.in_fp32:
                if policy.to_fp32(inp.model, n):
                    in_fp32.append(n)
            policy.prepare(inp.model)
    except UsageError as e:  # fp8: torchao missing, a bad recipe or exclusion list
        raise ReplaySkipped(first_line(e)) from None
    except (AttributeError, ValueError) as e:
        raise ReplaySkipped(
            f"the checkpoint's fp32 modules do not fit the model: {first_line(e)}"
        ) from None
    in_fp32 = list(dict.fromkeys(list(policy.in_fp32) + in_fp32))
    return policy, in_fp32


def _precision_pass(inp: ReplayInput, policy: Precision, low: str) -> _LowPass:
    """The run's precision, with hooks: module headroom, first non-finite forward/backward;
    under fp8 also the cast figures of every fp8 layer (kept on the device)."""
    model = inp.model
    named = _params(model)
    st = _LowPass()
    with _fp8_probe(inp, policy) as probe:
        for i, b in enumerate(inp.batches):
            _precision_batch(inp, policy, low, st, named, i, b)
    st.fp8_probe = probe
    model.zero_grad(set_to_none=True)
    return st


@contextlib.contextmanager
def _fp8_probe(inp: ReplayInput, policy: Precision) -> Iterator[Any]:
    """:func:`ampctl.amp.fp8.record_casts` over the fp8 pass (None for other precisions)."""
    if policy.name != "fp8":
        yield None
        return
    from ampctl.amp import fp8

    with fp8.record_casts(inp.model) as p:
        yield p


def _precision_batch(
    inp: ReplayInput,
    policy: Precision,
    low: str,
    st: _LowPass,
    named: list[tuple[str, nn.Parameter]],
    i: int,
    b: dict[str, torch.Tensor],
) -> None:
    """Batch ``i`` of the precision pass, its figures added to ``st`` (on the device)."""
    model, scale = inp.model, inp.scale
    model.zero_grad(set_to_none=True)
    with _seeded(inp.seed + inp.positions[i], inp.device), st.act.hooks(model):
        fwd, bwd = trace_modules(
            model,
            lambda b=b: _loss(model, b, policy.autocast, st.losses, inp.accum) * scale,
            backward=True,
        )
    for t in fwd:
        m = st.modules.setdefault(t.name, ModuleRow(t.name, t.dtype, 0.0, False))
        m.amax = max(m.amax, t.amax)
        m.bad = m.bad or t.bad
        if t.neginf and not t.bad and t.name not in st.masked:
            st.masked.append(t.name)
    fb = first_bad(fwd)
    if fb is not None and st.fwd_first is None:
        st.fwd_first = (fb, i)
    bb = next((t for t in bwd if _bad_backward(t)), None)
    if bb is not None and st.bwd_first is None:
        st.bwd_first = _where(bb, i, inp.positions[i])
    for t in bwd:
        if t.dtype == low:
            st.low_grad_modules.add(t.name)
            if not _bad_backward(t):
                st.act_scaled_max = max(st.act_scaled_max, t.amax)
    grads = [p.grad for _, p in named if p.grad is not None]
    st.figs.append(_grad_figures([g.float() / scale for g in grads], scale, inp.device))
    for n in nonfinite_tensor_names((n, p.grad) for n, p in named):
        if n not in st.nonfinite_params:
            st.nonfinite_params.append(n)


def _gradients(
    inp: ReplayInput, ref: _Reference, low: _LowPass, ref_vals: list, low_vals: list
) -> Gradients:
    """Gradient figures over all replayed batches (the fp32 reference: true gradients), and
    the fp16 pass's activation-gradient underflow. **Syncs** (the activation counts)."""
    elems = sum(v[0] for v in ref_vals)
    zeros = sum(v[1] for v in ref_vals)
    bad = sum(v[2] for v in ref_vals)
    max_param = max((v[3] for v in ref_vals), default=0.0)
    under = sum(v[4] for v in ref_vals)
    hist = [sum(v[5 + j] for v in ref_vals) for j in range(_HIST_BINS)]
    nonzero = elems - zeros - bad
    max_act = max(
        (
            t.amax
            for bwd in ref.bwd
            for t in bwd
            if t.name in low.low_grad_modules and math.isfinite(t.amax)
        ),
        default=0.0,
    )
    max_abs = max(max_param, max_act)
    rec = recommended_init_scale(max_abs, min_scale=inp.min_scale, max_scale=inp.max_scale)
    act = dict.fromkeys((*ActGradCounter.fractions(None), "act_grad_zero_frac_fp32"))
    low_counts, ref_counts = low.act.counts, ref.act_zeros.counts
    if low_counts is not None and ref_counts is not None:  # fp16 activations were counted
        lo, rf = torch.stack([low_counts, ref_counts]).tolist()  # one read
        act.update(ActGradCounter.fractions(lo), act_grad_zero_frac_fp32=rf[0] / rf[2])
    max_scaled = max_abs * inp.scale
    lost = (under - zeros) / nonzero if nonzero > 0 else 0.0
    return Gradients(
        scale=inp.scale,
        max_abs=max_abs,
        max_abs_param=max_param,
        max_abs_activation=max_act,
        max_scaled=max_scaled,
        headroom_log2=math.log2(FP16_MAX / max_scaled) if max_scaled > 0 else math.inf,
        max_scaled_replay=max(
            max((v[3] for v in low_vals), default=0.0) * inp.scale, low.act_scaled_max
        ),
        underflow_frac=under / elems if elems else 0.0,
        zero_frac=zeros / elems if elems else 0.0,
        zero_frac_replay=sum(v[1] for v in low_vals) / max(sum(v[0] for v in low_vals), 1),
        lost_frac=max(lost, 0.0),
        lost_frac_at_recommended=_lost_at(hist, nonzero, rec),
        ideal_scale=ideal_scale(max_abs),
        recommended_init_scale=rec,
        # the same without the run's bounds: a run pinned low (max_scale=1) needs them raised
        recommended_init_scale_unbounded=recommended_init_scale(
            max_abs, min_scale=0.0, max_scale=math.inf
        ),
        max_scale=inp.max_scale,
        **act,
        nonfinite_params=low.nonfinite_params,
    )


def run_replay(inp: ReplayInput) -> tuple[Replay, Fp8Section | None]:
    """Replay ``inp.batches`` in fp32 and in ``inp.precision``: the report's part 3, and its
    fp8 section for an fp8 replay."""
    t0 = time.perf_counter()
    ref = _reference_pass(inp)
    policy, in_fp32 = _prepare_policy(inp)
    low_dtype = str(policy.compute_dtype).replace("torch.", "")
    low = _precision_pass(inp, policy, low_dtype)
    vals = torch.stack(ref.figs + low.figs).cpu().tolist()  # the one read of the figures
    ref_vals, low_vals = vals[: len(ref.figs)], vals[len(ref.figs) :]
    loss_ref = torch.stack(ref.losses).double().cpu().tolist()
    loss_low = torch.stack(low.losses).double().cpu().tolist()
    fwd_first = None
    if low.fwd_first is not None:
        t, i = low.fwd_first
        fp32_finite = not ref.module_bad[i] and math.isfinite(loss_ref[i])
        fwd_first = _where(t, i, inp.positions[i], fp32_finite)
    bwd_first = low.bwd_first
    if bwd_first is not None:  # whether the same batch's fp32 backward was finite
        bwd_first.fp32_finite = not any(_bad_backward(t) for t in ref.bwd[bwd_first.batch])
    scaled = policy.compute_dtype == torch.float16
    limit = dtype_max(policy.compute_dtype)
    for m in low.modules.values():
        m.headroom_log2 = math.log2(limit / m.amax) if m.amax > 0 else math.inf
    fp8_section = _fp8_section(inp, policy, low.fp8_probe)
    replay = Replay(
        ran=True,
        reason=None,
        precision=inp.precision,
        device=str(inp.device),
        data=inp.data,
        positions=inp.positions,
        scale=inp.scale,
        limit=limit,
        loss=loss_low,
        loss_fp32=loss_ref,
        modules=list(low.modules.values()),
        masked_modules=low.masked,
        forward_first_bad=fwd_first,
        backward_first_bad=bwd_first,
        gradients=_gradients(inp, ref, low, ref_vals, low_vals) if scaled else None,
        exempted=in_fp32,  # the JSON key (report.py) is 'exempted'
        elapsed_s=time.perf_counter() - t0,
    )
    return replay, fp8_section


def _fp8_section(inp: ReplayInput, policy: Any, probe: Any) -> Fp8Section | None:
    """The report's ``fp8`` section from the probe of the fp8 pass (None for other
    precisions). **Syncs** once: the probe's rows."""
    if probe is None:
        return None
    from ampctl.amp import fp8

    rows = probe.rows().cpu().tolist()
    names = list(probe.names)
    formats = {n: fp8.cast_formats(inp.model.get_submodule(n)) for n in names}
    return Fp8Section(
        ran=True,
        reason=None,
        recipe=policy.recipe,
        exclude=list(policy.exclude),
        converted=fp8.converted_layers(inp.model),
        demoted=dict(policy.demoted),
        excluded=dict(policy.skipped),
        sat_threshold=inp.fp8_sat_threshold,
        under_threshold=inp.fp8_under_threshold,
        layers=fp8_layers(
            names,
            rows,
            fp8.FIELDS,
            formats,
            sat_threshold=inp.fp8_sat_threshold,
            under_threshold=inp.fp8_under_threshold,
        ),
    )


# ---------------------------------------------------------------------------- inputs
def replay_scale(scaler: ScalerState | None, precision: str, fallback: float) -> float:
    """The scale the run would use next: the checkpoint's (when it is a usable number), else
    ``fallback`` (the configured init scale). 1.0 for precisions without loss scaling."""
    if make_precision(precision).compute_dtype != torch.float16:
        return 1.0
    scale = scaler.scale if scaler is not None and scaler.enabled else None
    return float(scale) if finite(scale) and scale > 0 else float(fallback)


def _first_int(node: Any, *keys: str) -> int | None:
    get = node.get if isinstance(node, dict) else lambda k: getattr(node, k, None)
    for k in keys:
        v = get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def activation_bytes(model_cfg: Any, batch: int, seq: int) -> int:
    """A rough upper estimate of one replay pass's activations for a transformer
    (Korthikanti et al.: ~34 bytes per token, hidden unit and layer in half precision, here
    in fp32 and with margin, plus the attention scores); 0 when the config names no width or
    depth."""
    hidden = _first_int(model_cfg, "hidden_size", "d_model", "n_embd", "dim")
    layers = _first_int(model_cfg, "num_layers", "num_hidden_layers", "n_layer", "n_layers")
    if hidden is None or layers is None:
        return 0
    heads = _first_int(model_cfg, "num_heads", "num_attention_heads", "n_head") or 1
    tokens = batch * seq
    return layers * (tokens * hidden * 80 + heads * tokens * seq * 12)


def _checked_model(
    build: Any,
    state: Any,
    what: str,
    *,
    config: Any,
    device: torch.device | None = None,
    **kw: Any,
) -> None:
    """:func:`ampctl.trust.check_model_fits` before the real build: a model whose dimensions
    do not match the checkpoint's tensors, that asks for more layers than the checkpoint holds
    tensors (:func:`ampctl.trust_counts.check_counts`, before the meta build), or that needs more
    memory than allowed, is not built (the replay is skipped with the reason: one line saying
    what would make it run; the state health and the history are reported as ever). ``state``:
    the checkpoint's tensors, looked at by shape only (nothing is read). On a CUDA ``device``
    the host holds the model twice at most (built, and the checkpoint's tensors while they are
    copied in); gradients and activations are the device's."""
    from ampctl.trust import ResourceRefused, check_model_fits, human_size
    from ampctl.trust_counts import check_counts

    from .readers.lazy import meta_of

    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        kw = {**kw, "factor": 2.0, "extra": 0}
    try:
        check_counts(config, len(state), source=what)
        check_model_fits(build, meta_of(state), source=what, **kw)
    except ResourceRefused as e:
        if e.need is None or e.limit is None:
            raise ReplaySkipped(str(e)) from None
        where = "" if cuda else ", or --device cuda on a machine with a GPU"
        how = (
            "on the host, before it moves to the GPU"
            if cuda
            else "in fp32, with gradients and activations"
        )
        raise ReplaySkipped(
            f"rebuilding the whole model ({how}) needs about "
            f"{human_size(e.need)}, more than the {human_size(e.limit)} allowed; the state "
            "health and the history do not need it. To replay, pass --max-memory SIZE where the "
            f"machine has that memory{where}"
        ) from None


def ampctl_input(
    found: Any,
    cfg: Any,
    *,
    precision: str,
    device: torch.device,
    batches: int,
    data_file: Path | None = None,
    trust_code: bool = False,
    scaler: ScalerState | None = None,
) -> ReplayInput:
    """An ampctl checkpoint's replay: model and data from its (trusted) config. The model's
    dimensions are checked against the checkpoint's tensors and its memory estimated before it
    is built; a path the config names for data is opened only with ``trust_code`` (else
    ``data_file``, the user's, or synthetic batches of the run's shape)."""
    from ampctl.errors import UsageError
    from ampctl.train.builders import build_model

    ck = found.raw
    d = cfg.data
    extra = activation_bytes(cfg.model, d.batch_size, d.seq_len)
    _checked_model(
        lambda: build_model(cfg.model),
        ck["model"],
        f"the checkpoint {found.path}",
        config=cfg.model,
        extra=extra,
        device=device,
    )
    try:
        with torch.random.fork_rng(devices=[]):  # the init is overwritten: leave the RNG alone
            model = build_model(cfg.model)
        model.load_state_dict(ck["model"])
    except (UsageError, RuntimeError) as e:
        raise ReplaySkipped(
            f"the model cannot be rebuilt from the checkpoint: {first_line(e)}"
        ) from None
    if ck.get("master") is not None:
        params = [p for _, p in _params(model)]
        if len(params) != len(ck["master"]):
            raise ReplaySkipped(
                f"master weights do not fit the model: {len(ck['master'])} master tensors for "
                f"{len(params)} parameters"
            )
        with torch.no_grad():
            for p, m in zip(params, ck["master"], strict=True):
                p.copy_(m)
    model.to(device).train()
    data, label = replay_data(cfg, data_file, trust_code)
    start = int((ck.get("data") or {}).get("position", 0))
    positions = [start + i for i in range(batches)]
    sc = ck.get("scaler") if isinstance(ck.get("scaler"), dict) else {}
    return ReplayInput(
        model=model,
        batches=[{k: v.to(device) for k, v in data.batch_at(p).items()} for p in positions],
        positions=positions,
        precision=precision,
        device=device,
        scale=replay_scale(scaler, precision, cfg.scaler.init_scale),
        min_scale=float(sc.get("min_scale", cfg.scaler.min_scale)),
        max_scale=float(sc.get("max_scale", cfg.scaler.max_scale)),
        accum=int(cfg.trainer.grad_accum_steps),
        seed=int(cfg.trainer.seed),
        fp32_modules=list(cfg.precision.fp32_modules),
        in_fp32=list(found.fp32_modules),
        data=label,
        options=cfg.precision.options(),
        precision_state=ck.get("precision") if isinstance(ck.get("precision"), dict) else None,
        fp8_sat_threshold=float(cfg.guard.fp8_sat_threshold),
        fp8_under_threshold=float(cfg.guard.fp8_under_threshold),
    )


def _source(cfg: Any) -> Any:
    from ampctl.train.builders import build_data_source

    return build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)


def replay_data(cfg: Any, data_file: Path | None, trust_code: bool) -> tuple[Any, str]:
    """The data source of an ampctl replay and how the report names it. A checkpoint's config
    is data: the paths it names (``data.path``, ``data.tokenizer``, ``data.cache_dir``) are
    opened only with ``trust_code``. Otherwise ``data_file`` (``--data``, the user's) replaces
    ``data.path`` of a ``data=text`` run, and anything else replays synthetic batches of the
    run's shape (batch size, sequence length, ids within the model's vocabulary)."""
    from ampctl.config import ConfigError, with_changes
    from ampctl.errors import UsageError
    from ampctl.train.data import DataError

    d = cfg.data
    named = [f"{k}={v!r}" for k, v in (("data.path", d.path), ("data.tokenizer", d.tokenizer),
                                          ("data.cache_dir", d.cache_dir)) if v]  # fmt: skip
    label = "the run's next batches"
    vocab = _first_int(cfg.model, "vocab_size") or d.vocab_size
    try:
        if d.kind == "synthetic" or trust_code:
            if named:
                label += f" ({', '.join(named)}, opened as --trust-code allows)"
            return _source(cfg), label
        if data_file is not None and d.kind == "text":
            if vocab < d.vocab_size:
                raise ReplaySkipped(
                    f"--data {data_file}: data=text gives byte-level ids up to {d.vocab_size - 1}, "
                    f"beyond the model's vocab_size {vocab}"
                )
            return _source(with_changes(cfg, data={"path": str(data_file)})), (
                f"{data_file} (--data) in the run's batch shape"
            )
        why = f"the checkpoint's config names {', '.join(named)}"
        if data_file is not None:
            why += f"; --data replaces data.path of data=text runs only (this is data={d.kind})"
        synthetic = {"kind": "synthetic", "path": None, "tokenizer": None, "vocab_size": vocab}
        return _source(with_changes(cfg, data=synthetic)), (
            f"synthetic batches of the run's shape ({d.batch_size} x {d.seq_len} tokens, ids below "
            f"{vocab}), not the run's data: {why}, and a checkpoint is data, so no path it names "
            "is opened; pass --data PATH to replay your own text, or --trust-code"
        )
    except (UsageError, ConfigError, DataError, ValueError) as e:
        raise ReplaySkipped(f"the data cannot be rebuilt: {first_line(e)}") from None


def hf_input(
    found: Any,
    *,
    precision: str,
    device: torch.device,
    batches: int,
    data_file: Path | None,
    scaler: ScalerState | None,
) -> ReplayInput:
    """A Hugging Face checkpoint's replay: the model from ``config.json`` (Auto classes,
    ``trust_remote_code=False``, local only) with the checkpoint's weights; synthetic token
    batches within the vocabulary, or ``data_file`` through the saved tokenizer."""
    from .readers.hf import auto_class_for

    try:
        from transformers import AutoConfig
    except ImportError:
        raise ReplaySkipped(
            "rebuilding a Hugging Face model needs transformers: pip install transformers"
        ) from None
    from ampctl.trust import FileRefused, read_bounded

    try:
        read_bounded(found.model_dir / "config.json")  # under the size cap before transformers
        config = AutoConfig.from_pretrained(
            str(found.model_dir), trust_remote_code=False, local_files_only=True
        )
        cls = auto_class_for(config)
    except FileRefused as e:
        raise ReplaySkipped(str(e)) from None
    except Exception as e:  # noqa: BLE001 - remote code refused, unknown model type ...
        raise ReplaySkipped(
            f"the model cannot be rebuilt from config.json without running code from the "
            f"folder (trust_remote_code=False): {first_line(e)}"
        ) from None
    # weights the folder lacks are checked after loading (tied ones may be absent); the size
    # of every tensor config.json asks for is checked here
    _checked_model(
        lambda: cls.from_config(config, trust_remote_code=False),
        found.weights,  # by shape: nothing is read
        f"the checkpoint {found.path} (config.json)",
        config=config,
        extra=activation_bytes(config, _BATCH, _SEQ),
        may_lack=lambda _k: True,
        device=device,
    )
    try:
        with torch.random.fork_rng(devices=[]):
            model = cls.from_config(config, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - remote code refused, unknown model type ...
        raise ReplaySkipped(
            f"the model cannot be rebuilt from config.json without running code from the "
            f"folder (trust_remote_code=False): {first_line(e)}"
        ) from None
    missing, unexpected = model.load_state_dict(found.weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not _is_tied(model, k)]
    if missing:
        raise ReplaySkipped(
            f"the checkpoint's weights do not fit {type(model).__name__}: {len(missing)} "
            f"missing, first {missing[0]}"
        )
    model.float().to(device).train()
    batch_list, label = _hf_batches(config, found.model_dir, batches, device, data_file)
    return ReplayInput(
        model=model,
        batches=batch_list,
        positions=list(range(len(batch_list))),
        precision=precision,
        device=device,
        scale=replay_scale(scaler, precision, 2.0**16),
        data=label,
    )


def _is_tied(model: nn.Module, key: str) -> bool:
    """A parameter that shares storage with another one (tied embeddings)."""
    try:
        p = model.get_parameter(key)
    except AttributeError:
        return False
    return sum(1 for q in model.parameters(remove_duplicate=False) if q is p) > 1


_BATCH, _SEQ = 2, 32


def _hf_batches(
    config: Any, model_dir: Path, n: int, device: torch.device, data_file: Path | None
) -> tuple[list[dict[str, torch.Tensor]], str]:
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ReplaySkipped("config.json has no vocab_size: cannot make token batches")
    seq = min(_SEQ, int(getattr(config, "max_position_embeddings", _SEQ) or _SEQ))
    arch = (getattr(config, "architectures", None) or [""])[0]
    if data_file is not None:
        tokens = _tokenize(model_dir, data_file, n * _BATCH * seq)
        label = f"{data_file} (tokenized by the tokenizer in {model_dir})"
        if int(tokens.max()) >= vocab:
            raise ReplaySkipped(
                f"--data {data_file}: the tokenizer gives ids up to {int(tokens.max())}, beyond "
                f"the model's vocab_size {vocab}"
            )
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (n * _BATCH * seq,), generator=g)
        label = f"synthetic token batches (uniform ids in [0, {vocab}), seed 0): not the run's data"
    out = []
    for i in range(n):
        ids = tokens[i * _BATCH * seq : (i + 1) * _BATCH * seq].reshape(_BATCH, seq)
        b = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if arch.endswith(("ForSequenceClassification", "ForMultipleChoice")):
            labels = int(getattr(config, "num_labels", 2) or 2)
            b["labels"] = torch.arange(_BATCH) % labels
        elif arch.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForPreTraining")) or (
            getattr(config, "is_encoder_decoder", False)
            and arch.endswith("ForConditionalGeneration")
        ):  # a seq2seq LM (T5, BART) makes its decoder inputs from the labels
            b["labels"] = ids.clone()
        else:
            raise ReplaySkipped(
                f"no loss for architecture {arch or '(none in config.json)'}: replay needs a "
                "causal-LM, seq2seq-LM, masked-LM or sequence-classification head"
            )
        out.append({k: v.to(device) for k, v in b.items()})
    return out, label


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def _tokenize(model_dir: Path, data_file: Path, need: int) -> torch.Tensor:
    from ampctl.trust import MAX_WHOLE_FILE, FileRefused, checked_file, read_bounded

    for name in _TOKENIZER_FILES:  # each under the whole-file cap before transformers reads it
        f = model_dir / name
        if f.exists() or f.is_symlink():
            try:
                if checked_file(f).st_size > MAX_WHOLE_FILE:
                    read_bounded(f)  # refuses naming the cap; reads nothing
            except FileRefused as e:
                raise ReplaySkipped(
                    f"--data needs the tokenizer saved beside the checkpoint: {e}"
                ) from None
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        raise ReplaySkipped(
            "--data needs the tokenizer saved beside the checkpoint (none of "
            f"{', '.join(_TOKENIZER_FILES)} in {model_dir})"
        )
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=False, local_files_only=True
        )
    except Exception as e:  # noqa: BLE001 - no tokenizer saved with the checkpoint
        raise ReplaySkipped(
            f"--data needs the tokenizer saved beside the checkpoint: {first_line(e)}"
        ) from None
    text = Path(data_file).read_text(errors="replace")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < need:
        if not ids:
            raise ReplaySkipped(f"--data {data_file}: no tokens")
        ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids[:need], dtype=torch.long)

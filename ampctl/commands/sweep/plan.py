"""Planning a sweep: overrides -> trials (validated configs), baselines, and the halving rungs.

Nothing here writes a file or starts a process: a plan that raises never leaves a trace.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ampctl.compose import expand_sweeps
from ampctl.config import ConfigError, RunConfig, load_config, split_overrides
from ampctl.errors import first_line

__all__ = [
    "DEFAULT_GRID",
    "SCALE_KEYS",
    "Trial",
    "SweepPlan",
    "bare",
    "parse_sweep",
    "plan_sweep",
    "rung_budgets",
]

DEFAULT_GRID = ["scaler.init_scale=1024,8192,65536", "scaler.growth_interval=100,500,2000"]
SCALE_KEYS = ("scaler.init_scale", "scaler.growth_interval")
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*\Z")


@dataclass
class Trial:
    """One training run of the sweep."""

    name: str  # folder name under the sweep folder
    kind: str  # "trial" (fp16, swept scaling) or "baseline"
    swept: dict[str, str]  # swept override key -> value (as the override parser prints it)
    overrides: list[str]  # what ``ampctl train`` gets (trainer.runs_dir is added at launch)
    cfg: RunConfig
    group: str = ""  # the baseline this trial is compared with ("" when none)


@dataclass
class SweepPlan:
    name: str
    sweep_dir: Path
    trials: list[Trial]  # baselines first: their loss is the reference of the others
    swept_keys: list[str]
    fixed: list[str]  # the user's overrides that are not sweeps (conf=NAME included)
    steps: int | None  # --steps (None: the config's trainer.max_steps)
    baseline: str | None  # the baseline precision, None with --no-baseline
    config_dir: Path | None
    halving: int | None = None  # --halving ETA
    budgets: list[int] = field(default_factory=list)  # steps at the end of each rung

    def __post_init__(self) -> None:
        if not self.budgets and self.trials:
            self.budgets = [self.trials[0].cfg.trainer.max_steps]

    @property
    def total_steps(self) -> int:
        return self.budgets[-1]

    @property
    def top_rung(self) -> int:
        return len(self.budgets) - 1

    @property
    def extra_keys(self) -> list[str]:
        """Swept keys shown as their own column (init_scale and growth_interval always are)."""
        return [k for k in self.swept_keys if bare(k) not in SCALE_KEYS]

    def trial(self, name: str) -> Trial:
        return next(t for t in self.trials if t.name == name)


def bare(key: str) -> str:
    """``+a.b`` / ``~a.b`` / ``a.b@pkg`` -> ``a.b``."""
    return key.lstrip("+~").split("@")[0]


def _key_of(token: str) -> str:
    return bare(token.split("=", 1)[0])


def parse_sweep(tokens: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Split override tokens into fixed ones and sweeps ``[(key, [value, ...]), ...]``.

    Sweeps are expanded by :func:`ampctl.compose.expand_sweeps` (Hydra's own override parser).
    ``conf=NAME`` stays in the fixed list. With no sweep at all the default grid
    (:data:`DEFAULT_GRID`) is used for the scaling keys the user did not fix. Raises
    :class:`ConfigError` for unparsable tokens and unsupported sweeps."""
    _preset, rest = split_overrides(tokens)
    fixed = [t for t in tokens if t.startswith("conf=")][-1:]
    sweeps: list[tuple[str, list[str]]] = []
    for key, values in expand_sweeps(rest):
        if values is None:
            fixed.append(key)
            continue
        if any(bare(k) == bare(key) for k, _ in sweeps):
            raise ConfigError(f"{bare(key)} is swept twice; give one sweep per key")
        sweeps.append((key, values))
    if not sweeps:
        fixed_keys = {_key_of(t) for t in fixed}
        default = [t for t in DEFAULT_GRID if t.split("=", 1)[0] not in fixed_keys]
        if default:
            sweeps = parse_sweep(default)[1]
    # a swept key replaces the user's fixed value of it (e.g. a preset list with init_scale=1024)
    swept = {bare(k) for k, _ in sweeps}
    fixed = [t for t in fixed if t.startswith("conf=") or _key_of(t) not in swept]
    return fixed, sweeps


def _value_text(v: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", v.strip("'\""))


def _trial_names(keys: list[str], combos: list[tuple[str, ...]]) -> list[str]:
    leaves = [bare(k).split(".")[-1] for k in keys]
    if len(set(leaves)) != len(leaves):
        leaves = [bare(k) for k in keys]
    names: list[str] = []
    for combo in combos:
        name = ",".join(f"{leaf}={_value_text(v)}" for leaf, v in zip(leaves, combo, strict=True))
        name = name or "trial"
        if len(name) > 180:
            name = name[:160] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
        base, i = name, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.append(name)
    return names


def _baseline_precision(cfg: RunConfig) -> str:
    """fp32, or bf16 on a CUDA device that supports it (much faster there, fp32's range)."""
    from ampctl.amp.precision import bf16_supported
    from ampctl.train.builders import resolve_device

    dev = resolve_device(cfg.trainer.device)
    return "bf16" if dev.type == "cuda" and bf16_supported(dev) else "fp32"


def _is_group_key(key: str) -> bool:
    """Keys that do not split the baselines: scaling and precision (the baseline has neither)."""
    k = bare(key)
    return any(k == g or k.startswith(g + ".") for g in ("scaler", "precision"))


def _load(overrides: list[str], config_dir: Path | None, trial: str) -> RunConfig:
    try:
        return load_config(overrides, config_dir)
    except ConfigError as e:
        raise ConfigError(f"{first_line(e)} (sweep trial {trial})") from None


def rung_budgets(steps: int, n_trials: int, eta: int | None, log_every: int = 1) -> list[int]:
    """Steps at the end of each rung of successive halving: ``steps / eta^k`` for
    ``k = K..0`` with ``K = floor(log_eta(n_trials))`` (so the last rung keeps about one trial),
    rounded down to a multiple of ``log_every`` where that is at least ``log_every`` (a logged
    row then ends every rung). Without ``eta``: one rung of ``steps``.

    >>> rung_budgets(300, 9, 3, log_every=10)
    [30, 100, 300]
    """
    if eta is None:
        return [steps]
    rungs = 0
    while eta ** (rungs + 1) <= n_trials:
        rungs += 1
    out: list[int] = []
    for k in range(rungs, 0, -1):
        b = max(1, steps // eta**k)
        if b >= log_every:
            b -= b % log_every
        if (not out or b > out[-1]) and b < steps:
            out.append(b)
    return out + [steps]


def _check_args(steps: int | None, name: str | None, halving: int | None) -> None:
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: give an integer >= 1")
    if halving is not None and halving < 2:
        raise ConfigError(
            f"--halving {halving}: give an integer >= 2 (the best 1/ETA of each rung continue)"
        )
    if name is not None and (not _NAME_OK.match(name) or name in (".", "..")):
        raise ConfigError(
            f"--name {name!r}: use letters, digits and . _ - = , + (no slashes or spaces)"
        )


def _plan_trials(
    fixed: list[str], sweeps: list[tuple[str, list[str]]], extra: list[str], cdir: Path | None
) -> list[Trial]:
    keys = [k for k, _ in sweeps]
    combos = list(itertools.product(*[vals for _, vals in sweeps]))
    trials: list[Trial] = []
    for tname, combo in zip(_trial_names(keys, combos), combos, strict=True):
        swept = dict(zip(keys, combo, strict=True))
        ovr = fixed + [f"{k}={v}" for k, v in swept.items()] + extra
        cfg = _load(ovr, cdir, tname)
        if cfg.precision.name not in ("fp16", "fp16-pure"):
            raise ConfigError(
                f"precision={cfg.precision.name} (sweep trial {tname}): loss scaling is only used by "
                "fp16 and fp16-pure; sweep with precision=fp16 or precision=fp16-pure"
            )
        trials.append(Trial(name=tname, kind="trial", swept=swept, overrides=ovr, cfg=cfg))
    return trials


def _plan_baselines(
    trials: list[Trial], keys: list[str], fixed: list[str], extra: list[str], cdir: Path | None
) -> list[Trial]:
    """One baseline per combination of the swept keys that are not scaling or precision (a
    trial is compared with the baseline of its own lr, model ...). Sets each trial's group."""
    bprec = _baseline_precision(trials[0].cfg)
    gkeys = [k for k in keys if not _is_group_key(k)]
    bfixed = [t for t in fixed if _key_of(t) not in ("precision", "precision.name")]
    gleaves = _trial_names(gkeys, [tuple("x" for _ in gkeys)])[0].split(",") if gkeys else []
    gleaves = [g.split("=", 1)[0] for g in gleaves]
    by_group: dict[tuple[str, ...], str] = {}
    baselines: list[Trial] = []
    for t in trials:
        gvals = tuple(t.swept[k] for k in gkeys)
        if gvals not in by_group:
            suffix = ",".join(
                f"{leaf}={_value_text(v)}" for leaf, v in zip(gleaves, gvals, strict=True)
            )
            bname = f"baseline-{bprec}" + (f",{suffix}" if suffix else "")
            swept = dict(zip(gkeys, gvals, strict=True))
            ovr = bfixed + [f"{k}={v}" for k, v in swept.items()] + [f"precision={bprec}"] + extra
            cfg = _load(ovr, cdir, bname)
            baselines.append(
                Trial(name=bname, kind="baseline", swept=swept, overrides=ovr, cfg=cfg)
            )
            by_group[gvals] = bname
        t.group = by_group[gvals]
    return baselines


def plan_sweep(
    overrides: list[str],
    *,
    steps: int | None = None,
    baseline: bool = True,
    name: str | None = None,
    config_dir: str | Path | None = None,
    halving: int | None = None,
) -> SweepPlan:
    """Expand ``overrides`` into trials and validate every trial's config (nothing is written).

    Raises :class:`ConfigError` (a UsageError) naming the override, key or trial at fault."""
    _check_args(steps, name, halving)
    cdir = Path(config_dir) if config_dir is not None else None
    fixed, sweeps = parse_sweep(list(overrides))
    keys = [k for k, _ in sweeps]
    if halving is not None and "trainer.max_steps" in {bare(k) for k in keys}:
        raise ConfigError(
            "trainer.max_steps is swept: with --halving every trial runs the rungs' steps; "
            "give the full length with --steps"
        )
    extra = [f"trainer.max_steps={steps}"] if steps is not None else []
    if not any(_key_of(t) == "logging.plot" for t in fixed):
        extra.append("logging.plot=false")  # one plot per sweep (`ampctl plot <sweep>`)
    trials = _plan_trials(fixed, sweeps, extra, cdir)
    baselines = _plan_baselines(trials, keys, fixed, extra, cdir) if baseline else []
    runs_dir = Path(trials[0].cfg.trainer.runs_dir).expanduser()
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"sweep-{stamp}"
        i = 1
        while (runs_dir / name).exists():
            name, i = f"sweep-{stamp}-{i}", i + 1
    cfg0 = trials[0].cfg.trainer
    return SweepPlan(
        name=name,
        sweep_dir=(runs_dir / name).resolve(),
        trials=baselines + trials,
        swept_keys=keys,
        fixed=fixed,
        steps=steps,
        baseline=baselines[0].cfg.precision.name if baselines else None,
        config_dir=cdir,
        halving=halving,
        budgets=rung_budgets(cfg0.max_steps, len(trials), halving, cfg0.log_every),
    )

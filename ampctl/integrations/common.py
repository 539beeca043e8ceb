"""What every integration shares: the error type, the run's options (:class:`RunOptions`), the
lr schedulers a rollback rewinds (:class:`SchedulerProgress`), the lazy import of a framework with
its install hint, the torch optimizer inside a framework's wrapper, and the rank helpers (skip
flags agreed across ranks, rank 0 writes)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler
from ampctl.amp.checks import FieldError, is_int
from ampctl.errors import UsageError
from ampctl.protect.settings import GuardConfig, LoggingConfig

__all__ = [
    "IntegrationError",
    "RunOptions",
    "SchedulerProgress",
    "check_counts",
    "inner_optimizer",
    "reduce_max",
    "require",
    "share_flags",
    "world_size",
    "is_rank0",
    "Ranks",
    "count_tokens",
    "param_device",
]


class IntegrationError(UsageError):
    """Bad use of an integration: the message names the argument and what is allowed."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The options every integration takes as keywords (``ProtectedRun``, ``AmpctlCallback``,
    ``protect_trainer``), declared and checked here once.

    Args:
        guard: a :class:`~ampctl.protect.settings.GuardConfig` or a mapping of its fields.
        log_every: write a metrics row every this many optimizer steps (and at ``max_steps``);
            None: the loop's default (``ProtectedRun``: 10; Lightning: ``log_every_n_steps``;
            the HF Trainer: ``logging_steps``).
        display: None, a :class:`~ampctl.ui.display.Display` mode (``auto``, ``live``,
            ``plain``, ``quiet``) for the live table, or an object with ``update`` / ``event``
            / ``summary``.
        fp32_modules: fnmatch patterns of module names kept in fp32 from the start.
        overflow_window: the steps a row's ``overflow_rate`` covers.
        tensorboard: also write TensorBoard scalars into the run folder (needs
            ``tensorboard``).
        logging: a :class:`~ampctl.protect.settings.LoggingConfig` or a mapping of its fields:
            the sinks beside the run folder (``tensorboard``, ``mlflow``, ``wandb`` and their
            ``mlflow_uri``, ``wandb_mode`` ...; see ``ampctl train``'s ``logging.*``), and
            ``plot`` (default true: ``plot.png`` at the end of the run, when matplotlib is
            installed, also sent to the sinks). None: only ``tensorboard=``, no plot.
    """

    guard: GuardConfig | Mapping[str, Any] | None = None
    log_every: int | None = None
    display: Any = None
    fp32_modules: Iterable[str] = ()
    overflow_window: int = 50
    tensorboard: bool = False
    logging: LoggingConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_counts(log_every=self.log_every, overflow_window=self.overflow_window)
        guard = (
            GuardConfig() if self.guard is None else _fields_arg(GuardConfig, self.guard, "guard")
        )
        logging = self.logging
        if logging is not None:
            logging = _fields_arg(LoggingConfig, logging, "logging")
        object.__setattr__(self, "guard", guard)
        object.__setattr__(self, "logging", logging)
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))

    @classmethod
    def given(cls, who: str, fields: Mapping[str, Any]) -> RunOptions:
        """The options ``who`` was given as keywords, checked; an unknown one is a
        ``TypeError``, as Python's own."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}")
        try:
            return cls(**fields)
        except _KeyNamed:
            raise  # its message names the key (``guard.skip_budget=...``)
        except IntegrationError as e:
            raise IntegrationError(f"{who}: {e}") from None

    def keywords(self, **changes: Any) -> dict[str, Any]:
        """These options as keywords (for ``ProtectedRun(...)``), with ``changes``."""
        return {**vars(self), **changes}


def check_counts(who: str = "", **counts: int | None) -> None:
    """A run's cadence arguments (``log_every``, ``overflow_window``, ``max_steps``): None or an
    integer >= 1 (``overflow_window``: an integer >= 1); one line naming ``who`` and the
    argument."""
    for name, value in counts.items():
        ok = (value is None and name != "overflow_window") or (is_int(value) and value >= 1)
        if not ok:
            allowed = "an integer >= 1" if name == "overflow_window" else "None or an integer >= 1"
            raise IntegrationError(
                f"{who}{': ' if who else ''}{name}={value!r} is not allowed: {name} must be "
                f"{allowed}"
            )


def _fields_arg(cls: type, value: Any, arg: str) -> Any:
    """``value`` as a ``cls`` config (``GuardConfig``, ``LoggingConfig``): one already, or a
    mapping of its fields; anything else is an :class:`IntegrationError` naming ``arg``."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise IntegrationError(
            f"{arg}={value!r} is not allowed: {arg} must be a {cls.__name__} or a mapping of its "
            "fields"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise IntegrationError(
            f"{arg} has unknown fields {unknown}; allowed: {', '.join(sorted(names))}"
        )
    try:
        return cls(**value)
    except FieldError as e:
        raise _KeyNamed(e.named(arg)) from None


class _KeyNamed(IntegrationError):
    """A config field refused, its message naming the key (``logging.wandb_mode=...``)."""


class SchedulerProgress:
    """What a rollback rewinds besides weights, optimizer state and scale: the loop's lr
    schedulers, as ``schedulers()`` lists them when the snapshot is taken and restored (a
    framework may make them after the run starts)."""

    def __init__(self, schedulers: Callable[[], Iterable[Any]]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s, sd in zip(self.schedulers(), state["schedulers"], strict=False):
            s.load_state_dict(copy.deepcopy(sd))


def require(module: str, extra: str, user: str) -> Any:
    """Import ``module`` for ``user`` (an ampctl module), or raise ImportError with the one-line
    install hint ``pip install "ampctl[extra]"`` when its package is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise ModuleNotFoundError(
            f"{user} needs the {top!r} package, which is not installed: "
            f'pip install "ampctl[{extra}]"',
            name=e.name,
        ) from None


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the object a scaler unscales and steps."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def reduce_max(flags: torch.Tensor) -> torch.Tensor:
    """All-reduce MAX of a scaler's overflow flags over the ranks (a collective, no host read):
    the ``LossScaler.reduce_flags`` that makes every rank skip the same steps."""
    out = flags.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out


def share_flags(scaler: LossScaler) -> None:
    """Under ``torch.distributed`` with several ranks, make ``scaler``'s skip decisions agree
    across ranks (a forward overflow is seen by one rank only) unless a hook is set already."""
    if world_size() > 1 and scaler.reduce_flags is None:
        scaler.reduce_flags = reduce_max


class Ranks:
    """What Protection needs of the process group: the ranks agree on the module a
    forward-overflow replay located."""

    enabled = True

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * world_size()
        torch.distributed.all_gather_object(out, obj)
        return out


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of its ``input_ids`` (0 when it has none)."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


def param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

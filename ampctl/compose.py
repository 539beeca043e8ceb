"""The one place ampctl talks to Hydra: parse override tokens, compose a preset.

Hydra's public ``compose`` API cannot search the user's ``--config-dir`` *before* the packaged
``conf/`` for the primary config (``hydra.searchpath`` entries are not searched for it), so the
composition is done with Hydra's ``Hydra.create_main_hydra2`` behind this wall; nothing else in
ampctl imports Hydra.

Errors are :class:`~ampctl.errors.UsageError` lines that name the override token at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampctl.errors import ConfigError, first_line

__all__ = [
    "OverrideError",
    "available_presets",
    "group_names",
    "group_options",
    "packaged_conf_dir",
    "parse_overrides",
    "expand_sweeps",
    "compose_preset",
    "DEFAULTS",
    "OVERRIDE_FORMS",
    "SWEEP_FORMS",
]

OVERRIDE_FORMS = "use key=value, +key=value or ~key (a list as key=[a,b])"
SWEEP_FORMS = "use key=value, key=a,b,c or key=range(start,stop,step)"


def packaged_conf_dir() -> Path:
    """The ``conf/`` folder shipped with ampctl (repository root in an editable install)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError(
        f"ampctl's packaged configs were not found next to {here}; reinstall with `pip install -e .`"
    )


def available_presets(config_dir: str | Path | None = None) -> list[str]:
    """The preset names (``conf=NAME``): the YAML files of the packaged ``conf/`` and of
    ``config_dir``."""
    dirs = [packaged_conf_dir()] + ([Path(config_dir)] if config_dir else [])
    names = {p.stem for d in dirs for p in Path(d).glob("*.yaml")}
    return sorted(names)


def group_names() -> list[str]:
    """The config groups that ship in conf/ (a folder of options each: ``model=NAME`` ...)."""
    return sorted(p.name for p in packaged_conf_dir().iterdir() if p.is_dir())


def group_options(group: str, config_dir: str | Path | None) -> list[str]:
    dirs = [packaged_conf_dir()] + ([Path(config_dir)] if config_dir else [])
    return sorted({p.stem for d in dirs for p in (Path(d) / group).glob("*.yaml")})


class OverrideError(ConfigError):
    """An override token that cannot be parsed or applied."""


def parse_overrides(tokens: list[str], *, forms: str = OVERRIDE_FORMS) -> list[Any]:
    """Hydra ``Override`` objects for ``tokens``; a token that does not parse is named."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out = []
    for tok in tokens:
        try:
            out.extend(parser.parse_overrides([tok]))
        except OverrideParseException as e:
            raise OverrideError(
                f"cannot parse override {tok!r}: {first_line(e)}; {forms}"
            ) from None
        if not out[-1].key_or_group:
            raise OverrideError(f"cannot parse override {tok!r}: no key before '='; {forms}")
    return out


def expand_sweeps(
    tokens: list[str], *, forms: str = SWEEP_FORMS
) -> list[tuple[str, list[str] | None]]:
    """One ``(token, None)`` per plain override and one ``(key, [value, ...])`` per sweep
    (``key=a,b,c``, ``key=range(0,10,2)``), expanded as Hydra's BasicSweeper does. A token that
    does not parse, a sweep kind that cannot be listed (``interval``, ``glob``) and an empty sweep
    are named in an :class:`OverrideError`."""
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    out: list[tuple[str, list[str] | None]] = []
    for tok, o in zip(tokens, parse_overrides(tokens, forms=forms), strict=True):
        if not o.is_sweep_override():
            out.append((tok, None))
            continue
        if not o.is_discrete_sweep() or o.value_type is ValueType.GLOB_CHOICE_SWEEP:
            raise OverrideError(
                f"{tok}: this kind of sweep is not supported; list the values (key=a,b,c) "
                "or use range(start,stop,step)"
            )
        try:
            values = list(o.sweep_string_iterator())
        except HydraException as e:
            raise OverrideError(f"{tok}: {first_line(e)}") from None
        if not values:
            raise OverrideError(f"{tok}: the sweep has no values; give at least one")
        out.append((o.get_key_element(), values))
    return out


#: The config of every key at its default, in Hydra's ConfigStore (``conf/config.yaml`` lists it
#: first in its defaults list, so that the YAML files hold only what they change).
DEFAULTS = "ampctl_defaults"


def compose_preset(
    preset: str, overrides: list[str], search_dirs: list[Path], defaults: dict[str, Any]
) -> Any:
    """Compose ``preset`` with ``overrides`` over ``search_dirs`` (first wins), ``defaults``
    stored as the config :data:`DEFAULTS`. Returns the DictConfig (without its ``hydra`` node).
    Hydra's own exceptions propagate for the caller to word: see :func:`hydra_errors`."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import open_dict

    parse_overrides(overrides)  # name a malformed token before Hydra words it without one
    ConfigStore.instance().store(name=DEFAULTS, node=defaults, provider="ampctl")
    search = create_config_search_path(None)
    for i, d in enumerate(reversed(search_dirs)):
        search.prepend(f"ampctl-{i}", f"file://{Path(d).expanduser().resolve()}")
    gh = GlobalHydra.instance()
    gh.clear()
    try:
        hydra = Hydra.create_main_hydra2(task_name="ampctl", config_search_path=search)
        cfg = hydra.compose_config(
            preset, overrides, run_mode=RunMode.RUN, with_log_configuration=False
        )
    finally:
        gh.clear()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def hydra_errors() -> dict[str, type[BaseException]]:
    """Hydra's exception types, by name, for callers that word them."""
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )

    return {
        "parse": OverrideParseException,
        "missing": MissingConfigException,
        "composition": ConfigCompositionException,
        "hydra": HydraException,
    }

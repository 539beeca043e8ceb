"""``ampctl train``: load config -> build -> run -> close.

Resuming (``--resume RUN_DIR|CKPT``) continues a run in its own folder; from an earlier
checkpoint the later history is set aside in ``branches/`` first (see
:mod:`ampctl.runlog.branches`). ``--resume CKPT --name NEW`` forks the checkpoint into a new run
folder instead, leaving the original untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ampctl.config import ConfigError, config_from_saved, load_config, split_overrides, to_yaml
from ampctl.runlog import RunLayout, fork_event, fork_into

__all__ = ["run_train", "resume_config"]


def resume_config(ckpt: dict, overrides: list[str], trust_code: bool = False):
    """The checkpoint's config with plain ``key=value`` overrides applied on top (the saved
    config is data: see :func:`ampctl.config.config_from_saved`); its model's dimensions are
    checked against the checkpoint's tensors before anything is built
    (:func:`ampctl.trust.check_model_fits`)."""
    from ampctl.train.builders import build_model
    from ampctl.trust import check_model_fits

    source = f"checkpoint {ckpt.get('path')}"
    cfg = config_from_saved(ckpt["config"], overrides, source=source, trust_code=trust_code)
    state = ckpt.get("model") if isinstance(ckpt.get("model"), dict) else {}
    check_model_fits(lambda: build_model(cfg.model), state, source=source, flag=None)
    return cfg


def _as_given(path: Path, given: Path) -> Path:
    """``path`` (resolved) in the form the user gave ``--resume``: relative to the working
    folder when that was relative and ``path`` lies under it, as a fresh run's folder is."""
    if given.is_absolute():
        return path
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def _resume_target(
    ck: dict[str, Any], name: str | None, given: Path, runs_dir: str | Path
) -> RunLayout | None:
    """The run folder a resume continues in (None: a fork into a new folder ``--name``)."""
    path = Path(ck["path"]).resolve()
    run = RunLayout.of_checkpoint(path)
    if name is not None:
        if run is not None and (Path(runs_dir) / name).resolve() == run.root:
            here = _as_given(run.root, given)
            raise ConfigError(
                f"--resume {given} --name {name}: --name starts a new run folder (a fork of the "
                f"checkpoint) and {here} is the run being resumed; to continue it, drop --name: "
                f"ampctl train --resume {given}"
            )
        return None
    if run is None:
        raise ConfigError(
            f"--resume {ck['path']}: the checkpoint is not inside a run folder "
            "(<run>/checkpoints/step_*.pt); add --name NEW to start a run folder from it"
        )
    if run.root.parent.name == RunLayout.BRANCHES:
        raise ConfigError(
            f"--resume {ck['path']}: the checkpoint belongs to the archived branch "
            f"{run.root.name} of {run.root.parent.parent}; continue it in a new run folder with "
            f"--resume {ck['path']} --name NEW"
        )
    return RunLayout(_as_given(run.root, given))


def run_train(
    *,
    overrides: list[str],
    config_dir: Path | None = None,
    name: str | None = None,
    resume: Path | None = None,
    trust_code: bool = False,
    print_config: bool = False,
    mode: str = "auto",
    console: Console | None = None,
) -> int:
    from ampctl.protect.records import write_config
    from ampctl.runlog.writers import new_run_dir
    from ampctl.train.checkpoint import load_checkpoint
    from ampctl.train.dist import init_distributed
    from ampctl.train.trainer import Trainer
    from ampctl.ui.display import Display

    console = console or Console()
    ck = None
    if resume is not None:
        ck = load_checkpoint(resume)
        preset, rest = split_overrides(overrides)
        if preset != "config":
            raise ConfigError(
                "conf= cannot be combined with --resume: the run keeps the config it was started with"
            )
        cfg = resume_config(ck, rest, trust_code)
    else:
        cfg = load_config(overrides, config_dir)
        preset, _ = split_overrides(overrides)
    if print_config:
        console.print(to_yaml(cfg), end="", markup=False, highlight=False)
        return 0
    ctx = init_distributed(cfg.dist.strategy, cfg.trainer.device)
    target = (
        _resume_target(ck, name, Path(resume), cfg.trainer.runs_dir) if ck is not None else None
    )
    fork = ck is not None and target is None
    run_dir = target.root if target is not None else None
    if run_dir is None and ctx.is_main:
        run_dir = new_run_dir(cfg.trainer.runs_dir, name or cfg.name, preset)
    run_dir = ctx.broadcast_object(run_dir)
    display = Display(
        cfg.trainer.max_steps,
        mode=mode if ctx.is_main else "quiet",
        console=console,
        title=f"ampctl train - {run_dir.name}",
    )
    parent = None
    try:
        if fork and ctx.is_main:
            parent = fork_into(RunLayout(run_dir), Path(ck["path"]), ck["step"])
        trainer = Trainer(
            cfg, run_dir, display=display if ctx.is_main else None, resume=ck, dist_ctx=ctx
        )
    except BaseException:
        if ctx.is_main and (ck is None or fork):
            _remove_new_run(run_dir)  # nothing was trained: leave no half-made run behind
        raise
    if fork:
        trainer.log.event(fork_event(parent, Path(ck["path"]), ck["step"]))
    if not ctx.is_main:
        return trainer.run().exit_code
    write_config(run_dir, cfg.to_dict())
    trainer.hint_overrides = list(overrides) if ck is None else None
    with display:
        result = trainer.run(close_log=False)  # the sinks stay open for the plot
    try:
        _report(console, display, trainer, result, cfg, run_dir)
    finally:
        trainer.log.close(result.status)
    return result.exit_code


def _remove_new_run(run_dir: Path) -> None:
    lay = RunLayout(run_dir)
    for p in (lay.parent, lay.metrics, lay.events):
        p.unlink(missing_ok=True)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _report(console, display, trainer, result, cfg, run_dir: Path) -> None:
    summary = dict(result.summary)  # its resume_hint is the one hint (Trainer._summary)
    hint, note = summary.get("resume_hint"), summary.get("resume_note")
    display.summary(summary)
    if cfg.logging.plot:
        from ampctl.commands.plot import maybe_plot_run

        got = maybe_plot_run(run_dir)
        if isinstance(got, Path):
            trainer.log.artifact(got)
        msg = f"plot: {got}" if isinstance(got, Path) else got
        console.print(msg, markup=False, highlight=False, soft_wrap=True)
    then = (f"; {note}" if note else "") + (f": {hint}" if hint else "")
    if result.status == "diverged":
        console.print(
            "[red]Training stopped: the loss diverged[/red] (see the divergence event in "
            f"events.jsonl){escape(then)}",
            highlight=False,
            soft_wrap=True,
        )
    elif result.status == "aborted":
        console.print(
            f"[red]Training aborted by the overflow guard[/red] (see events.jsonl){escape(then)}",
            highlight=False,
            soft_wrap=True,
        )
    elif result.status == "failed":  # the failure as written: install hints hold "[extra]"
        console.print(
            f"[red]Training stopped:[/red] {escape(str(trainer.failure))}",
            highlight=False,
            soft_wrap=True,
        )
    elif result.status == "interrupted":
        console.print(
            f"Interrupted. Resume with: {hint}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )

"""What each command does, one screen each: load config -> build -> run -> close.

The CLI calls these; they raise the input errors that the CLI turns into exit code 2.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from ampctl.config import ConfigError, config_from_saved, load_config, split_overrides, to_yaml

__all__ = ["run_train", "resume_config"]


def resume_config(ckpt: dict, overrides: list[str], trust_code: bool = False):
    """The checkpoint's config with plain ``key=value`` overrides applied on top (the saved
    config is data: see :func:`ampctl.config.config_from_saved`)."""
    return config_from_saved(
        ckpt["config"], overrides, source=f"checkpoint {ckpt.get('path')}", trust_code=trust_code
    )


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
    from ampctl.monitor.display import Display
    from ampctl.train.checkpoint import load_checkpoint
    from ampctl.train.dist import init_distributed
    from ampctl.train.loop import Trainer
    from ampctl.train.run import new_run_dir

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
    if ck is not None and name is not None:
        raise ConfigError(
            "--name cannot be combined with --resume: the run continues in its own folder"
        )
    ctx = init_distributed(cfg.dist.strategy, cfg.trainer.device)
    if ck is not None:
        run_dir = Path(ck["path"]).resolve().parent.parent
    elif ctx.is_main:
        run_dir = new_run_dir(cfg.trainer.runs_dir, name or cfg.name, preset)
    run_dir = ctx.broadcast_object(run_dir if ctx.is_main or ck is not None else None)
    display = Display(
        cfg.trainer.max_steps,
        mode=mode if ctx.is_main else "quiet",
        console=console,
        title=f"ampctl train - {run_dir.name}",
    )
    try:
        trainer = Trainer(
            cfg, run_dir, display=display if ctx.is_main else None, resume=ck, dist_ctx=ctx
        )
    except BaseException:
        if ctx.is_main and ck is None and not any(run_dir.iterdir()):
            run_dir.rmdir()  # nothing was written: leave no empty run behind
        raise
    if not ctx.is_main:
        return trainer.run().exit_code
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with display:
        result = trainer.run()
    summary = dict(result.summary)
    if result.status != "ok":
        summary["resume_hint"] = f"ampctl train --resume {run_dir}"
    display.summary(summary)
    if cfg.logging.plot:
        from ampctl.plot import maybe_plot_run

        got = maybe_plot_run(run_dir)
        msg = f"plot: {got}" if isinstance(got, Path) else got
        console.print(msg, markup=False, highlight=False, soft_wrap=True)
    if result.status == "aborted":
        console.print(
            "[red]Training aborted by the overflow guard.[/red] See events.jsonl; try "
            "`ampctl diagnose "
            + str(run_dir)
            + "`, precision=bf16, a lower optim.lr, or scaler.init_scale lower.",
            highlight=False,
            soft_wrap=True,
        )
    elif result.status == "failed":
        console.print(
            f"[red]Training stopped:[/red] {trainer.failure}", highlight=False, soft_wrap=True
        )
    elif result.status == "interrupted":
        console.print(
            f"Interrupted. Resume with: ampctl train --resume {run_dir}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return result.exit_code

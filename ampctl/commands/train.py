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
from ampctl.runlog.lock import LOCK_NAME, RunLock, lock_run

__all__ = ["run_train", "resume_config", "write_failure"]


def write_failure(e: OSError) -> str:
    """One line for a write that failed (a full disk, a file size limit, a read-only folder):
    the file and the cause, e.g. ``could not write runs/x/metrics.jsonl: No space left on
    device``."""
    cause = e.strerror or str(e) or type(e).__name__
    name = getattr(e, "filename", None)
    if name:
        return f"could not write {name}: {cause}"
    return f"a write failed: {cause}"


def resume_config(ckpt: dict, overrides: list[str], trust_code: bool = False, *, fork: bool = True):
    """The checkpoint's config with plain ``key=value`` overrides applied on top (the saved
    config is data: see :func:`ampctl.config.config_from_saved`); its model's dimensions are
    checked against the checkpoint's tensors before anything is built
    (:func:`ampctl.trust.check_model_fits`), and a place it names outside the run folder and the
    working directory is used only when ``overrides`` repeat it
    (:func:`ampctl.trust_paths.check_saved_paths`; ``fork``: a new run folder is made under
    ``trainer.runs_dir``, so it is checked too)."""
    from ampctl.train.builders import build_model
    from ampctl.trust import check_model_fits
    from ampctl.trust_counts import check_counts
    from ampctl.trust_paths import check_saved_paths

    source = f"checkpoint {ckpt.get('path')}"
    path = Path(str(ckpt.get("path", "."))).resolve()
    run = RunLayout.of_checkpoint(path)
    check_saved_paths(
        ckpt.get("config"),
        overrides,
        run_root=run.root if run is not None else path.parent,
        source=source,
        unused=() if fork else ("trainer.runs_dir",),
    )
    cfg = config_from_saved(ckpt["config"], overrides, source=source, trust_code=trust_code)
    state = ckpt.get("model") if isinstance(ckpt.get("model"), dict) else {}
    check_counts(cfg.model, len(state), source=source)  # before a build of a million layers
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
    from ampctl.runlog.writers import check_run_writable, new_run_dir
    from ampctl.train.checkpoint import load_resumable, resume_line
    from ampctl.train.dist import init_distributed

    console = console or Console()
    ck = None
    if resume is not None:
        ck, passed = load_resumable(resume)
        if passed:
            console.print(resume_line(ck, passed), markup=False, highlight=False, soft_wrap=True)
        preset, rest = split_overrides(overrides)
        if preset != "config":
            raise ConfigError(
                "conf= cannot be combined with --resume: the run keeps the config it was started with"
            )
        cfg = resume_config(ck, rest, trust_code, fork=name is not None)
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
    if target is not None:
        check_run_writable(target)  # no log or checkpoints folder planted as a link
    fork = ck is not None and target is None
    run_dir = target.root if target is not None else None
    if run_dir is None and ctx.is_main:
        run_dir = new_run_dir(cfg.trainer.runs_dir, name or cfg.name, preset)
    run_dir = ctx.broadcast_object(run_dir)
    lock = _own(run_dir, console) if ctx.is_main else None
    try:
        return _train_in(cfg, run_dir, ck, fork, ctx, mode, console, lock, overrides)
    finally:
        if lock is not None:
            lock.release()


def _own(run_dir: Path, console: Console) -> RunLock:
    """The run folder's lock (:mod:`ampctl.runlog.lock`): a second process on the same folder
    (a resume while the run is live, two resumes at once) is refused before it writes anything
    (and a refused process removes nothing: the folder is the other one's)."""
    lock = lock_run(run_dir, hint=f", then continue it with ampctl train --resume {run_dir}")
    if lock.took_over is not None:
        console.print(lock.message(), markup=False, highlight=False, soft_wrap=True)
    return lock


def _train_in(
    cfg, run_dir: Path, ck, fork: bool, ctx, mode: str, console, lock, overrides: list[str]
) -> int:
    from ampctl.protect.shell import write_config
    from ampctl.train.trainer import Trainer
    from ampctl.ui.display import Display

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
            if lock is not None:
                lock.release()
            _remove_new_run(run_dir)  # nothing was trained: leave no half-made run behind
        raise
    if fork:
        trainer.log.event(fork_event(parent, Path(ck["path"]), ck["step"]))
    if not ctx.is_main:
        return trainer.run().exit_code
    try:
        write_config(run_dir, cfg.to_dict())
    except OSError as e:
        trainer.log.close("failed")
        raise OSError(e.errno, e.strerror, str(RunLayout(run_dir).config)) from None
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
    for p in (lay.parent, lay.metrics, lay.events, lay.root / LOCK_NAME):
        p.unlink(missing_ok=True)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _report(console, display, trainer, result, cfg, run_dir: Path) -> None:
    summary = dict(result.summary)  # its resume_hint is the one hint (Trainer._summary)
    hint, note = summary.get("resume_hint"), summary.get("resume_note")
    display.summary(summary)
    if cfg.logging.plot:
        got = trainer.shell.plot()
        msg = f"plot: {got}" if isinstance(got, Path) else got
        console.print(msg, markup=False, highlight=False, soft_wrap=True)
    then, markup = (f"; {note}" if note else "") + (f": {hint}" if hint else ""), True
    if result.status == "diverged":
        line = "[red]Training stopped: the loss diverged[/red] (see the divergence event in "
        line += f"events.jsonl){escape(then)}"
    elif result.status == "aborted":
        line = f"[red]Training aborted by the overflow guard[/red] (see events.jsonl){escape(then)}"
    elif result.status == "failed" or summary.get("summary_error"):
        # the failure as written: install hints hold "[extra]"
        what = "Training stopped" if result.status == "failed" else "Run folder incomplete"
        line = f"[red]{what}:[/red] {escape(str(trainer.failure))}"
    elif result.status == "interrupted":
        line, markup = f"Interrupted. Resume with: {hint}", False
    else:
        return
    console.print(line, markup=markup, highlight=False, soft_wrap=True)

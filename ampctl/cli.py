"""ampctl's command line: parse, load config, call a task, map the outcome to an exit code.

Exit codes: 0 ok; 1 the run failed (guard abort, diagnosis found problems); 2 bad input
(one line on stderr, no traceback unless --debug); 130/143 interrupted (a checkpoint was
written; the message says how to resume).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="ampctl",
    help=(
        "Protected mixed-precision (fp16/bf16) training: dynamic loss scaling, fused overflow "
        "detection, skipped steps that leave weights untouched, rollback and precision fallback, "
        "and a live view of scale, overflow rate and gradient health."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

OVERRIDES_HELP = (
    "Hydra overrides: key=value, +new.key=value, ~key; conf=NAME picks a preset from conf/ "
    "(config, bert_base, bert_large); groups: model=, data=, optim=, precision=, scaler=, guard=."
)

_DEBUG = {"on": False}


def _fail(message: str, code: int = 2) -> None:
    if _DEBUG["on"]:
        traceback.print_exc()
    typer.echo(f"ampctl: error: {message}", err=True)
    raise typer.Exit(code)


def _input_errors() -> tuple[type[BaseException], ...]:
    from ampctl.config import ConfigError
    from ampctl.train.builders import BuildError
    from ampctl.train.checkpoint import CheckpointError
    from ampctl.train.data import DataError
    from ampctl.train.run import RunExistsError

    return (ConfigError, BuildError, CheckpointError, DataError, RunExistsError)


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False) -> None:
    _DEBUG["on"] = debug


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Annotated[list[str] | None, typer.Argument(help=OVERRIDES_HELP, show_default=False)] = None,
    config_dir: Annotated[
        Path | None, typer.Option("--config-dir", help="Your own configs and presets; searched before ampctl's conf/.")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Run folder name under trainer.runs_dir (default: <preset>-<time>).")] = None,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue a run: its folder (latest checkpoint) or a checkpoint file. Overrides may change e.g. trainer.max_steps."),
    ] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the composed, resolved config and exit.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final summary.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="One plain line per log interval, even on a terminal.")] = False,
) -> None:
    """Train under the protected mixed-precision loop.

    Writes runs/<name>/: config.yaml, metrics.jsonl, events.jsonl, checkpoints/, summary.json.
    Ctrl-C finishes the current step, writes a checkpoint and prints how to resume.
    """
    from ampctl.tasks import run_train

    try:
        code = run_train(
            overrides=list(overrides or []),
            config_dir=config_dir,
            name=name,
            resume=resume,
            print_config=print_config,
            mode="quiet" if quiet else ("plain" if plain else "auto"),
        )
    except _input_errors() as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise typer.Exit(code)


def main() -> None:
    """Entry point of ``python -m ampctl``."""
    app(prog_name="ampctl")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

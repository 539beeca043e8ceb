"""ampctl's command line: parse, load config, call a task, map the outcome to an exit code.

Exit codes: 0 ok; 1 the run failed (guard abort, diagnosis found problems, a write that failed:
a full disk); 2 bad input
(one line on stderr, no traceback unless --debug); 130/143 interrupted (a checkpoint was
written; the message says how to resume).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer

# torch warns at import when NumPy is missing; ampctl never uses NumPy (core installs lack it,
# and nothing it does needs it), so a first `ampctl train` must not greet the user with it
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

app = typer.Typer(
    name="ampctl",
    help=(
        "Protected mixed-precision (fp16/bf16/fp8) training: dynamic loss scaling, fused overflow "
        "detection, skipped steps that leave weights untouched, rollback and precision fallback, "
        "and a live view of scale, overflow rate and gradient health."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _overrides_help() -> str:
    """The overrides' help, with the presets and groups that ship in conf/ (read from disk, so
    the list stays true)."""
    from ampctl.compose import available_presets, group_names

    return (
        "Hydra overrides: key=value, +new.key=value, ~key; conf=NAME picks a preset from conf/ "
        f"({', '.join(available_presets())}); groups: "
        + ", ".join(f"{g}=" for g in group_names())
        + "."
    )


OVERRIDES_HELP = _overrides_help()
Overrides = Annotated[list[str] | None, typer.Argument(help=OVERRIDES_HELP, show_default=False)]
ConfigDir = Annotated[
    Path | None, typer.Option("--config-dir", help="Your own configs; searched first.")
]

_DEBUG = {"on": False}


def _fail(message: str, code: int = 2) -> None:
    if _DEBUG["on"]:
        traceback.print_exc()
    typer.echo(f"ampctl: error: {message}", err=True)
    raise typer.Exit(code)


def _input_errors() -> tuple[type[BaseException], ...]:
    from ampctl.errors import UsageError
    from ampctl.train.data import DataError

    return (UsageError, DataError)


@contextlib.contextmanager
def _bad_input(on_message: Callable[[str], None] | None = None) -> Iterator[None]:
    """Bad input raised in the block: its first line on stderr (``on_message`` told first), exit
    code 2. (The error classes are imported only when something is raised.)"""
    try:
        yield
    except _input_errors() as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if on_message is not None:
            on_message(message)
        _fail(message)


def _at_least(option: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        _fail(f"{option} {value}: must be an integer >= {minimum}")


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    _DEBUG["on"] = debug


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Overrides = None,
    config_dir: Annotated[
        Path | None,
        typer.Option(
            "--config-dir", help="Your own configs and presets; searched before ampctl's conf/."
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name", help="Run folder name under trainer.runs_dir (default: <preset>-<time>)."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Continue a run: its folder (latest checkpoint) or a checkpoint file. Overrides may change e.g. trainer.max_steps.",
        ),
    ] = None,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="With --resume: allow the checkpoint's model._target_ even if it does not ship "
            "with ampctl (a checkpoint is data; by default nothing it names is imported).",
        ),
    ] = False,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the composed, resolved config and exit.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only the final summary.")
    ] = False,
    plain: Annotated[
        bool, typer.Option("--plain", help="One plain line per log interval, even on a terminal.")
    ] = False,
) -> None:
    """Train under the protected mixed-precision loop.

    Writes <trainer.runs_dir>/<name>/ (runs/<name>/ by default): config.yaml, metrics.jsonl,
    events.jsonl, checkpoints/, summary.json, and plot.png when matplotlib is installed.
    Ctrl-C finishes the current step, writes a checkpoint and prints how to resume.
    """
    from ampctl.commands.train import run_train

    try:
        with _bad_input():
            code = run_train(
                overrides=list(overrides or []),
                config_dir=config_dir,
                name=name,
                resume=resume,
                trust_code=trust_code,
                print_config=print_config,
                mode="quiet" if quiet else ("plain" if plain else "auto"),
            )
    except OSError as e:  # a write outside the loop (config.yaml, a resume's trim): exit 1
        from ampctl.commands.train import write_failure

        _fail(write_failure(e), 1)
    raise typer.Exit(code)


@app.command("sweep-scale")
def sweep_scale(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="The grid, as Hydra sweeps: scaler.init_scale=1024,4096,65536 "
            "scaler.growth_interval=range(100,2001,400) (default grid: init_scale "
            "{2^10,2^13,2^16} x growth_interval {100,500,2000}); other " + OVERRIDES_HELP,
            show_default=False,
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option("--steps", help="Steps per trial (default: trainer.max_steps)."),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            help="Trials in flight at once (default: 1 with --launcher local, capped at the "
            "cores; all of a rung with ray/slurm, where the cluster queues them).",
            show_default=False,
        ),
    ] = None,
    halving: Annotated[
        int | None,
        typer.Option(
            "--halving",
            metavar="ETA",
            help="Successive halving: every trial runs steps/ETA^k first; the best 1/ETA continue "
            "from their checkpoints, rung by rung, to the full --steps.",
            show_default=False,
        ),
    ] = None,
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline/--no-baseline",
            help="Also run a baseline trial (fp32; bf16 on a CUDA device that has it) that the "
            "trials' loss is compared with.",
        ),
    ] = True,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Sweep folder under trainer.runs_dir; re-running it keeps finished trials and "
            "continues interrupted ones.",
        ),
    ] = None,
    config_dir: ConfigDir = None,
    launcher: Annotated[
        str,
        typer.Option(
            "--launcher",
            help="Where trials run: local (child processes), ray (Ray tasks), slurm (SLURM jobs "
            "via submitit). ray and slurm need the sweep folder on a filesystem the nodes share.",
        ),
    ] = "local",
    address: Annotated[
        str | None,
        typer.Option(
            "--address", help="ray: join this Ray cluster (default: start a local Ray here)."
        ),
    ] = None,
    cpus_per_trial: Annotated[
        int | None,
        typer.Option(
            "--cpus-per-trial",
            help="CPUs (and threads) per trial (default: ray/slurm 1; local: the cores shared "
            "out between --jobs).",
            show_default=False,
        ),
    ] = None,
    gpus_per_trial: Annotated[
        float | None,
        typer.Option("--gpus-per-trial", help="ray/slurm: GPUs per trial.", show_default=False),
    ] = None,
    partition: Annotated[
        str | None, typer.Option("--partition", help="slurm: the partition.")
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time", help="slurm: time limit per trial (minutes, HH:MM:SS or D-HH:MM:SS)."
        ),
    ] = None,
    slurm_param: Annotated[
        list[str] | None,
        typer.Option(
            "--slurm-param",
            metavar="KEY=VALUE",
            help="slurm: an extra sbatch parameter, e.g. --slurm-param account=proj (repeatable).",
            show_default=False,
        ),
    ] = None,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain lines instead of the live table.")
    ] = False,
) -> None:
    """Sweep loss-scaling settings with real training runs and recommend the best.

    Every trial trains with the same seed and data order in runs/<sweep>/<trial>/. Results go to
    results.csv / results.json; the recommendation is printed as overrides ready to paste.
    """
    from ampctl.commands.sweep import LauncherOptions, run_sweep

    _at_least("--steps", steps, 1)
    _at_least("--jobs", jobs, 1)
    _at_least("--halving", halving, 2)

    with _bad_input():
        code = run_sweep(
            overrides=list(overrides or []),
            steps=steps,
            jobs=jobs,
            baseline=baseline,
            name=name,
            config_dir=config_dir,
            mode="plain" if plain else "auto",
            halving=halving,
            launcher=LauncherOptions(
                launcher=launcher,
                address=address,
                cpus_per_trial=cpus_per_trial,
                gpus_per_trial=gpus_per_trial,
                partition=partition,
                time=time_limit,
                slurm_params=tuple(slurm_param or ()),
            ),
        )
    raise typer.Exit(code)


@app.command()
def diagnose(
    path: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint file or folder: an ampctl run folder or step_*.pt, an HF Trainer "
            "checkpoint-N/ or output_dir, an Accelerate save_state folder, a Lightning .ckpt, a "
            "torch.distributed.checkpoint or DeepSpeed folder, a .safetensors or .pt/.pth/.bin "
            "file.",
            show_default=False,
        ),
    ],
    batches: Annotated[
        int, typer.Option("--batches", "-b", help="Batches to replay with hooks.")
    ] = 2,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision",
            help="Replay precision (default: the run's): fp32, bf16, fp16, fp16-pure, fp8.",
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = "auto",
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="Force a reader instead of detecting it: ampctl, hf-trainer, accelerate, "
            "lightning, dcp, deepspeed, safetensors, state-dict.",
        ),
    ] = None,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="Allow the replay to import the model a checkpoint's config names although it "
            "does not ship with ampctl (a checkpoint is data: off by default).",
        ),
    ] = False,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Your text to replay: a text file for Hugging Face checkpoints (tokenized by the "
            "tokenizer saved beside it), a file or folder of .txt for an ampctl data=text run. "
            "Without it the replay uses synthetic batches of the run's shape and opens no path "
            "the checkpoint's config names (unless --trust-code).",
        ),
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory",
            help="Memory the checkpoint may take, e.g. 64G (default: 80% of the free memory, "
            "within the process's address-space limit); estimated before anything is allocated.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the report as JSON; the schema is documented in "
            "ampctl/commands/diagnose/report.py (python -m pydoc ampctl.commands.diagnose.report).",
        ),
    ] = False,
    no_probe: Annotated[
        bool,
        typer.Option(
            "--no-probe",
            help="Do not try the advice before printing it (by default an ampctl run's "
            "recommended change is trained for a few steps from the recommended checkpoint, and "
            "an lr from a small ladder the history gives).",
        ),
    ] = False,
    rebuild: Annotated[
        str | None,
        typer.Option(
            "--rebuild",
            help="MODULE:FUNCTION, your factory of the run's model and batches, so that the "
            "advice for a run ampctl cannot rebuild (a ProtectedRun folder, a Lightning .ckpt, a "
            "state dict) is tried too; it is imported and run (your code, as --trust-code). "
            "FUNCTION(config) returns {'model': ..., 'batch': index -> dict, 'optimizer': "
            "(params, lr) -> optimizer (optional)}.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Explain a NaN run: bad tensors, first overflowing module, what to change.

    Exit code 0 when healthy, 1 when problems were found, 2 for bad input.

    Files are read as data (weights_only=True, safetensors); pickled objects are refused.

    Nothing a checkpoint's config names is imported, and no path it names is opened, without
    --trust-code. Files read whole are capped at 64 MiB; memory is estimated first.
    """
    from ampctl.commands.diagnose import json_error, run_diagnose
    from ampctl.errors import UsageError
    from ampctl.trust import parse_size

    with _bad_input(json_error if as_json else None):  # --json: a JSON document on every exit
        if batches < 1:
            raise UsageError(f"--batches {batches}: must be an integer >= 1")
        code = run_diagnose(
            path=path,
            batches=batches,
            precision=precision,
            device=device,
            as_json=as_json,
            fmt=fmt,
            trust_code=trust_code,
            data=data,
            max_memory=parse_size(max_memory) if max_memory is not None else None,
            probe=not no_probe,
            rebuild=rebuild,
        )
    raise typer.Exit(code)


@app.command()
def bench(
    overrides: Overrides = None,
    steps: Annotated[
        int,
        typer.Option(
            "--steps",
            help="Scales every section (>= 2; default 20: 40 overhead pairs, 10 steps per precision).",
        ),
    ] = 20,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the figures as JSON (overhead.ratio, ...).")
    ] = False,
    config_dir: ConfigDir = None,
    sizes: Annotated[
        bool,
        typer.Option(
            "--sizes",
            help="Also measure the overhead and device ops at about 10M and 50M parameters "
            "(the same architecture, resized; minutes on a CPU).",
        ),
    ] = False,
) -> None:
    """Measure what protection costs, as ratios against a bare GradScaler loop.

    Overhead per step and in total, device ops per step beside GradScaler's, fused vs
    per-parameter overflow check, host reads per step, and a precision table (step time,
    tokens/s, memory)."""
    from ampctl.commands.bench import run_bench

    _at_least("--steps", steps, 2)

    with _bad_input():
        code = run_bench(
            overrides=list(overrides or []),
            steps=steps,
            as_json=as_json,
            config_dir=config_dir,
            sizes=sizes,
        )
    raise typer.Exit(code)


@app.command()
def plot(
    path: Annotated[
        Path, typer.Argument(help="A run folder or a sweep folder.", show_default=False)
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="PNG to write (default: plot.png in the folder)."),
    ] = None,
    baseline: Annotated[
        list[Path] | None,
        typer.Option(
            "--baseline",
            help="A run folder whose loss is overlaid (e.g. an fp32 run); repeat it to overlay several.",
        ),
    ] = None,
) -> None:
    """Draw a run or a sweep into a PNG (needs matplotlib).

    A run: loss, scale with skipped steps, overflow rate, grad norm and underflow, guard events.
    A sweep: heat map and scale trajectories."""
    from ampctl.commands.plot import run_plot

    with _bad_input():
        code = run_plot(path=path, out=out, baseline=baseline)
    raise typer.Exit(code)


tokenizer_app = typer.Typer(
    help="Tokenizers for data=hf: train one on your own corpus.", no_args_is_help=True
)
app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("train")
def tokenizer_train(
    path: Annotated[
        str,
        typer.Argument(
            help="The corpus, as data.path takes it: text/json/parquet file, folder, glob, or a "
            "save_to_disk folder.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder to write tokenizer.json into (new).")
    ],
    vocab_size: Annotated[
        int, typer.Option("--vocab-size", help="Tokens, specials included (data.vocab_size).")
    ] = 8192,
    min_frequency: Annotated[
        int, typer.Option("--min-frequency", help="Least count of a pair to merge.")
    ] = 2,
    text_field: Annotated[
        str, typer.Option("--text-field", help="Column of json/parquet/arrow rows.")
    ] = "text",
    fmt: Annotated[
        str, typer.Option("--format", help="auto, text, json, parquet or arrow.")
    ] = "auto",
) -> None:
    """Train a byte-level BPE tokenizer (the tokenizers library) on a local corpus, offline.

    Writes OUT/tokenizer.json and OUT/tokenizer_config.json; use them with
    data=hf data.tokenizer=OUT data.vocab_size=VOCAB_SIZE.
    """
    from ampctl.tokenizer import train_tokenizer

    with _bad_input():
        res = train_tokenizer(
            path,
            out,
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            text_field=text_field,
            format=fmt,
        )
    typer.echo(
        f"trained a byte-level BPE tokenizer: {res.vocab_size} tokens from {res.documents} "
        f"documents ({res.characters / 1e6:.2f}M characters) in {res.seconds:.1f} s -> "
        f"{res.out / 'tokenizer.json'}"
    )
    import shlex

    extra = (f" data.format={fmt}" if fmt != "auto" else "") + (
        f" {shlex.quote(f'data.text_field={text_field}')}" if text_field != "text" else ""
    )
    typer.echo(
        f"use it: ampctl train conf=gpt2_tiny data=hf {shlex.quote(f'data.path={path}')}{extra} "
        f"{shlex.quote(f'data.tokenizer={res.out}')} data.vocab_size={res.vocab_size}"
    )


def _paragraphs(text: str) -> str:
    """A docstring as help: its line breaks inside a paragraph joined (Typer's rich help keeps
    them, so a terminal narrower than the source breaks sentences in the middle)."""
    paras = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paras)


for _typer in (app, tokenizer_app):
    for _info in _typer.registered_commands:
        _doc = _info.help or (_info.callback.__doc__ if _info.callback else None)
        if _doc:
            _info.help = _paragraphs(_doc)


def main() -> None:
    """Entry point of ``python -m ampctl``."""
    app(prog_name="ampctl")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

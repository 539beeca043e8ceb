"""The run folder: its layout, its writers and its readers, in one place.

``runs/<name>/`` holds ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per logged step),
``events.jsonl`` (overflows, rollbacks, fallbacks, guard decisions, resumes), ``checkpoints/``,
``summary.json``, ``plot.png`` and, when a run was resumed from an earlier checkpoint,
``branches/`` with the history that the resume set aside (see :mod:`ampctl.runlog.branches`).

Everything that names a file of a run folder goes through :class:`RunLayout`; everything that
reads a JSONL file goes through :func:`read_jsonl` (one way to treat a bad line). New folders are
made by :func:`new_run_dir`, exclusively: an existing run is never overwritten.
"""

from .branches import (
    BranchInfo,
    branch_event,
    describe_lineage,
    fork_event,
    fork_into,
    list_branches,
    prepare_resume,
)
from .layout import RunLayout, is_run_dir
from .readers import JsonlRows, RunRecord, as_number, is_finite_number, read_json, read_jsonl
from .writers import (
    RunExistsError,
    RunWriter,
    atomic_write_text,
    default_run_name,
    dumps_row,
    new_run_dir,
)

__all__ = [
    "RunLayout",
    "is_run_dir",
    "RunWriter",
    "RunExistsError",
    "new_run_dir",
    "default_run_name",
    "atomic_write_text",
    "dumps_row",
    "JsonlRows",
    "RunRecord",
    "read_jsonl",
    "read_json",
    "as_number",
    "is_finite_number",
    "BranchInfo",
    "branch_event",
    "describe_lineage",
    "fork_event",
    "fork_into",
    "list_branches",
    "prepare_resume",
]

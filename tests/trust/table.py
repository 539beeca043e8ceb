"""The attack files of tests/trust/test_attacks.py as a table: what each did before issue #24
(the issue's own words) and what ampctl does with it now, run as the tests run it (one
subprocess, 4 GiB of address space, no payload may run).

    python -m tests.trust.table            # builds every case in a temporary folder (a minute)
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from .test_attacks import BUILDERS, Run, run_cases

#: What the issue measured before the fix (cases the issue did not list: "-").
BEFORE = {
    "dcp-non-tensor": "unpickled with weights_only=False (a payload runs); 'Healthy', exit 0",
    "dcp-dotted": "os.system reached through a dotted name in an allowed module; payload ran",
    "dcp-dotted-stealth": "payload ran, then the real metadata: a normal-looking report",
    "dcp-huge": "-",
    "ds-latest": "an 8 GB sparse `latest` read whole: OOM-killed",
    "hf-state-1g": "a 1 GB trainer_state.json read: 2.3 GB of memory",
    "shared-40": "a 2 KB .pt sharing references 40 levels deep: hung past 90 s, 3.6 GB",
    "hidden": "a saved config with hidden_size=24576: 4.9 GB allocated before any check",
    "st-valid": "a valid 2 GB safetensors tensor header: 6.9 GB, then a MemoryError traceback",
    "state-pickle-bytes": "trainer_state.json replaced by pickle bytes: 'Healthy', no word",
    "state-deep-json": "a deeply nested trainer_state.json: RecursionError, exit 1",
    "data-file": "a saved data.path=/etc/shadow was opened during the replay",
    "data-folder": "a saved data.path=/usr: the replay walked the file system",
    "state-symlink": "a trainer_state.json symlink to /etc/shadow: 'Healthy', no word",
    "yaml-tag": "!!python/object/apply in config.yaml: traceback, exit 1",
    "metrics-deep": "a deeply nested metrics.jsonl line: RecursionError, exit 1",
    "raw-pickle": "a raw .pkl payload: 'truncated or corrupt?'",
    "text": "'notes.txt' is not a readable checkpoint (truncated or corrupt?): 101",
}


def after(run: Run) -> str:
    """What a user sees: the one error line, or the report's verdict and its file notes."""
    if run.stderr:
        line = re.sub(r"'/[^']*/", "'.../", run.stderr[0])
        return f"exit {run.code}: {line.removeprefix('ampctl: error: ')}"
    try:
        rep = json.loads(run.stdout)
    except ValueError:
        first = next((x for x in run.stdout.splitlines() if x.strip()), "")
        return f"exit {run.code}: {first.strip()}"
    notes = [f"{f['file']}: {f['why']}" for f in rep.get("files", []) if not f.get("read", True)]
    verdict = rep.get("verdict", {}).get("summary") or ("healthy" if rep.get("healthy") else "")
    replay = rep.get("replay") or {}
    if replay.get("data"):
        notes.append(f"replay on {replay['data']}")
    elif replay.get("ran") is False and replay.get("reason"):
        notes.append(f"replay skipped: {replay['reason']}")
    return f"exit {run.code}: {verdict}" + "".join(f"; {n}" for n in notes)


def table(results: dict[str, Run]) -> str:
    rows = [
        "| case | before (#24) | now | payload ran | peak RSS |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in BUILDERS:
        r = results[name]
        now = re.sub(r"/tmp/ampctl-attacks-\w+/", "", after(r)).replace("|", "\\|")
        rows.append(
            f"| {name} | {BEFORE.get(name, '-')} | {now} | {'YES' if r.marker else 'no'} "
            f"| {r.rss_mb} MB |"
        )
    return "\n".join(rows)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ampctl-attacks-") as root:
        results = run_cases(Path(root))
    print(table(results))
    return 1 if any(r.marker for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

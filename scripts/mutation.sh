#!/usr/bin/env bash
# Mutation testing of the protection code with mutmut (issue 21). Not run in CI.
#
#   pip install -e ".[test,mutation]"
#   scripts/mutation.sh                      # every mutant, fresh (about 8 min on 2 idle cores)
#   scripts/mutation.sh 'ampctl.amp.guard.*' # only the mutants whose names match
#   MUTATION_KEEP=1 scripts/mutation.sh      # reuse mutants/ (re-tests changed functions only)
#   JOBS=4 scripts/mutation.sh               # parallel workers (default 2)
#   scripts/mutation.sh --report             # only the summary of the last run in mutants/
#
# What is mutated and which tests run: [tool.mutmut] in pyproject.toml. Afterwards
# `mutmut results` lists the survivors, `mutmut show NAME` shows one as a diff. The script ends
# with the score and exits 1 when a mutant survived that tests/mutation/survivors.md does not
# list (with why it is equivalent or accepted), or when no test reached a mutant.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c "import mutmut" 2>/dev/null; then
    echo "scripts/mutation.sh: mutmut is not installed; pip install -e '.[test,mutation]'" >&2
    exit 2
fi

# mutmut puts mutants/ first on sys.path and drops the checkout itself from it; a PYTHONPATH
# pointing at a checkout would let the tests import unmutated code.
unset PYTHONPATH
# One thread everywhere: the workers are forked from the process that ran the tests, and a
# thread pool started before a fork hangs the child (tests/conftest.py reads AMPCTL_TEST_THREADS).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 AMPCTL_TEST_THREADS=1
start=$(date +%s)
if [ "${1:-}" = --report ]; then
    [ -d mutants ] || { echo "scripts/mutation.sh: no mutants/ folder: run it first" >&2; exit 2; }
    start=""
else
    [ "${MUTATION_KEEP:-0}" = 1 ] || rm -rf mutants
    nice -n 19 mutmut run --max-children "${JOBS:-2}" "$@"
fi
end=$(date +%s)

python - "${start:+$((end - start))}" <<'EOF'
import json
import re
import sys
from collections import Counter
from pathlib import Path

status = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", None: "not checked"}
counts, survivors, untested = Counter(), [], []
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        s = status.get(code, "suspicious")
        counts[s] += 1
        if s == "survived":
            survivors.append(name)
        elif s in ("no tests", "timeout", "suspicious"):
            untested.append(f"{name} ({s})")
tested = sum(v for k, v in counts.items() if k != "not checked")
killed = counts["killed"]
print(f"\nmutation: {killed} killed, {counts['survived']} survived, {counts['timeout']} timeouts, "
      f"{counts['no tests']} without tests, {counts['suspicious']} suspicious, of {tested} "
      f"tested; score {killed / max(tested, 1):.1%}, survivors {counts['survived'] / max(tested, 1):.1%}"
      + (f"; wall {int(sys.argv[1]) // 60} min {int(sys.argv[1]) % 60} s" if sys.argv[1] else ""))
doc = Path("tests/mutation/survivors.md")
listed = set(re.findall(r"`([\w.ǁ]+__mutmut_\d+)`", doc.read_text() if doc.exists() else ""))
new = sorted(set(survivors) - listed)
if new:
    print(f"{len(new)} survivors not in tests/mutation/survivors.md (mutmut show NAME):")
    print("\n".join(f"  {n}" for n in new))
if untested:
    print("not reached by any selected test, or timed out:")
    print("\n".join(f"  {n}" for n in untested))
sys.exit(1 if new or untested else 0)
EOF

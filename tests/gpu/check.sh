#!/usr/bin/env bash
# ampctl's GPU checks: one prepared script for a machine with an NVIDIA GPU and torch (CUDA).
#
#   bash tests/gpu/check.sh prepare   on a machine where ampctl's dependencies are installed:
#                                     copy the pure-Python ones that a bare GPU image may lack
#                                     (hydra-core, omegaconf, antlr4 runtime; about 2 MB; and
#                                     torchao's Python code for fp8 when it is installed, about
#                                     6 MB without its prebuilt kernels, which float8 training
#                                     does not use) into .gpu-deps/, to send along with the
#                                     working tree
#   bash tests/gpu/check.sh           on the GPU machine: run the checks, write to $OUT
#
# The checks (each step has its own time limit, cut to what is left of a 9.5-minute budget
# for the whole script, so it ends within 10 minutes; a step with under 30 s left is skipped
# and counted as failed):
#   1. pytest tests/gpu -m gpu: LossScaler vs torch.amp.GradScaler("cuda") on planted overflows,
#      host reads per step 1 (standard) and 0 (fused AdamW) on CUDA, a skipped step on the fused
#      path, the bench's CUDA code paths, fp8 host reads and 8 fp8 steps, and 4 fp16 steps of
#      conf=bert_large end to end.
#   2. ampctl bench conf=bert_large --json: protection overhead, fused vs per-parameter overflow
#      check, host reads, and the precision table (fp32, bf16, fp16, fp16-pure, fp8 eager: step
#      time, tokens/s, peak memory), on BERT-Large at the preset's batch 64 x seq 512.
#   3. tests/gpu/fp8_vs_bf16.py: BERT-Large bf16 vs fp8 tokens/s and peak memory, eager then
#      under trainer.compile=true (the fast fp8 path); each result is written as it is measured,
#      so a step cut short by the budget keeps what it finished.
#
# Output in $OUT (default ./gpu-check-out): env.txt, pytest.log, bench_bert_large.json,
# bench_bert_large.txt (the table), bench_bert_large.log (progress), fp8_vs_bf16.jsonl (one
# line per precision and mode), fp8_vs_bf16.log, check.log (all of it).
# Exit status: 0 when every step passed, else the number of failed steps.
# Nothing heavy is installed: torch must be there already; ampctl runs from this checkout.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
PY="${PYTHON:-python3}"

if [ "${1:-}" = "prepare" ]; then
    rm -rf .gpu-deps && mkdir -p .gpu-deps || exit 1
    "$PY" - <<'EOF' || exit 1
import importlib, pathlib, shutil
for name in ("hydra", "omegaconf", "antlr4", "torchao"):
    try:
        src = pathlib.Path(importlib.import_module(name).__file__).parent
    except ImportError:
        print(f"{name} is not installed here: not copied (fp8 checks will report it missing)")
        continue
    # torchao: its Python code only; float8 training does not use its prebuilt kernels (*.so)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(src, pathlib.Path(".gpu-deps") / name, ignore=skip)
    print(f"copied {name} from {src}")
EOF
    du -sh .gpu-deps
    echo "Keep .gpu-deps out of git (echo /.gpu-deps/ >> .git/info/exclude) and carry it to the GPU machine."
    exit 0
fi

OUT="${OUT:-$REPO/gpu-check-out}"
mkdir -p "$OUT" || exit 1
exec > >(tee -a "$OUT/check.log") 2>&1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# the carried deps go last on the path: what the GPU image has installed itself wins
if [ -d "$REPO/.gpu-deps" ]; then
    export PYTHONPATH="$PYTHONPATH:$REPO/.gpu-deps"
fi

failed=0
BUDGET=570  # seconds for the whole script (SECONDS counts from its start)
step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, output also to LOG
    local name="$1" limit="$2" log="$3"
    shift 3
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "=== $name: skipped, ${left}s left of the ${BUDGET}s budget ===" | tee "$log"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== $name (limit ${limit}s) ==="
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0))s ==="
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
    "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), "bf16:", torch.cuda.is_bf16_supported())
for name in ("hydra", "omegaconf", "rich", "typer", "pytest", "torchao"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as e:
        print(name, "MISSING:", e, "(run `bash tests/gpu/check.sh prepare` where ampctl is installed)")
EOF
} | tee "$OUT/env.txt"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to check here (on CPU, pytest tests/gpu skips these tests)"
    exit 1
fi
if ! "$PY" -c "import ampctl.config" 2>/dev/null; then
    echo "ampctl cannot be imported (missing hydra-core/omegaconf?): run 'bash tests/gpu/check.sh prepare'"
    echo "on a machine where ampctl is installed and carry .gpu-deps along"
    exit 1
fi

step "pytest tests/gpu" 240 "$OUT/pytest.log" \
    "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider -o addopts=  # in this process (no xdist)

# stdout (the JSON) goes to its file; the progress lines (stderr) to the log
step "ampctl bench conf=bert_large" 330 "$OUT/bench_bert_large.log" \
    bash -c 'exec "$0" -m ampctl bench conf=bert_large --json >"$1"' "$PY" "$OUT/bench_bert_large.json"
if [ -s "$OUT/bench_bert_large.json" ]; then
    "$PY" - "$OUT/bench_bert_large.json" <<'EOF' | tee "$OUT/bench_bert_large.txt"
import json, sys
from rich.console import Console
from ampctl.commands.bench import print_report
print_report(json.load(open(sys.argv[1])), Console(width=150, force_terminal=False))
EOF
fi

# fp8 vs bf16 on BERT-Large, eager and compiled: whatever the budget leaves (a line per result)
if "$PY" -c "import torchao.float8" 2>/dev/null; then
    rm -f "$OUT/fp8_vs_bf16.jsonl"
    step "fp8 vs bf16, conf=bert_large, eager and compiled" 330 "$OUT/fp8_vs_bf16.log" \
        "$PY" tests/gpu/fp8_vs_bf16.py "$OUT/fp8_vs_bf16.jsonl" --steps 10
else
    echo "=== fp8 vs bf16: skipped, torchao is not importable (bash tests/gpu/check.sh prepare) ==="
    failed=$((failed + 1))
fi

echo "=== done: $failed step(s) failed; results in $OUT ==="
exit "$failed"

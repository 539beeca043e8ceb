#!/usr/bin/env bash
# The "why protection matters" table (README): conf=underflow in five precisions, two runs at a
# time, then one plot with the other four overlaid on the protected run, and the table.
# Usage: scripts/why_protection.sh [RUNS_DIR] [extra overrides...]   (about 10 min on 2 cores)
set -euo pipefail
out=${1:-runs/why}; shift || true
mkdir -p "$out"
run() {  # name overrides...
  local name=$1; shift
  if [ -f "$out/$name/summary.json" ]; then echo "kept $out/$name"; return; fi
  ampctl train conf=underflow trainer.runs_dir="$out" --name "$name" -q logging.plot=false "$@" "${extra[@]}" \
    > "$out/$name.log" 2>&1 || true
  echo "done $out/$name"
}
extra=("$@")
run fp32 precision=fp32 & run fp16-unscaled precision=fp16 scaler.init_scale=1 scaler.min_scale=1 scaler.max_scale=1; wait
run fp16-fixed-2e24 precision=fp16 scaler.init_scale=16777216 scaler.min_scale=16777216 scaler.max_scale=16777216 guard=off & \
  run fp16-ampctl precision=fp16; wait
run bf16 precision=bf16
ampctl plot "$out/fp16-ampctl" --out "$out/why.png" --baseline "$out/fp32" --baseline "$out/fp16-unscaled" \
  --baseline "$out/bf16" --baseline "$out/fp16-fixed-2e24" || true
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
names = ["fp32", "fp16-unscaled", "fp16-fixed-2e24", "fp16-ampctl", "bf16"]
ref = None
print("| run | final loss | gap to fp32 | skipped steps | act-grad underflow | act-grad zeros | param-grad underflow |")
print("|---|---|---|---|---|---|---|")
for n in names:
    d = out / n
    s = json.loads((d / "summary.json").read_text())
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
    last = rows[-1]
    loss = s.get("final_loss")
    if n == "fp32":
        ref = loss
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"
    gap = "-" if ref is None or loss is None else f"{100 * (loss - ref) / ref:+.1f}%"
    print(f"| {n} | {loss:.4f} | {gap} | {s.get('skipped')} | {pct(last.get('act_grad_underflow_frac'))} "
          f"| {pct(last.get('act_grad_zero_frac'))} | {pct(last.get('grad_underflow_frac'))} |")
PY
